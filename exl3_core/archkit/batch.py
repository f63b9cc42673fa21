"""Per-forward batch metadata: tensors only, so a decode step can be captured in a CUDA graph.

All token-level tensors use the packed layout (one row per token of every sequence in the
batch, sequence b owning rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``). The forward pass never
reads these back to the host; Python ints here are static upper bounds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


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
    # decode graphs: (int32 carry [B], float64 src [S]): row i's input id is src[carry[i]] when that index
    # is valid (the previous step's greedy id, on the device), else input_ids[i]. Only a model whose
    # ``folds_carry`` is True is handed one; its forward applies it (exl3_core.ops.carry_ids' rule).
    carry: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def batch_size(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1

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
                   logits_indices: torch.Tensor | None = None) -> BatchMeta:
        """Host-side builder: new tokens per sequence plus how many tokens each already has cached."""
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
            phase="decode" if all(len(s) == 1 for s in seqs) and page_table is not None else "prefill",
            page_table=None if page_table is None else page_table.to(dev),
            slot_mapping=None if page_table is None else torch.tensor(slots, dtype=torch.int64, device=dev),
            logits_indices=logits_indices,
        )
