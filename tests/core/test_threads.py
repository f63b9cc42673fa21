"""The CPU thread policy of the exl3 commands (exl3_core/threads.py): OpenMP waits passively unless the
user says otherwise, and torch gets EXL3_NUM_THREADS, the user's OMP_NUM_THREADS, or the physical cores."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from exl3_core import threads


def _child(code: str, **env: str | None) -> str:
    e = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "EXL3_NUM_THREADS")}
    e.update({k: v for k, v in env.items() if v is not None})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


PROBE = ("import os; from exl3_core import threads; before = threads.prepare_env(); import torch; "
         "n = threads.configure(); print(before, os.environ.get('OMP_WAIT_POLICY'), n, torch.get_num_threads())")


def test_passive_wait_and_physical_cores_by_default() -> None:
    before, policy, n, torch_n = _child(PROBE).split()
    assert before == "True" and policy == "PASSIVE"
    assert int(n) == int(torch_n) == threads.physical_cores()


def test_user_settings_win() -> None:
    _, policy, n, _ = _child(PROBE, OMP_WAIT_POLICY="ACTIVE", EXL3_NUM_THREADS="1").split()
    assert policy == "ACTIVE" and n == "1"
    _, _, n, _ = _child(PROBE, OMP_NUM_THREADS="1").split()
    assert n == "1"  # the user's OMP_NUM_THREADS is left alone (not raised to the core count)


def test_prepare_env_refuses_after_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch  # noqa: F401  (already loaded in the test process)

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert threads.prepare_env() is False and "OMP_WAIT_POLICY" not in os.environ


def test_physical_cores_counts_sibling_sets() -> None:
    cpus = os.sched_getaffinity(0)
    sets = set()
    for c in cpus:
        path = f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list"
        sets.add(Path(path).read_text().strip() if os.path.exists(path) else c)
    limit = threads._cgroup_cpu_limit()
    assert threads.physical_cores() == (min(len(sets), limit) if limit else len(sets))
    assert 1 <= threads.physical_cores() <= len(cpus)


def test_bad_thread_count_names_the_variable(clean_settings: pytest.MonkeyPatch) -> None:
    from exl3_core import settings

    clean_settings.setenv("EXL3_NUM_THREADS", "two")
    with pytest.raises(ValueError, match="EXL3_NUM_THREADS"):
        settings.reload()
        threads.choose_threads()
