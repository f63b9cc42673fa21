"""A tensor-parallel worker process: one rank of a :class:`~exl3_core.parallel.WorkerGroup`.

It joins the process group, then serves rank 0's commands in order: build and load its share of a model
(and caches for it), copy cache pages, and run steps (the metadata broadcast, its share of the forward
through the execution plan with the group's reductions, its logits slice gathered to rank 0). A command
that fails before any collective (a load, a cache that does not fit) is answered with the error and the
worker goes on; a step that fails mid-collective cannot be resumed, so the worker reports the error and
exits, and rank 0 fails the group. It exits when its pipe closes (rank 0 gone) or on :class:`Stop`.
"""
from __future__ import annotations

import datetime
import importlib
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from exl3_core.archkit.config import Config
from exl3_core.archkit.model import Model
from exl3_core.cache.cache import Cache
from exl3_core.parallel.comm import GroupComm, unpack_meta
from exl3_core.parallel.protocol import (
    CacheSpec,
    CopyPage,
    Done,
    Fatal,
    Forward,
    FreeCache,
    Hello,
    LoadModel,
    NewCache,
    PluginRecipe,
    Ready,
    Stop,
    UnloadModel,
    WorkerBoot,
)
from exl3_core.parallel.sharding import RankSharder, rank_geometry
from exl3_core.plan.plan import ExecutionPlan
from exl3_core.plugins import load_plugins
from exl3_core.plugins.registry import resolve_ref

#: this process's rank in its tensor-parallel group (set as a worker starts; rank 0 is every other process)
_rank = 0


def worker_rank() -> int:
    """This process's rank in its tensor-parallel group: a worker's own, 0 in any other process."""
    return _rank


def _leave_with_parent(parent_pid: int) -> None:
    """Exit as soon as rank 0's process is gone, however it ended (a thread watches: the main thread may be
    blocked in a collective). The kernel's parent-death signal would not do: it follows the thread that
    started the worker, which may end long before rank 0 does."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="exl3-tp-parent-watch", daemon=True).start()


def _error_text(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


class WorkerState:
    """The models and caches one worker holds, and how it runs commands on them."""

    def __init__(self, boot: WorkerBoot, comm: GroupComm) -> None:
        self.rank = boot.rank
        self.world = len(boot.devices)
        self.device = torch.device(boot.devices[boot.rank])
        self.comm = comm
        self.models: dict[int, Model] = {}
        self.caches: dict[tuple[int, int], Cache] = {}
        self.plans: dict[tuple[int, Any], ExecutionPlan] = {}
        self.plugins: dict[PluginRecipe, Any] = {}

    def _plugins(self, recipe: PluginRecipe) -> Any:
        if recipe not in self.plugins:
            extra = [importlib.import_module(m) for m in recipe.extra]
            self.plugins[recipe] = load_plugins(allow=recipe.allow, block=recipe.block, extra=extra)
        return self.plugins[recipe]

    def _cache(self, model: Model, spec: CacheSpec) -> Cache:
        return Cache(rank_geometry(model, self.rank, self.world), spec.max_num_tokens, spec.variant, spec.page_size,
                     model.plugins, **spec.layer_kwargs)

    def load(self, cmd: LoadModel) -> Done:
        r = cmd.recipe
        config = Config(r.directory, r.config, plugins=self._plugins(r.plugins))
        model = resolve_ref(r.model_class, what="model class")(config)
        caches = [self._cache(model, spec) for spec in cmd.caches]
        model.load(device=self.device, dtype=cmd.dtype, attention=cmd.attention, source=cmd.source, caches=caches,
                   shard=RankSharder(self.rank, self.world, cmd.expert_parallel))
        self.models[cmd.model_id] = model
        for spec, cache in zip(cmd.caches, caches):
            self.caches[(cmd.model_id, spec.cache_id)] = cache
        return Done(report=model.memory_report())

    def unload(self, model_id: int) -> None:
        model = self.models.pop(model_id, None)
        for key in [k for k in self.caches if k[0] == model_id]:
            self.caches.pop(key).free()
        for key in [k for k in self.plans if k[0] == model_id]:
            del self.plans[key]
        if model is not None:
            model.unload()

    def new_cache(self, cmd: NewCache) -> Done:
        model = self.models[cmd.model_id]
        cache = self._cache(model, cmd.spec)
        cache.allocate(model.device, model.dtype)
        self.caches[(cmd.model_id, cmd.spec.cache_id)] = cache
        return Done()

    def forward(self, cmd: Forward) -> None:
        model = self.models[cmd.model_id]
        cache = None if cmd.cache_id is None else self.caches[(cmd.model_id, cmd.cache_id)]
        buf = torch.empty(cmd.header.numel, dtype=torch.int64, device=self.device)
        meta = unpack_meta(cmd.header, self.comm.broadcast_(buf))
        key = (cmd.model_id, cmd.tuning)
        plan = self.plans.get(key)
        if plan is None or not plan.current:
            plan = self.plans[key] = ExecutionPlan(model, cmd.tuning)
        assert plan.executor is not None, "the loader admits standard decoders only"
        local = plan.executor.forward(meta, cache, None, self.comm)
        self.comm.gather_logits(local, model.head.vocab_shares(self.world))  # type: ignore[union-attr, operator]

    def serve(self, conn: Connection) -> None:
        while True:
            try:
                cmd = conn.recv()
            except (EOFError, OSError):
                return  # rank 0 is gone
            if isinstance(cmd, Stop):
                return
            if isinstance(cmd, Forward):
                try:
                    self.forward(cmd)
                except BaseException as e:  # noqa: BLE001 - mid-collective: report, then leave the group
                    _send(conn, Fatal(f"rank {self.rank} ({self.device}) failed a step: {_error_text(e)}"))
                    conn.close()
                    os._exit(1)  # no clean-up: the group is broken, and tearing it down may block
            elif isinstance(cmd, (LoadModel, NewCache)):
                try:
                    done = self.load(cmd) if isinstance(cmd, LoadModel) else self.new_cache(cmd)
                except Exception as e:  # noqa: BLE001 - answered: rank 0 raises it, the group stays usable
                    if isinstance(cmd, LoadModel):
                        self.models.pop(cmd.model_id, None)
                    done = Done(error=f"rank {self.rank} ({self.device}): {_error_text(e)}")
                _send(conn, done)
            elif isinstance(cmd, UnloadModel):
                self.unload(cmd.model_id)
            elif isinstance(cmd, FreeCache):
                cache = self.caches.pop((cmd.model_id, cmd.cache_id), None)
                if cache is not None:
                    cache.free()
            elif isinstance(cmd, CopyPage):
                self.caches[(cmd.model_id, cmd.cache_id)].copy_page(cmd.src, cmd.dst)


def _send(conn: Connection, msg: object) -> None:
    try:
        conn.send(msg)
    except (OSError, EOFError):
        pass


def worker_main(boot: WorkerBoot, conn: Connection) -> None:
    """The process entry point (torch.multiprocessing spawn target)."""
    global _rank
    _rank = boot.rank
    _leave_with_parent(boot.parent_pid)
    # Ctrl-C in a terminal reaches every process of the foreground group; rank 0 alone decides what it stops
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(boot.threads)
    try:
        device = torch.device(boot.devices[boot.rank])
        if device.type == "cuda":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            torch.cuda.set_device(device)
        conn.send(Hello(os.getpid()))
        store = dist.TCPStore("127.0.0.1", boot.port, len(boot.devices), False,
                              timeout=datetime.timedelta(seconds=boot.startup_timeout))
        comm = GroupComm.connect(store, boot.rank, len(boot.devices), device, timeout=boot.timeout,
                                 connect_timeout=boot.startup_timeout)
        conn.send(Ready())
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, which fails the start
        _send(conn, Fatal(f"rank {boot.rank} ({boot.devices[boot.rank]}): {_error_text(e)}"))
        return
    state = WorkerState(boot, comm)
    try:
        state.serve(conn)
    finally:
        for model_id in list(state.models):
            try:
                state.unload(model_id)
            except Exception:  # noqa: BLE001, S110 - exiting anyway: nothing to report it to
                pass
        comm.shutdown()
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the interpreter's own teardown (torch's) takes seconds and holds nothing we need
