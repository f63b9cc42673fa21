"""A tensor-parallel group: this process (rank 0) plus one worker process per other device, started by exl3
itself with torch.multiprocessing (spawn) and joined in one torch.distributed process group.

Rank 0 drives: each command (load a model, run a step, ...) goes to every worker over its pipe, then all
ranks meet in the collectives. The pipes also carry the workers' answers and, from a worker that cannot go
on, its error. Nothing waits without a bound: replies and collectives have the group's timeout
(``EXL3_TP_TIMEOUT``; loads ``EXL3_TP_LOAD_TIMEOUT``), and a worker that died is noticed before each
command. A group that failed once stays failed: every later request raises :class:`ParallelError` with the
first failure's reason, and its workers are stopped. Workers never outlive rank 0: each watches rank 0's
process and exits when it is gone, however it ended.
"""
from __future__ import annotations

import atexit
import datetime
import os
import signal
import threading
import time
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from exl3_core import settings
from exl3_core.parallel.comm import GroupComm, backend_for
from exl3_core.parallel.protocol import (
    Answer,
    Command,
    Done,
    Fatal,
    Hello,
    ParallelError,
    Ready,
    Stop,
    WorkerBoot,
)
from exl3_core.parallel.worker import worker_main

#: seconds a starting worker may take to import torch and exl3 and join the group
STARTUP_TIMEOUT = 300.0
#: seconds a stopping worker gets before it is killed
STOP_GRACE = 5.0

_live: weakref.WeakSet[WorkerGroup] = weakref.WeakSet()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def resolve_devices(devices: Sequence[str | torch.device]) -> list[torch.device]:
    """One device per rank, checked: all CPU or all CUDA, distinct CUDA indices that exist.

    :raises ValueError: naming the offending device."""
    devs = [torch.device(d) for d in devices]
    if not devs:
        raise ValueError("a tensor-parallel group needs at least one device")
    kinds = {d.type for d in devs}
    if len(kinds) > 1 or not kinds <= {"cpu", "cuda"}:
        raise ValueError(f"tensor-parallel devices must be all 'cpu' or all 'cuda' devices, got "
                         f"{[str(d) for d in devs]}")
    if "cuda" in kinds:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        idx = [d.index if d.index is not None else 0 for d in devs]
        devs = [torch.device("cuda", i) for i in idx]
        if len(set(idx)) != len(idx):
            raise ValueError(f"tensor-parallel devices repeat a GPU: {[str(d) for d in devs]}; give each rank its own")
        missing = [str(d) for d, i in zip(devs, idx) if i >= count]
        if missing:
            raise ValueError(f"tensor-parallel devices {missing} do not exist: this machine has {count} CUDA "
                             f"device(s); use a smaller tensor_parallel_size or list existing devices")
    return devs


class WorkerGroup:
    """Start ``len(devices) - 1`` worker processes and join them with this process in one process group
    (gloo on the CPU, NCCL on CUDA). Models load into it with ``model.load(parallel_group=group)`` (several
    may share one group), or a load with ``tensor_parallel_size`` starts its own.

    :param devices: one per rank; ``devices[0]`` is this process's.
    :param timeout: seconds any collective or reply may take (default ``EXL3_TP_TIMEOUT``).
    :param load_timeout: seconds a model load may take on the workers (default ``EXL3_TP_LOAD_TIMEOUT``).
    :raises ParallelError: when a worker cannot start or join (its error included); nothing is left running.
    """

    def __init__(self, devices: Sequence[str | torch.device], *, timeout: float | None = None,
                 load_timeout: float | None = None) -> None:
        s = settings.get()
        self.devices = resolve_devices(devices)
        self.world = len(self.devices)
        if self.world < 2:
            raise ValueError("a WorkerGroup has at least two ranks (one device is an ordinary load)")
        self.timeout = float(timeout if timeout is not None else s.tp_timeout)
        self.load_timeout = float(load_timeout if load_timeout is not None else s.tp_load_timeout)
        self.backend = backend_for(self.devices[0])
        self.failure: str | None = None
        self.closed = False
        self.lock = threading.RLock()
        self._next_id = 0
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self.comm: GroupComm | None = None
        if self.backend == "nccl":
            # NVLink SHARP multicast stays off: it needs multicast resources from the fabric manager that many
            # hosts do not grant, and NCCL then fails as the communicator starts
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        try:
            self._start()
        except BaseException:
            self._kill_all()
            raise
        _live.add(self)

    # -- start-up -------------------------------------------------------------------------------------------------
    def _start(self) -> None:
        store = dist.TCPStore("127.0.0.1", 0, self.world, True, timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT),
                              wait_for_workers=False)
        self._store = store
        ctx = mp.get_context("spawn")
        threads = max(1, (os.cpu_count() or 1) // self.world) if self.devices[0].type == "cpu" else 1
        for r in range(1, self.world):
            boot = WorkerBoot(rank=r, devices=tuple(str(d) for d in self.devices), port=store.port,
                              timeout=self.timeout, startup_timeout=STARTUP_TIMEOUT, threads=threads,
                              parent_pid=os.getpid())
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=worker_main, args=(boot, child), name=f"exl3-tp-rank{r}", daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for r in range(1, self.world):
            self._expect(r, Hello, deadline, "start")
        self.comm = GroupComm.connect(store, 0, self.world, self.devices[0], timeout=self.timeout,
                                      connect_timeout=STARTUP_TIMEOUT)
        for r in range(1, self.world):
            self._expect(r, Ready, deadline + STARTUP_TIMEOUT, "join the process group")

    # -- talking to the workers -----------------------------------------------------------------------------------
    def new_id(self) -> int:
        with self.lock:
            self._next_id += 1
            return self._next_id

    def pids(self) -> list[int]:
        """The workers' process ids, by rank (rank 1 first)."""
        return [p.pid for p in self.procs if p.pid is not None]  # every started process has one

    def check(self) -> None:
        """Raise if the group failed or a worker is gone (the group is then failed for good)."""
        if self.failure is not None:
            raise ParallelError(f"the tensor-parallel group is unusable: {self.failure}; unload the model and load it "
                                f"again")
        if self.closed:
            raise ParallelError("the tensor-parallel group was closed; load the model again")
        for r, p in enumerate(self.procs, 1):
            if not p.is_alive():
                self.fail(f"worker rank {r} (pid {p.pid}) {_describe_exit(p.exitcode)}")
                self.check()

    def send(self, cmd: Command) -> None:
        """Send ``cmd`` to every worker (in order with every earlier command)."""
        with self.lock:
            self.check()
            for r, c in enumerate(self.conns, 1):
                try:
                    c.send(cmd)
                except (OSError, EOFError) as e:
                    self.fail(f"worker rank {r} cannot be reached ({type(e).__name__}: {e})")
                    self.check()

    def collect(self, what: str, timeout: float) -> list[Done]:
        """Every worker's :class:`Done` for the last command (rank 1 first), all within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        return [self._expect(r, Done, deadline, what) for r in range(1, self.world)]

    def _expect(self, rank: int, kind: type, deadline: float, what: str) -> Any:
        """The next answer of worker ``rank``, which must be a ``kind``, by the monotonic time ``deadline``."""
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.fail(f"worker rank {rank} did not {what} in time")
                self.check()
            try:
                ready = conn.poll(min(left, 0.5))
            except (OSError, EOFError):
                ready = False
            if ready:
                try:
                    msg: Answer = conn.recv()
                except (OSError, EOFError):
                    msg = Fatal(f"its pipe closed ({_describe_exit(proc.exitcode)})")
                if isinstance(msg, Fatal):
                    self.fail(f"worker rank {rank} failed to {what}: {msg.error}")
                    self.check()
                if isinstance(msg, kind):
                    return msg
                self.fail(f"worker rank {rank} answered {type(msg).__name__} where {kind.__name__} was expected")
                self.check()
            elif not proc.is_alive():
                self.fail(f"worker rank {rank} (pid {proc.pid}) {_describe_exit(proc.exitcode)} before it could {what}")
                self.check()

    def _reports(self, grace: float) -> list[str]:
        """What each worker says about a failure: the error it sent before exiting, or how it ended (waiting up
        to ``grace`` seconds for workers still running to send theirs)."""
        out: list[str] = []
        deadline = time.monotonic() + grace
        for r, (c, p) in enumerate(zip(self.conns, self.procs), 1):
            said = None
            while said is None:
                try:
                    if not c.poll(max(0.0, min(deadline - time.monotonic(), 0.2))):
                        if p.is_alive() and time.monotonic() < deadline:
                            continue
                        break
                    msg = c.recv()
                except (OSError, EOFError):  # its end closed: it is exiting, let it finish to tell how
                    p.join(max(0.0, deadline - time.monotonic()))
                    break
                if isinstance(msg, Fatal):
                    said = msg.error
            if said is not None:
                out.append(said)  # a worker's report names its rank and device
            elif not p.is_alive():
                out.append(f"worker rank {r} (pid {p.pid}) {_describe_exit(p.exitcode)}")
        return out

    # -- failure and shutdown -------------------------------------------------------------------------------------
    def fail(self, reason: str, grace: float = 2.0) -> str:
        """Mark the group failed for good (the first failure stays), gather what the workers reported (dead
        workers first: they are the usual cause), stop them. Returns the full reason."""
        with self.lock:
            if self.failure is not None:
                return self.failure
            reports = [r for r in self._reports(grace) if r not in reason]
            self.failure = "; ".join([*reports, reason]) if reports else reason
            self._kill_all()
            return self.failure

    def close(self) -> None:
        """Stop the workers (they drop every model) and leave the group. Idempotent."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if self.failure is None:
                for c in self.conns:
                    try:
                        c.send(Stop())
                    except (OSError, EOFError):
                        pass
            deadline = time.monotonic() + STOP_GRACE
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
            self._kill_all()
            _live.discard(self)

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(STOP_GRACE)
        for c in self.conns:
            c.close()
        if self.comm is not None:
            self.comm.shutdown()
            self.comm = None

    def __repr__(self) -> str:
        state = "failed" if self.failure else "closed" if self.closed else "running"
        return f"WorkerGroup({[str(d) for d in self.devices]}, {self.backend}, {state})"


@atexit.register
def _close_live_groups() -> None:
    for g in list(_live):
        g.close()
