"""CUDA-graph decode: two captured graphs per decode batch bucket, replayed in turn, one per step.

A decode step runs hundreds of small kernels (per layer: norms, 7 EXL3 GEMMs of 4 kernels each,
RoPE, a cache scatter, attention); launched one by one from Python their launch cost dominates
small models. :class:`DecodeGraphs` captures the plan's forward plus greedy selection
(argmax and the "row has a finite logit" check) into ``torch.cuda.CUDAGraph``s per bucket size
(batches are already padded to buckets, the page table to a fixed width, see
:mod:`exl3_core.generator.batching`), with static input buffers that each step overwrites:

    ids [B*k], positions [B*k], cu_seqlens_q [B+1], seq_lens_k [B], page_table [B, W], slot_mapping [B*k]

(k new tokens per sequence: 1 for a plain step, more for a step verifying drafted tokens; a bucket is
a sequence count and a k), and a per-row ``carry`` index: the row's input id is the previous step's greedy id of that row
(the overlapped loop, :mod:`exl3_core.generator.overlap`). A bucket's two graphs (slots) alternate
so that one step's inputs are copied while the step before still runs (:class:`DecodeGraphs`).

The replay leaves ``logits [B*k, V]`` and ``packed [2, B*k]`` (greedy ids, ok flags) in static
output buffers; for all-greedy steps without filters the generator reads only ``packed`` back.
Other samplers run eagerly on the static logits.

:class:`PrefillGraphs` does the same for a prefill step that is one sequence's chunk (a fresh
prompt, or the new tokens after a prefix-cache hit), padded to a token bucket
(:meth:`~exl3_core.tuning.GraphTuning.prefill_bucket`): a prompt's forward launches ~25 kernels per layer whose host cost (~1 ms
per layer for an 8B-shape model, cuBLAS and SDPA calls included) exceeds their device time below
~1k tokens, so without a graph the time to first token is host-bound. Padded rows sit after the
real ones (causal attention: the real rows never see them), write their keys/values into the
cache's scratch page, and only the last real row's logits are computed. The graphs keep their
intermediate activations in one memory pool for the generator's lifetime (as large as the largest
captured bucket's forward needs); the tuning's ``graphs.prefill_max_tokens`` bounds it.

Both replay the model's :class:`~exl3_core.plan.ExecutionPlan`. Graphs are declined (the generator runs
eagerly) for the reasons :meth:`ExecutionPlan.graph_decline` gives: not on CUDA, graphs off
(``EXL3_CUDA_GRAPHS=0`` or the tuning), an attention backend chosen for the phase that does not declare
``graph_safe = True``, or a module that says its forward reads back to the host. Steps of another shape,
or beyond the largest bucket, run eagerly too.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from exl3_core import ops
from exl3_core.archkit.batch import BatchMeta
from exl3_core.attention.spec import CallShape, pow2_bucket
from exl3_core.cache.cache import Cache
from exl3_core.generator.batching import DECODE_BUCKETS, HostRead, bucket_size, gather_rows
from exl3_core.plan.plan import ExecutionPlan, decode_shapes

log = logging.getLogger(__name__)

#: a decode graph's (sequences, tokens per sequence, slot), or a prefill graph's bucket code
GraphKey = tuple[int, int, int] | int

#: the decode step's input fields, in their staging buffer's order (shapes: _field_shapes)
_FIELDS = ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "seq_lens_k", "page_table", "ring_slots")
#: the staging buffer's fields: the step's inputs, then per row the previous step's greedy row its
#: input id comes from (-1: the id staged; see DecodeGraphs.run)
_BLOB_FIELDS = _FIELDS + ("carry",)


def _field_shapes(B: int, k: int, W: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    R = B * k  # rows: k new tokens of each of B sequences
    return {"input_ids": (torch.int64, (R,)), "positions": (torch.int64, (R,)), "slot_mapping": (torch.int64, (R,)),
            "cu_seqlens_q": (torch.int32, (B + 1,)), "seq_lens_k": (torch.int32, (B,)),
            "page_table": (torch.int32, (B, W)), "ring_slots": (torch.int32, (B,)), "carry": (torch.int32, (R,))}


class _Blob:
    """The decode inputs of one bucket as views of one byte buffer (each field 16-byte aligned, as
    a separately allocated tensor would be), so that host-built inputs travel in one copy."""

    def __init__(self, B: int, k: int, W: int, device: torch.device, pinned: bool = False) -> None:
        shapes = _field_shapes(B, k, W)
        offsets, n = {}, 0
        for name in _BLOB_FIELDS:
            dtype, shape = shapes[name]
            offsets[name] = n
            n += -(-math.prod(shape) * dtype.itemsize // 16) * 16
        self.buf = torch.zeros(n, dtype=torch.uint8, device=device, pin_memory=pinned)
        self.views: dict[str, torch.Tensor] = {}
        for name in _BLOB_FIELDS:
            dtype, shape = shapes[name]
            size = math.prod(shape) * dtype.itemsize
            self.views[name] = self.buf[offsets[name]:offsets[name] + size].view(dtype).view(shape)


def decline_reason(plan: ExecutionPlan, cache: Cache, table_width: int, phase: str = "decode",
                   max_bucket: int = 1) -> str | None:
    """Why ``phase`` ("decode" or "prefill") steps of the plan's model over ``cache`` cannot be graphed,
    or None when they can."""
    bound = table_width * cache.page_size
    if phase == "prefill" and cache.ring_slots:
        return ("the cache keeps recent rows per sequence, and a graphed chunk's padded rows would enter its ring; "
                "prefill chunks run eagerly")
    if phase == "decode":
        shapes = decode_shapes(bound, max_bucket)
    else:
        shapes = [CallShape("prefill", pow2_bucket(bound), 1, 0)]
    return plan.graph_decline(cache, phase, shapes)


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """No garbage collection inside a CUDA-graph capture (collects first). A cycle collected there
    that holds an older graph (a dropped generator's) destroys it mid-capture, which CUDA refuses
    and which invalidates the capture ("operation not permitted when stream is capturing")."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def freeze_long_lived(device: torch.device) -> None:
    """Leave every object alive now out of later garbage collections (``gc.freeze``), on CUDA. After start-up
    these are the model's modules, the cache and the captured graphs, which live as long as the generator;
    a full collection walking them (hundreds of thousands of objects with torch and its imports) stalls
    the host for tens of ms inside some decode step. Earlier frozen objects are thawed and collected first,
    so a dropped generator's graphs are freed here rather than kept; a new generator and
    :meth:`exl3_core.archkit.model.Model.unload` thaw them too."""
    if device.type == "cuda":
        gc.unfreeze()
        gc.collect()
        gc.freeze()


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    meta: BatchMeta  # static inputs
    logits: torch.Tensor  # static outputs
    packed: torch.Tensor | None  # float64 [2, B]: greedy ids, ok flags (decode graphs)


class _GraphSet:
    """Graphs of one model over one cache, keyed by the subclass (decode: ``(batch bucket, slot)``;
    prefill: an int for the token bucket and variant), sharing one memory pool (they replay one at a
    time, and each graph's intermediates are dead once its replay ends)."""

    def __init__(self, plan: ExecutionPlan, cache: Cache, table_width: int) -> None:
        self.plan, self.cache = plan, cache
        self.table_width = table_width
        self.page_size = cache.page_size
        self.device = plan.device
        self._graphs: dict[GraphKey, _Graph] = {}
        self._pool: Any = None
        self._key = self._state_key()
        self.replays = 0

    def _state_key(self) -> tuple[Any, ...]:
        # the graph holds raw pointers: a reload of the weights or the cache invalidates it
        return (id(self.plan), self.plan.current, tuple(id(layer) for layer in self.cache.layers))

    def reset(self) -> None:
        """Drop every captured graph (and its memory pool)."""
        self._graphs.clear()
        self._pool = None

    def _graph(self, key: GraphKey) -> _Graph:
        state = self._state_key()
        if state != self._key:
            self.reset()
            self._key = state
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture(key)
        return g

    def _static_meta(self, key: GraphKey) -> BatchMeta:
        raise NotImplementedError

    def _step(self, key: GraphKey, meta: BatchMeta) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def _capture(self, key: GraphKey) -> _Graph:
        meta = self._static_meta(key)
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(cur)
        # warm-up off the capture: Triton compiles, backends get chosen, workspaces get allocated
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(key, meta)
        cur.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with no_gc(), torch.cuda.graph(graph, pool=self._pool):
            logits, packed = self._step(key, meta)
        log.debug("captured %s graph %s", type(self).__name__, key)
        return _Graph(graph, meta, logits, packed)


class DecodeGraphs(_GraphSet):
    """Captures and replays decode steps of a plan's model over ``cache``.

    Each bucket has **two** graphs (slots 0 and 1) with their own static inputs and outputs, and
    replays alternate between them, so a step's inputs are staged while the step before still
    runs: the host-built metadata is copied on a staging stream once the same slot's previous replay
    (two steps back) has finished reading it, and the replay stream only waits for that copy, which
    is long done by then. The greedy read-back (:meth:`read_back`) runs on a third stream. Between
    two replays the replay stream then runs nothing else (each of those would cost a few microseconds
    of stream turnaround).

    A step whose input ids are the previous step's greedy ids (the overlapped loop) passes that
    step's ``packed[0]`` and the source row of each of its rows; when the previous replay was this
    bucket's other slot, the graph's first kernel picks them up on the device (the plan folds them into
    the embedding lookup where it can, else runs :func:`exl3_core.ops.carry_ids`). Otherwise they are
    gathered and copied before the replay.

    :param plan: the execution plan of a loaded model on CUDA.
    :param cache: its allocated :class:`~exl3_core.cache.Cache`.
    :param table_width: the generator's page-table width (pages per sequence).
    """

    def __init__(self, plan: ExecutionPlan, cache: Cache, table_width: int) -> None:
        super().__init__(plan, cache, table_width)
        self.max_bucket = plan.tuning.graphs.max_decode_bucket
        self.staging_slots = plan.tuning.graphs.staging_slots
        self._init_state()

    def _init_state(self) -> None:
        # a bucket is (sequences B, tokens per sequence k); a graph key is (B, k, slot)
        self._blobs: dict[tuple[int, int, int], _Blob] = {}  # graph -> static inputs
        self._rings: dict[tuple[int, int], list[tuple[_Blob, torch.cuda.Event]]] = {}  # bucket -> pinned staging ring
        self._packed: dict[tuple[int, int], torch.Tensor] = {}  # bucket -> float64 [2 slots, 2, B*k], greedy outputs
        self._next: dict[tuple[int, int], int] = {}  # bucket -> slot of its next replay
        self._last: tuple[int, int, int] | None = None  # the latest replay's graph
        self._replayed: dict[tuple[int, int, int], torch.cuda.Event] = {}  # after the graph's latest replay
        self._read: dict[tuple[int, int, int], torch.cuda.Event] = {}  # after its outputs' latest read-back
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None  # staging, read-back
        self.carried = 0  # replays whose input ids were carried over on the device, inside the graph

    @classmethod
    def create(cls, plan: ExecutionPlan, cache: Cache, table_width: int) -> DecodeGraphs | None:
        """A runner, or None (logged) when :func:`decline_reason` says no."""
        why = decline_reason(plan, cache, table_width, "decode", plan.tuning.graphs.max_decode_bucket)
        if why is not None:
            log.info("CUDA-graph decode off: %s", why)
            return None
        return cls(plan, cache, table_width)

    @classmethod
    def renew(cls, old: DecodeGraphs | None, plan: ExecutionPlan, cache: Cache,
              table_width: int) -> DecodeGraphs | None:
        """Drop ``old`` (its graphs hold the addresses of what changed) and ask :meth:`create` again: what changed
        (adapters on experts, say) may also have made the forward capturable or not."""
        if old is not None:
            old.reset()
        return cls.create(plan, cache, table_width)

    def capture_buckets(self, max_batch: int, k: int = 1) -> list[int]:
        """Capture now the graphs of every bucket a step of up to ``max_batch`` sequences (``k`` tokens each)
        can use (capped at :attr:`max_bucket`), instead of at each bucket's first step; returns the buckets."""
        top = min(bucket_size(max(max_batch, 1)), self.max_bucket)
        buckets = [b for b in DECODE_BUCKETS if b <= top]
        for b in buckets:
            self._graph((b, k, 0))
            self._graph((b, k, 1))
        return buckets

    def accepts(self, meta: BatchMeta) -> bool:
        """Whether ``meta`` (host or device tensors) can be replayed: a decode step of k tokens per sequence."""
        k = meta.q_per_seq
        return (meta.phase == "decode" and meta.logits_indices is None and meta.page_table is not None and k >= 1
                and meta.batch_size <= self.max_bucket and meta.input_ids.shape[0] == meta.batch_size * k
                and meta.page_table.shape[1] == self.table_width)

    def _side_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._streams is None:
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        return self._streams

    def run(self, meta: BatchMeta, ids: torch.Tensor | None = None,
            src: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph of ``meta``'s bucket: ``(logits [B*k, V], packed [2, B*k])`` (static buffers,
        valid until the next replay; the logits in the head's dtype, fp16 for EXL3 heads). Rows
        ``b*k .. b*k+k-1`` are sequence b's k tokens (k = 1 for a plain decode step).

        ``meta`` built on the host (the generator's way) is packed into a pinned staging buffer and
        reaches the graph's inputs in one asynchronous copy on the staging stream; device tensors are
        copied field by field on the replay stream.

        :param ids: optional device tensor (the previous step's ``packed[0]``, float64) whose rows
            ``src`` (default: ``0 .. len(ids) - 1``, at most the bucket's rows) replace the first input
            ids, so the next step's inputs never travel through the host: on the device inside the
            graph when the previous replay was this bucket's other slot (whose output ``ids`` is), else
            gathered and copied (cast to int64) before the replay.
        """
        if meta.ring_slots is None and self.cache.ring_slots:  # the staged slots would stay the scratch slot's
            raise ValueError("decode graph: the cache keeps recent rows per sequence, but the step names no ring "
                             "slots; give each Chunk its job's ring_slot")
        bucket = (meta.batch_size, meta.q_per_seq)
        R = bucket[0] * bucket[1]
        slot = self._next.get(bucket, 0)
        key, partner = (*bucket, slot), (*bucket, 1 - slot)
        g = self._graph(key)
        s = g.meta
        main = torch.cuda.current_stream(self.device)
        if ids is not None and src is None:
            src = list(range(min(ids.shape[0], R)))
        # in the graph only with host-built inputs (their staging carries the per-row source index)
        carried = (ids is not None and not meta.input_ids.is_cuda and self._last == partner and src is not None
                   and ids.data_ptr() == self._packed[bucket][1 - slot][0].data_ptr())
        if (ev := self._read.get(key)) is not None:
            main.wait_event(ev)  # this slot's outputs of two steps back have been read
        blob = self._blobs[key]
        if meta.input_ids.is_cuda:
            for name in _FIELDS:
                if (dst := getattr(s, name)) is not None:
                    dst.copy_(getattr(meta, name), non_blocking=True)
            blob.views["carry"].fill_(-1)  # a carried replay may have left its indices; this path carries nothing
        else:
            stage, _ = self._side_streams()
            ring = self._rings[bucket]
            host, done = ring[self.replays % len(ring)]
            done.synchronize()  # this staging buffer's previous copy has read it
            for name in _FIELDS:
                if (src_t := getattr(meta, name)) is not None:
                    host.views[name].copy_(src_t)
            carry = host.views["carry"].numpy()
            carry.fill(-1)
            if carried:
                assert src is not None
                carry[:len(src)] = src
                self.carried += 1
            if (ev := self._replayed.get(key)) is not None:
                stage.wait_event(ev)  # the slot's previous replay has finished reading its inputs
            with torch.cuda.stream(stage):
                blob.buf.copy_(host.buf, non_blocking=True)
            done.record(stage)
            main.wait_event(done)
        if ids is not None and not carried:
            assert src is not None
            s.input_ids[:len(src)].copy_(gather_rows(ids, src), non_blocking=True)
        g.graph.replay()
        ev = self._replayed.get(key)
        if ev is None:
            ev = self._replayed[key] = torch.cuda.Event()
        ev.record(main)
        self._last = key
        self._next[bucket] = 1 - slot
        self.replays += 1
        assert g.packed is not None
        return g.logits, g.packed

    def read_back(self, packed: torch.Tensor) -> HostRead:
        """Start the asynchronous host copy of the latest replay's ``packed`` on the read-back stream
        (the next replay does not queue behind it; the replay that overwrites these outputs waits)."""
        if self._last is None or packed.data_ptr() != self._packed[self._last[:2]][self._last[2]].data_ptr():
            raise ValueError("DecodeGraphs.read_back: packed is not the latest replay's output")
        _, reader = self._side_streams()
        reader.wait_event(self._replayed[self._last])
        with torch.cuda.stream(reader):
            read = HostRead(packed)
        assert read.event is not None
        self._read[self._last] = read.event
        return read

    def reset(self) -> None:
        if self._streams is not None:  # no staging copy or read-back may still touch the buffers dropped here
            for st in self._streams:
                st.synchronize()
        super().reset()
        self._init_state()

    def _static_meta(self, key: tuple[int, int, int]) -> BatchMeta:
        B, k, _ = key
        bucket = (B, k)
        dev, W, ps = self.device, self.table_width, self.page_size
        scratch = self.cache.scratch_page
        blob = self._blobs[key] = _Blob(B, k, W, dev)
        if bucket not in self._rings:
            self._rings[bucket] = [(_Blob(B, k, W, torch.device("cpu"), pinned=True), torch.cuda.Event())
                                   for _ in range(self.staging_slots)]
            # both slots' greedy outputs, outside the graph pool: each slot's first kernel reads the other's
            self._packed[bucket] = torch.zeros((2, 2, B * k), dtype=torch.float64, device=dev)
        v = blob.views
        # every padded row points at the scratch page: warm-up and capture write nothing else
        v["input_ids"].zero_()
        v["positions"].copy_(torch.arange(k, dtype=torch.int64).repeat(B))
        v["cu_seqlens_q"].copy_(torch.arange(B + 1, dtype=torch.int32) * k)
        v["seq_lens_k"].fill_(k)
        v["page_table"].fill_(scratch)
        v["slot_mapping"].fill_(scratch * ps)
        v["ring_slots"].zero_()  # the scratch ring slot
        v["carry"].fill_(-1)
        fields = {name: v[name] for name in _FIELDS}
        if not self.cache.ring_slots:
            fields["ring_slots"] = None
        return BatchMeta(max_seqlen_q=k, max_seqlen_k=W * ps, phase="decode", logits_indices=None, **fields)

    def _step(self, key: tuple[int, int, int], meta: BatchMeta) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, k, slot = key
        # the plan folds the carried ids into the step's first launch where it can
        carry = (self._blobs[key].views["carry"], self._packed[(B, k)][1 - slot][0])
        # the head's own dtype: the greedy pick reads it as is, and a sampler casts its rows (no fp32
        # copy of [B, V] in every step)
        logits = self.plan.forward(meta, self.cache, carry=carry, fp32_logits=False)
        return logits, ops.greedy_pack(logits, out=self._packed[(B, k)][slot])


class PrefillGraphs(_GraphSet):
    """Captures and replays the prefill chunk of one sequence, padded to a token bucket.

    Two graphs per bucket ``T``: a *fresh* sequence (no cached prefix; its attention may take the
    dense fused path) and a chunk *after a cached prefix* (prefix-cache hit, or the later chunks of
    a long prompt: paged attention over the cache, key count read from the device). Their inputs
    live in two static device buffers, int64 ``[3T + 1]`` (ids, positions, cache slots, the logits
    row) and int32 ``[W + 1]`` (page-table row, key count), so a replay costs two host-to-device
    copies from pinned staging memory. The output is the fp32 logits ``[1, V]`` of the chunk's last
    real token.

    :param max_tokens: largest bucket to capture (at most the tuning's ``graphs.prefill_max_tokens``).
    """

    def __init__(self, plan: ExecutionPlan, cache: Cache, table_width: int, max_tokens: int) -> None:
        super().__init__(plan, cache, table_width)
        self.graph_tuning = plan.tuning.graphs
        self.max_tokens = min(max_tokens, self.graph_tuning.prefill_max_tokens)
        self._staging: dict[int, tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = {}
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # graph key -> static input buffers

    @classmethod
    def create(cls, plan: ExecutionPlan, cache: Cache, table_width: int, max_tokens: int) -> PrefillGraphs | None:
        """A runner, or None (logged) when :func:`decline_reason` says no for the prefill phase."""
        why = decline_reason(plan, cache, table_width, "prefill")
        if why is not None:
            log.info("CUDA-graph prefill off: %s", why)
            return None
        return cls(plan, cache, table_width, max_tokens)

    def bucket(self, tokens: int, past: int, pages: int) -> int | None:
        """The bucket a chunk of ``tokens`` new tokens after ``past`` cached ones (over ``pages``
        pages) replays in, or None when it runs eagerly (no bucket, a page list wider than the
        table, or padded positions that would run past the table)."""
        T = self.graph_tuning.prefill_bucket(tokens, self.max_tokens)
        if T is None or pages > self.table_width or past + T > self.table_width * self.page_size:
            return None
        return T

    def run(self, tokens: list[int], pages: list[int], past: int = 0) -> torch.Tensor:
        """Replay the chunk ``tokens`` that follows ``past`` cached tokens of a sequence whose cache
        pages are ``pages``: logits ``[1, V]`` of its last token, a static buffer valid until the
        next replay."""
        n, ps, W = len(tokens), self.page_size, self.table_width
        T = self.bucket(n, past, len(pages))
        if T is None:
            raise ValueError(f"prefill graph: no bucket for {n} tokens after {past} over {len(pages)} pages "
                             f"(largest {self.max_tokens} tokens, table of {W} pages of {ps})")
        if len(pages) * ps < past + n:
            raise ValueError(f"prefill graph: {len(pages)} pages of {ps} tokens cannot hold {past + n} tokens")
        key = 2 * T + (past > 0)
        g = self._graph(key)
        big, small = self._inputs[key]
        host, host32, done = self._stage(key, T)
        done.synchronize()  # the previous replay's copies have read the staging buffers
        h = host.numpy()
        h[:n] = tokens
        h[n:T] = 0
        pos = np.arange(past, past + T, dtype=np.int64)
        h[T:2 * T] = pos
        h[2 * T:2 * T + n] = np.asarray(pages, dtype=np.int64)[pos[:n] // ps] * ps + pos[:n] % ps
        h[2 * T + n:3 * T] = self.cache.scratch_page * ps  # padded rows write the scratch page only
        h[3 * T] = n - 1
        t = host32.numpy()
        t[:len(pages)] = pages
        t[len(pages):W] = self.cache.scratch_page
        t[W] = past + T  # keys visible to the last (padded) row; real row i sees past + i + 1 (causal)
        big.copy_(host, non_blocking=True)
        small.copy_(host32, non_blocking=True)
        done.record()
        g.graph.replay()
        self.replays += 1
        return g.logits

    def _stage(self, key: int, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]:
        st = self._staging.get(key)
        if st is None:
            st = self._staging[key] = (torch.empty(3 * T + 1, dtype=torch.int64, pin_memory=True),
                                       torch.empty(self.table_width + 1, dtype=torch.int32, pin_memory=True),
                                       torch.cuda.Event())
        return st

    def reset(self) -> None:
        super().reset()
        self._staging.clear()
        self._inputs.clear()

    def _static_meta(self, key: int) -> BatchMeta:
        T, prefix = key // 2, bool(key & 1)
        dev, W, ps = self.device, self.table_width, self.page_size
        scratch = self.cache.scratch_page
        big = torch.zeros(3 * T + 1, dtype=torch.int64, device=dev)  # ids | positions | slots | logits row
        big[T:2 * T] = torch.arange(T, device=dev)
        big[2 * T:3 * T] = scratch * ps  # warm-up and capture write the scratch page only
        big[3 * T] = T - 1
        small = torch.full((W + 1,), scratch, dtype=torch.int32, device=dev)  # page-table row | key count
        small[W] = T
        self._inputs[key] = (big, small)
        return BatchMeta(
            input_ids=big[:T], positions=big[T:2 * T],
            cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32, device=dev),
            seq_lens_k=small[W:], max_seqlen_q=T,
            # fresh: the keys are exactly the new rows (the dense path's condition); after a prefix
            # the bound is the table's capacity and the kernels read the true count from seq_lens_k
            max_seqlen_k=W * ps if prefix else T, phase="prefill",
            page_table=small[:W].view(1, W), slot_mapping=big[2 * T:3 * T], logits_indices=big[3 * T:],
        )

    def _step(self, key: GraphKey, meta: BatchMeta) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.plan.forward(meta, self.cache), None
