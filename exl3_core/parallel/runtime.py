"""Rank 0's side of a model loaded over a :class:`~exl3_core.parallel.WorkerGroup`: the
:class:`~exl3_core.archkit.model.ParallelRuntime` that the model's forward and its execution plans call.

Each step: the step's command goes to every worker, its metadata follows as one broadcast, every rank runs
its share (rank 0 through the caller's plan), the reductions run inside the layers, and the vocabulary
slices of the logits are gathered on rank 0. Caches are rank 0's :class:`~exl3_core.cache.Cache` objects;
each gets a twin on every worker (same pages, that rank's KV heads) the first time a step uses it, and
page copies are repeated there. Any failure during a step fails the group: the ranks cannot be brought
back into step, so the model refuses further work until it is loaded again.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.archkit.decoder import StandardDecoder
from exl3_core.archkit.model import LocalForward
from exl3_core.cache.cache import Cache
from exl3_core.cache.layer import CacheLayers
from exl3_core.parallel.comm import GroupComm, meta_header, pack_meta
from exl3_core.parallel.group import WorkerGroup
from exl3_core.parallel.protocol import (
    CacheSpec,
    CopyPage,
    Forward,
    FreeCache,
    NewCache,
    ParallelError,
    UnloadModel,
)
from exl3_core.plan.plan import ExecutionPlan
from exl3_core.tuning import Tuning


def cache_spec(cache: Cache, cache_id: int) -> CacheSpec:
    return CacheSpec(cache_id, cache.max_num_tokens, cache.variant, cache.page_size, cache.layer_kwargs)


class ParallelModel:
    """Drives the other ranks of ``model`` (rank 0's share, loaded in this process).

    :param model: the loaded rank-0 share.
    :param group: the workers.
    :param model_id: the model's id in the group.
    :param owns_group: close the group with the model (it was started for it).
    :param reports: each worker's memory report, by rank.
    """

    def __init__(self, model: StandardDecoder, group: WorkerGroup, model_id: int, owns_group: bool,
                 reports: list[dict[str, Any]]) -> None:
        self.model = model
        self.group = group
        self.world = group.world
        self.model_id = model_id
        self.owns_group = owns_group
        self.reports = reports
        self.vocab_shares = model.head.vocab_shares(self.world)  # type: ignore[operator]
        self._caches: weakref.WeakKeyDictionary[Cache, int] = weakref.WeakKeyDictionary()
        self._plan: ExecutionPlan | None = None
        self.closed = False

    @property
    def comm(self) -> GroupComm:
        assert self.group.comm is not None
        return self.group.comm

    # -- caches -----------------------------------------------------------------------------------------------------
    def adopt(self, cache: Cache, cache_id: int | None = None) -> int:
        """Give ``cache`` its id (``cache_id``: its workers' twins exist already, made by the load); otherwise
        the workers create and allocate their twins now.

        :raises ParallelError: when a worker cannot allocate its twin (the group stays usable)."""
        known = self._caches.get(cache)
        if known is not None:
            return known
        if tuple(cache.geometry) != tuple(self.model.cache_geometry()):
            raise ValueError(f"this Cache was planned for other heads ({list(cache.geometry)[:1]}...) than rank 0's share "
                             f"of {type(self.model).__name__} ({list(self.model.cache_geometry())[:1]}...): it was built "
                             f"before the tensor-parallel load; pass it to load(caches=[...]) or build it after loading")
        if cache_id is None:
            cache_id = self.group.new_id()
            self.group.send(NewCache(self.model_id, cache_spec(cache, cache_id)))
            failed = [d.error for d in self.group.collect("allocate its cache", self.group.timeout) if d.error]
            if failed:
                self.group.send(FreeCache(self.model_id, cache_id))
                raise ParallelError("a worker could not allocate its share of the cache: " + "; ".join(failed))
        self._caches[cache] = cache_id
        cache.page_copy_listeners.append(_PageCopies(self, cache_id))
        weakref.finalize(cache, self._forget, cache_id)
        return cache_id

    def _forget(self, cache_id: int) -> None:
        if self.closed or self.group.failure is not None or self.group.closed:
            return
        try:
            self.group.send(FreeCache(self.model_id, cache_id))
        except ParallelError:
            pass

    def copy_page(self, cache_id: int, src: int, dst: int) -> None:
        if not self.closed:
            self.group.send(CopyPage(self.model_id, cache_id, src, dst))

    # -- steps ------------------------------------------------------------------------------------------------------
    def forward(self, meta: BatchMeta, cache: CacheLayers | None = None, *, fp32_logits: bool = True) -> torch.Tensor:
        if self._plan is None or not self._plan.current:
            self._plan = ExecutionPlan(self.model)
        return self._plan.forward(meta, cache, fp32_logits=fp32_logits)

    def run(self, meta: BatchMeta, cache: CacheLayers | None, local: LocalForward, tuning: Tuning) -> torch.Tensor:
        if self.closed:
            raise ParallelError(f"{type(self.model).__name__} was unloaded from its tensor-parallel group")
        self.group.check()
        cache_id = None
        if cache is not None:
            if not isinstance(cache, Cache):
                raise TypeError(f"a tensor-parallel step needs an exl3_core.cache.Cache, got {type(cache).__name__}")
            cache_id = self.adopt(cache)
        header = meta_header(meta)
        comm = self.comm
        with self.group.lock:
            self.group.send(Forward(self.model_id, cache_id, header, tuning))
            try:
                comm.broadcast_(pack_meta(meta, comm.device))
                logits = comm.gather_logits(local(meta, cache, comm), self.vocab_shares)
            except ParallelError as e:  # a collective failed: the workers' reports say why
                raise ParallelError(f"tensor-parallel step failed: {self.group.fail(str(e))}") from e
            except BaseException as e:  # rank 0's share raised: the workers wait in a collective for good
                why = self.group.fail(f"rank 0 raised {type(e).__name__}: {e}")
                raise ParallelError(f"tensor-parallel step failed: {why}") from e
        assert logits is not None
        return logits

    # -- lifetime ---------------------------------------------------------------------------------------------------
    def rank_reports(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.reports]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.owns_group:
            self.group.close()
        elif self.group.failure is None and not self.group.closed:
            self.group.send(UnloadModel(self.model_id))


class _PageCopies:
    """A cache's page-copy listener: the workers copy their share of the page too."""

    def __init__(self, runtime: ParallelModel, cache_id: int) -> None:
        self.runtime = weakref.ref(runtime)
        self.cache_id = cache_id

    def __call__(self, src: int, dst: int) -> None:
        rt = self.runtime()
        if rt is not None:
            rt.copy_page(self.cache_id, src, dst)
