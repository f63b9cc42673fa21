"""The one-token steps of a draft model as one CUDA graph (:class:`DraftChain`).

After its first step a draft model runs n = k - 1 one-token steps, each fed the token the step before
picked. Replayed one graph per step, every step pays the host its metadata, staging and launch (more
than a small draft's forward on the device), so the draft loop runs at the host's pace. Its steps are
predictable, though: step j's inputs are step 1's with every position and key count advanced by j
and the cache slot read from the page table, which already holds the pages of all n (the drafter
allocates them before drafting). :class:`DraftChain` captures all n steps and the picks between them
in one graph per (batch bucket, n), staged once.

It takes greedy picks (the argmax), or a benchmark's forced tokens (``exl3_core.bench.spec``); sampled
drafts need the sampler's host-side work between steps and run step by step.

:func:`chain_steps` is the chain's program; the drafter's tests run it eagerly against the step-by-step
loop.
"""
from __future__ import annotations

import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.cache.cache import Cache
from exl3_core.generator.graphs import _FIELDS, _Blob, _GraphSet
from exl3_core.plan.plan import ExecutionPlan

#: a chain graph's (sequences, steps, forced: 1 or 0)
ChainKey = tuple[int, int, int]


def advance(meta: BatchMeta, page_size: int) -> None:
    """Move one-token decode inputs ``meta`` one position on, in place: positions and key counts + 1, cache
    slots from the page table."""
    meta.positions.add_(1)
    meta.seq_lens_k.add_(1)
    _slots_from_pages(meta, page_size)


def shift(meta: BatchMeta, by: torch.Tensor, page_size: int) -> None:
    """Move decode inputs ``meta`` (on the device, padded to a bucket, the same rows per sequence) on by ``by[b]``
    positions for each of the first ``len(by)`` sequences, in place: positions and key counts, cache slots from
    the page table (which must already hold the pages)."""
    B, R = meta.batch_size, meta.q_per_seq
    s = torch.zeros(B, dtype=torch.int64, device=by.device)
    s[:by.shape[0]] = by
    meta.positions.add_(s.repeat_interleave(R))
    meta.seq_lens_k.add_(s.to(meta.seq_lens_k.dtype))
    _slots_from_pages(meta, page_size)


def _slots_from_pages(meta: BatchMeta, page_size: int) -> None:
    """Set ``meta``'s cache slots from its positions and page table (``q_per_seq`` rows per sequence), in place."""
    assert meta.page_table is not None and meta.slot_mapping is not None
    index = torch.div(meta.positions, page_size, rounding_mode="floor").view(meta.batch_size, meta.q_per_seq)
    pages = meta.page_table.gather(1, index).view(-1)
    torch.add(meta.positions.remainder(page_size), pages, alpha=page_size, out=meta.slot_mapping)


def chain_steps(plan: ExecutionPlan, cache: Cache, meta: BatchMeta, steps: int, out: torch.Tensor,
                forced: torch.Tensor | None = None) -> torch.Tensor:
    """Run ``steps`` one-token draft steps from the inputs ``meta`` (one row per sequence; mutated: left at
    the last step's), each feeding the next its pick: the argmax of its logits, or ``forced[:, j]``
    where given. Writes the picks to ``out [B, steps]`` (int64) and returns the last step's logits."""
    if meta.q_per_seq != 1 or meta.page_table is None or meta.slot_mapping is None:
        raise ValueError("chain_steps: one-token decode inputs with a page table")
    logits = None
    for j in range(steps):
        if j:
            advance(meta, cache.page_size)
        logits = plan.forward(meta, cache, fp32_logits=False)
        pick = forced[:, j] if forced is not None else logits.argmax(-1)
        out[:, j].copy_(pick)
        if j + 1 < steps:
            meta.input_ids.copy_(pick)
    assert logits is not None
    return logits


class DraftChain(_GraphSet):
    """Captures and replays draft chains (:func:`chain_steps`) of a plan's model over ``cache``.

    A graph's static inputs are step 1's metadata (host-built, staged through pinned buffers in one
    copy), the first input ids (device, copied before the replay) and, for a forced chain, the tokens
    to force; its working metadata is a copy made inside the graph, so the inputs survive a replay.

    :param plan: the execution plan of a loaded draft model on CUDA.
    :param cache: its allocated cache.
    :param table_width: the drafter's page-table width.
    :param max_steps: the longest chain replayed (longer ones run step by step).
    """

    def __init__(self, plan: ExecutionPlan, cache: Cache, table_width: int, max_steps: int) -> None:
        super().__init__(plan, cache, table_width)
        self.max_steps = max_steps
        self.max_bucket = plan.tuning.graphs.max_decode_bucket
        self._init_state()

    def _init_state(self) -> None:
        self._blobs: dict[ChainKey, _Blob] = {}
        self._work: dict[ChainKey, BatchMeta] = {}
        self._forced: dict[ChainKey, torch.Tensor] = {}
        self._out: dict[ChainKey, torch.Tensor] = {}
        self._rings: dict[int, list[tuple[_Blob, torch.cuda.Event]]] = {}  # bucket -> pinned staging ring
        self._uses = 0

    def reset(self) -> None:
        super().reset()
        self._init_state()

    def accepts(self, meta: BatchMeta, steps: int) -> bool:
        """Whether a chain of ``steps`` from the one-token inputs ``meta`` (host-built, or on the device) can be
        replayed."""
        return (1 <= steps <= self.max_steps and meta.phase == "decode" and meta.q_per_seq == 1
                and meta.batch_size <= self.max_bucket and meta.page_table is not None
                and meta.page_table.shape[1] == self.table_width)

    def capture(self, buckets: list[int], steps: int, forced: bool = False) -> None:
        """Capture now the chains of ``steps`` for each batch bucket in ``buckets``."""
        for b in buckets:
            self._graph((b, steps, int(forced)))

    def run(self, meta: BatchMeta, first: torch.Tensor, steps: int,
            forced: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the chain of ``steps`` from ``meta`` (one row per sequence of a batch bucket: built on the host,
        staged through a pinned buffer, or on the device, copied field by field) whose first input ids are
        ``first`` (device int64, the real sequences'); ``forced`` (device int64 ``[sequences, steps]``) replaces
        the picks. Returns the picks ``[bucket, steps]`` (a static buffer, valid until this chain's next
        replay)."""
        B = meta.batch_size
        key = (B, steps, int(forced is not None))
        g = self._graph(key)
        blob = self._blobs[key]
        if meta.input_ids.is_cuda:
            for name in _FIELDS:
                if (src := getattr(meta, name)) is not None:
                    blob.views[name].copy_(src, non_blocking=True)
        else:
            ring = self._rings[B]
            host, done = ring[self._uses % len(ring)]
            self._uses += 1
            done.synchronize()  # this pinned buffer's previous copy has read it
            for name in _FIELDS:
                if (src := getattr(meta, name)) is not None:
                    host.views[name].copy_(src)
            blob.buf.copy_(host.buf, non_blocking=True)
            done.record()
        g.meta.input_ids[:first.shape[0]].copy_(first)
        if forced is not None:
            self._forced[key][:forced.shape[0]].copy_(forced)
        g.graph.replay()
        self.replays += 1
        return self._out[key]

    def _static_meta(self, key: ChainKey) -> BatchMeta:  # type: ignore[override]
        B, steps, forced = key
        dev, W, ps = self.device, self.table_width, self.page_size
        scratch = self.cache.scratch_page
        blob = self._blobs[key] = _Blob(B, 1, W, dev)
        if B not in self._rings:
            self._rings[B] = [(_Blob(B, 1, W, torch.device("cpu"), pinned=True), torch.cuda.Event())
                                   for _ in range(self.plan.tuning.graphs.staging_slots)]
        v = blob.views
        # padded rows read and write the scratch page only, at positions 0..steps-1
        v["input_ids"].zero_()
        v["positions"].zero_()
        v["cu_seqlens_q"].copy_(torch.arange(B + 1, dtype=torch.int32))
        v["seq_lens_k"].fill_(1)
        v["page_table"].fill_(scratch)
        v["slot_mapping"].fill_(scratch * ps)
        # a chained draft keeps no recent rows (its steps' positions move on the device, past any ring slot's rule)
        static = BatchMeta(max_seqlen_q=1, max_seqlen_k=W * ps, phase="decode", logits_indices=None,
                           **{name: v[name] for name in _FIELDS if name != "ring_slots"})
        self._work[key] = BatchMeta(
            input_ids=torch.empty_like(static.input_ids), positions=torch.empty_like(static.positions),
            cu_seqlens_q=static.cu_seqlens_q, seq_lens_k=torch.empty_like(static.seq_lens_k),
            max_seqlen_q=1, max_seqlen_k=W * ps, phase="decode", page_table=static.page_table,
            slot_mapping=torch.empty_like(static.slot_mapping), logits_indices=None)
        if forced:
            self._forced[key] = torch.zeros((B, steps), dtype=torch.int64, device=dev)
        self._out[key] = torch.zeros((B, steps), dtype=torch.int64, device=dev)
        return static

    def _step(self, key: ChainKey, meta: BatchMeta) -> tuple[torch.Tensor, torch.Tensor | None]:  # type: ignore[override]
        _, steps, forced = key
        work = self._work[key]
        for name in ("input_ids", "positions", "seq_lens_k", "slot_mapping"):
            getattr(work, name).copy_(getattr(meta, name))
        logits = chain_steps(self.plan, self.cache, work, steps, self._out[key],
                             self._forced[key] if forced else None)
        return logits, None
