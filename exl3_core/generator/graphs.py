"""CUDA-graph decode: one captured graph per decode batch bucket, replayed every step.

A decode step runs hundreds of small kernels (per layer: norms, 7 EXL3 GEMMs of 4 kernels each,
RoPE, a cache scatter, attention); launched one by one from Python their launch cost dominates
small models. :class:`DecodeGraphs` captures ``model.forward_batch`` plus greedy selection
(argmax and the "row has a finite logit" check) into a ``torch.cuda.CUDAGraph`` per bucket size
(batches are already padded to buckets, the page table to a fixed width, see
:mod:`exl3_core.generator.batching`), with static input buffers that each step overwrites:

    ids [B], positions [B], cu_seqlens_q [B+1], seq_lens_k [B], page_table [B, W], slot_mapping [B]

The replay leaves ``logits [B, V]`` and ``packed [2, B]`` (greedy ids, ok flags) in static
output buffers; for all-greedy steps without filters the generator reads only ``packed`` back.
Other samplers run eagerly on the static logits.

Graphs are declined (the generator runs eagerly) when the model is not on CUDA, when
``EXL3_CUDA_GRAPHS=0`` (``settings.get().cuda_graphs``), or when the attention backend chosen
for a decode step does not declare ``graph_safe = True`` (see
:class:`~exl3_core.attention.backend.AttentionBackend`). Steps that are not pure decode, or
whose bucket exceeds ``max_bucket``, run eagerly too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from exl3_core.archkit.batch import BatchMeta

log = logging.getLogger(__name__)

#: largest batch bucket captured (larger decode batches are kernel-bound, not launch-bound)
MAX_GRAPH_BUCKET = 32


def decline_reason(model: Any, cache: Any) -> str | None:
    """Why decode steps of ``model`` over ``cache`` cannot be graphed, or None when they can."""
    from exl3_core import settings

    if not settings.get().cuda_graphs:
        return "disabled by EXL3_CUDA_GRAPHS=0"
    device = torch.device(getattr(model, "device", "cpu"))
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"model is on {device}, not CUDA"
    if cache is None or not getattr(cache, "layers", None):
        return "no allocated cache"
    from exl3_core.attention.dispatch import get_dispatcher

    layers = list(model.attention_layers())
    if not layers:
        return "model has no attention layers"
    dispatcher = get_dispatcher(getattr(model, "plugins", None))
    allowed = getattr(model, "allowed_backends", None)
    for attn in layers:
        spec_of = getattr(attn, "attn_spec", None)
        if spec_of is None:
            return f"{type(attn).__name__} exposes no attn_spec(); its backend's graph safety is unknown"
        layer = cache.layers[attn.cache_index]
        spec = spec_of(model.dtype, device, layer.views()[0], "decode")
        backend = dispatcher.select(spec, allowed)
        if not getattr(type(backend), "graph_safe", False):
            return f"attention backend {backend.name!r} is not graph-safe"
    return None


def greedy_pack(logits: torch.Tensor) -> torch.Tensor:
    """float64 ``[2, B]``: greedy ids and "row has a finite logit" flags of ``logits [B, V]`` (the
    same selection as :func:`~exl3_core.sampling.sampler.sample` with a greedy sampler)."""
    x = logits.float()
    ids = x.argmax(-1)
    ok = torch.isfinite(x).any(-1) & ~torch.isnan(x).any(-1)
    return torch.stack([ids.double(), ok.double()])


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    meta: BatchMeta  # static inputs
    logits: torch.Tensor  # static outputs
    packed: torch.Tensor  # float64 [2, B]: greedy ids, ok flags


class DecodeGraphs:
    """Captures and replays decode steps of ``model`` over ``cache``.

    :param model: loaded model on CUDA.
    :param cache: its allocated :class:`~exl3_core.cache.Cache`.
    :param table_width: the generator's page-table width (pages per sequence).
    :param max_bucket: largest batch bucket to capture.
    """

    def __init__(self, model: Any, cache: Any, table_width: int, max_bucket: int = MAX_GRAPH_BUCKET) -> None:
        self.model, self.cache = model, cache
        self.table_width = table_width
        self.page_size = cache.page_size
        self.max_bucket = max_bucket
        self.device = torch.device(model.device)
        self._graphs: dict[int, _Graph] = {}
        self._pool: Any = None
        self._key = self._state_key()
        self.replays = 0

    @classmethod
    def create(cls, model: Any, cache: Any, table_width: int, max_bucket: int = MAX_GRAPH_BUCKET) -> DecodeGraphs | None:
        """A runner, or None (logged) when :func:`decline_reason` says no."""
        why = decline_reason(model, cache)
        if why is not None:
            log.info("CUDA-graph decode off: %s", why)
            return None
        return cls(model, cache, table_width, max_bucket)

    def _state_key(self) -> tuple[Any, ...]:
        # the graph holds raw pointers: a reload of the weights or the cache invalidates it
        return (id(self.model), self.model.loaded, tuple(id(layer) for layer in self.cache.layers))

    def accepts(self, meta: BatchMeta, *, staged: bool = False) -> bool:
        """Whether ``meta`` can be replayed; ``staged``: its tensors are (pinned) host tensors that
        :meth:`run` copies asynchronously (the overlapped decode loop builds them so)."""
        return (meta.phase == "decode" and meta.logits_indices is None and meta.page_table is not None
                and meta.batch_size <= self.max_bucket and meta.input_ids.shape[0] == meta.batch_size
                and meta.page_table.shape[1] == self.table_width and (staged or meta.input_ids.is_cuda))

    def run(self, meta: BatchMeta, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph of ``meta``'s bucket: ``(logits [B, V], packed [2, B])`` (static buffers,
        valid until the next replay).

        :param ids: optional device tensor ``[n]`` (e.g. the previous step's ``packed[0]``, float64)
            that replaces the first ``n`` input ids. Its copy (cast to int64) is queued on the
            replay's stream after ``meta``'s copies and before the replay, so the next step's inputs
            never travel through the host.
        """
        key = self._state_key()
        if key != self._key:
            self.reset()
            self._key = key
        B = meta.batch_size
        g = self._graphs.get(B)
        if g is None:
            g = self._graphs[B] = self._capture(B)
        s = g.meta
        s.input_ids.copy_(meta.input_ids, non_blocking=True)
        s.positions.copy_(meta.positions, non_blocking=True)
        s.cu_seqlens_q.copy_(meta.cu_seqlens_q, non_blocking=True)
        s.seq_lens_k.copy_(meta.seq_lens_k, non_blocking=True)
        s.page_table.copy_(meta.page_table, non_blocking=True)  # type: ignore[union-attr]
        s.slot_mapping.copy_(meta.slot_mapping, non_blocking=True)  # type: ignore[union-attr]
        if ids is not None:
            s.input_ids[:ids.shape[0]].copy_(ids, non_blocking=True)
        g.graph.replay()
        self.replays += 1
        return g.logits, g.packed

    def reset(self) -> None:
        """Drop every captured graph (and its memory pool)."""
        self._graphs.clear()
        self._pool = None

    def _static_meta(self, B: int) -> BatchMeta:
        dev, W, ps = self.device, self.table_width, self.page_size
        scratch = self.cache.scratch_page
        # every padded row points at the scratch page: warm-up and capture write nothing else
        return BatchMeta(
            input_ids=torch.zeros(B, dtype=torch.int64, device=dev),
            positions=torch.zeros(B, dtype=torch.int64, device=dev),
            cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32, device=dev),
            seq_lens_k=torch.ones(B, dtype=torch.int32, device=dev),
            max_seqlen_q=1, max_seqlen_k=W * ps, phase="decode",
            page_table=torch.full((B, W), scratch, dtype=torch.int32, device=dev),
            slot_mapping=torch.full((B,), scratch * ps, dtype=torch.int64, device=dev),
            logits_indices=None,
        )

    def _step(self, meta: BatchMeta) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model.forward_batch(meta, self.cache)
        return logits, greedy_pack(logits)

    def _capture(self, B: int) -> _Graph:
        meta = self._static_meta(B)
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(cur)
        # warm-up off the capture: Triton compiles, backends get chosen, workspaces get allocated
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(meta)
        cur.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, packed = self._step(meta)
        log.debug("captured decode graph for bucket %d", B)
        return _Graph(graph, meta, logits, packed)
