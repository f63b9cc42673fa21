"""The stacked LoRA weights of one linear: what the torch form and the Triton kernels both read."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StackEntry:
    """One adapter's part of a stack: its global slot, ``A [r, in]``, ``Bᵀ [r, out]`` and scale."""

    slot: int
    a: torch.Tensor
    bt: torch.Tensor
    scale: float


@dataclass(frozen=True)
class LoraStack:
    """The adapters on one linear (immutable: a load or unload builds a new one and swaps it in)."""

    a: torch.Tensor  # [S, r, in], the model's dtype
    bt: torch.Tensor  # [S, r, out]
    local: torch.Tensor  # int64 [capacity + 1]: slot -> index in the stack (0 where absent)
    scale: torch.Tensor  # fp32 [capacity + 1]: slot -> PEFT scale (0 where absent)
    entries: tuple[StackEntry, ...]

    @property
    def rank(self) -> int:
        return int(self.a.shape[1])

    @classmethod
    def build(cls, entries: Sequence[StackEntry], capacity: int, device: torch.device,
              dtype: torch.dtype) -> LoraStack:
        """Stack ``entries`` (any devices and dtypes) on ``device`` in ``dtype``; slot tables sized for ``capacity``."""
        if not entries:
            raise ValueError("LoraStack.build: no adapters to stack")
        r = max(int(e.a.shape[0]) for e in entries)
        n_in, n_out = int(entries[0].a.shape[1]), int(entries[0].bt.shape[1])
        a = torch.zeros((len(entries), r, n_in), dtype=dtype, device=device)
        bt = torch.zeros((len(entries), r, n_out), dtype=dtype, device=device)
        local = torch.zeros(capacity + 1, dtype=torch.int64)
        scale = torch.zeros(capacity + 1, dtype=torch.float32)
        kept = []
        for i, e in enumerate(entries):
            k = int(e.a.shape[0])
            a[i, :k] = e.a.to(device=device, dtype=dtype)
            bt[i, :k] = e.bt.to(device=device, dtype=dtype)
            local[e.slot] = i
            scale[e.slot] = e.scale
            kept.append(StackEntry(e.slot, a[i, :k], bt[i, :k], e.scale))
        return cls(a, bt, local.to(device), scale.to(device), tuple(kept))

    def resized(self, capacity: int) -> LoraStack:
        """The same adapters with slot tables for ``capacity`` slots."""
        return LoraStack.build(self.entries, capacity, self.a.device, self.a.dtype)

    def without(self, slot: int) -> LoraStack | None:
        """The stack without the adapter in ``slot`` (None when it was the only one)."""
        rest = [e for e in self.entries if e.slot != slot]
        cap = self.local.shape[0] - 1
        return LoraStack.build(rest, cap, self.a.device, self.a.dtype) if rest else None
