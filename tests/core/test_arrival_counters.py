"""Arrival counters (exl3_core/kernels/counters.py): one zeroed buffer per kernel family and device,
grown on demand, and a grown-out buffer kept alive (CUDA graphs captured with it still use it)."""
from __future__ import annotations

import torch

import exl3_core.kernels.counters as kc


def test_grow_retires_the_old_buffer() -> None:
    dev = torch.device("cpu")
    name = "test_grow_retires"
    small = kc.arrival_counters(name, dev, 8)
    assert small.dtype == torch.int32 and small.numel() >= 8 and int(small.abs().sum()) == 0
    assert kc.arrival_counters(name, dev, small.numel()) is small  # fits: the same buffer
    big = kc.arrival_counters(name, dev, small.numel() + 1)
    assert big is not small and big.numel() >= 2 * small.numel() and int(big.abs().sum()) == 0  # geometric growth
    assert any(t is small for t in kc._retired), "the outgrown buffer was dropped (a graph may still use it)"
    assert kc.arrival_counters(name, dev, 8) is big
    assert kc.arrival_counters("test_grow_retires_other", dev, 8) is not big  # one buffer per family
