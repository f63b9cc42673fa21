"""Per-forward batch metadata: tensors only, so a decode step can be captured in a CUDA graph.

All token-level tensors use the packed layout (one row per token of every sequence in the
batch, sequence b owning rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``). The forward pass never
reads these back to the host; Python ints here are static upper bounds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import torch

from exl3_core.attention.spec import CallShape, pow2_bucket

if TYPE_CHECKING:
    from exl3_core.cache.geometry import LayerGeometry
    from exl3_core.cache.layer import CacheLayers


@dataclass
class BatchMeta:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T], absolute position of each token in its sequence
    cu_seqlens_q: torch.Tensor  # int32 [B+1]
    seq_lens_k: torch.Tensor  # int32 [B], keys visible after this step (cached + new)
    max_seqlen_q: int
    max_seqlen_k: int
    phase: Literal["prefill", "decode"] = "prefill"
    page_table: torch.Tensor | None = None  # int32 [B, max_pages]; None = no cache
    slot_mapping: torch.Tensor | None = None  # int64 [T], flat cache slot page*page_size+offset
    logits_indices: torch.Tensor | None = None  # int64 [N] rows that need logits; None = all
    #: int32 [B]: each sequence's ring slot in caches that keep per-sequence state (a quantized cache's recent
    #: rows); None = the forward names none (such caches then read and write their pages alone)
    ring_slots: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1

    @property
    def q_per_seq(self) -> int:
        """Query rows of every sequence in a decode step (1, or k for a multi-token step); 0 for prefill
        and mixed steps, whose sequences differ."""
        return self.max_seqlen_q if self.phase == "decode" else 0

    def call_shape(self) -> CallShape:
        """The static shape attention backends are chosen for (host-side values only)."""
        return CallShape(self.phase, pow2_bucket(self.max_seqlen_k), pow2_bucket(self.batch_size), self.q_per_seq)

    @property
    def fresh_single_sequence(self) -> bool:
        """One sequence whose keys are exactly this batch's rows (no cached prefix): ``max_seqlen_k`` bounds
        its key count from above, so equal to the row count it leaves no room for a prefix."""
        return self.cu_seqlens_q.shape[0] == 2 and self.max_seqlen_k == self.input_ids.shape[0]

    @classmethod
    def full(cls, input_ids: torch.Tensor) -> BatchMeta:
        """Metadata for a cache-less forward of ``input_ids [B, S]`` (every row length S)."""
        B, S = input_ids.shape
        dev = input_ids.device
        return cls(
            input_ids=input_ids.reshape(-1).to(torch.int64),
            positions=torch.arange(S, device=dev, dtype=torch.int64).repeat(B),
            cu_seqlens_q=torch.arange(0, (B + 1) * S, S, device=dev, dtype=torch.int32),
            seq_lens_k=torch.full((B,), S, device=dev, dtype=torch.int32),
            max_seqlen_q=S,
            max_seqlen_k=S,
        )

    @classmethod
    def from_lists(cls, seqs: list[list[int]], past_lens: list[int], *, device: torch.device | str = "cpu",
                   page_table: torch.Tensor | None = None, page_size: int = 256,
                   logits_indices: torch.Tensor | None = None,
                   phase: Literal["prefill", "decode"] | None = None,
                   ring_slots: list[int] | None = None) -> BatchMeta:
        """Host-side builder: new tokens per sequence plus how many tokens each already has cached.

        ``phase``: None picks "decode" when every sequence brings one token over a page table; an
        explicit "decode" (a multi-token decode step) needs the same token count in every sequence."""
        if phase == "decode" and (page_table is None or len({len(s) for s in seqs}) != 1):
            raise ValueError("BatchMeta.from_lists(phase='decode'): a decode step needs a page table and the same "
                             f"number of new tokens in every sequence, got {[len(s) for s in seqs]}")
        ids, pos, cu, lens, slots = [], [], [0], [], []
        for b, (toks, past) in enumerate(zip(seqs, past_lens)):
            ids += toks
            pos += range(past, past + len(toks))
            cu.append(cu[-1] + len(toks))
            lens.append(past + len(toks))
            if page_table is not None:
                row = page_table[b].tolist()
                slots += [row[p // page_size] * page_size + p % page_size for p in range(past, past + len(toks))]
        dev = torch.device(device)
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens_k=torch.tensor(lens, dtype=torch.int32, device=dev),
            max_seqlen_q=max((len(s) for s in seqs), default=0),
            max_seqlen_k=max(lens, default=0),
            phase=phase or ("decode" if all(len(s) == 1 for s in seqs) and page_table is not None else "prefill"),
            page_table=None if page_table is None else page_table.to(dev),
            slot_mapping=None if page_table is None else torch.tensor(slots, dtype=torch.int64, device=dev),
            logits_indices=logits_indices,
            ring_slots=None if ring_slots is None else torch.tensor(ring_slots, dtype=torch.int32, device=dev),
        )


@runtime_checkable
class BatchModel(Protocol):
    """A model the generator can run: a packed batch forward over a paged cache, on one device.

    :class:`~exl3_core.archkit.model.Model` is one; :class:`~exl3_core.generator.toy.ToyModel` another.
    """

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def forward_batch(self, meta: BatchMeta, cache: CacheLayers | None = None, *,
                      fp32_logits: bool = True) -> torch.Tensor:
        """Logits ``[N, vocab]`` for ``meta.logits_indices`` (every row when None); this step's keys and
        values stored in ``cache``. Reads no tensor back to the host."""
        ...

    def cache_geometry(self) -> tuple[LayerGeometry, ...]:
        """What each cache layer stores (see :class:`~exl3_core.cache.Cache`)."""
        ...
