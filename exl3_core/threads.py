"""CPU thread policy for exl3's commands: how many torch threads, and how idle OpenMP threads wait.

Two things make CPU generation collapse on a machine that other processes keep busy:

* OpenMP's default wait policy lets a thread that finished its share of a parallel region spin for
  a while before sleeping. A decode step runs hundreds of small parallel regions, so the spinning
  threads take CPU time from the one thread that still has work (and from the other processes).
  ``OMP_WAIT_POLICY=PASSIVE`` makes them sleep at once. libgomp reads it when it is loaded, i.e. at
  ``import torch``: :func:`prepare_env` must run before that.
* More threads than physical cores (SMT siblings, a container's CPU quota below the visible CPU
  count) make every parallel region wait for a thread that is not running.

:func:`configure` sets torch's intra-op pool: ``EXL3_NUM_THREADS`` when set, else the user's own
``OMP_NUM_THREADS`` is left alone, else the number of physical cores this process may run on.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

#: OpenMP variables :func:`prepare_env` sets when the user has not
OMP_DEFAULTS: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE"}


def prepare_env() -> bool:
    """Set the OpenMP defaults in ``os.environ`` unless the user set them. Returns False (and changes
    nothing) when torch is already imported, since its OpenMP runtime has read the environment then."""
    if "torch" in sys.modules:
        return False
    for k, v in OMP_DEFAULTS.items():
        os.environ.setdefault(k, v)
    return True


def _cgroup_cpu_limit() -> int | None:
    """Whole CPUs granted by a cgroup-v2 quota (``cpu.max``), None when unlimited or unreadable."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text(encoding="ascii").split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, int(quota) // int(period))
    except (ValueError, ZeroDivisionError):
        return None


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (SMT siblings counted once), capped by a
    cgroup CPU quota. Falls back to the CPU count where the topology is not readable."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores: set[str] = set()
    for c in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
                      .read_text(encoding="ascii").strip())
        except OSError:
            cores.add(f"cpu{c}")
    n = max(1, len(cores))
    limit = _cgroup_cpu_limit()
    return min(n, limit) if limit is not None else n


def _user_omp_threads() -> bool:
    v = os.environ.get("OMP_NUM_THREADS", "").strip()
    return v.isdigit() and int(v) > 0


def choose_threads() -> int:
    """The intra-op thread count :func:`configure` applies (0: leave torch's own choice)."""
    from exl3_core import settings

    want = settings.get().num_threads
    if want > 0:
        return want
    if _user_omp_threads():
        return 0
    return physical_cores()


def configure() -> int:
    """Apply :func:`choose_threads` to torch; returns the thread count torch uses afterwards."""
    import torch

    n = choose_threads()
    if n > 0 and n != torch.get_num_threads():
        torch.set_num_threads(n)
    return torch.get_num_threads()
