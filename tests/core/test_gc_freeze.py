"""A CUDA generator freezes the objects alive at start-up out of later collections, after collecting the garbage."""
from __future__ import annotations

import gc
import weakref

import torch

from exl3_core.generator.graphs import freeze_long_lived


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_freeze_collects_garbage_first_and_keeps_frozen_cycles() -> None:
    dropped = _Node()
    dropped_ref = weakref.ref(dropped)
    del dropped
    kept = _Node()
    kept_ref = weakref.ref(kept)
    try:
        freeze_long_lived(torch.device("cuda"))  # the gc calls only: no device is touched
        assert dropped_ref() is None, "garbage alive before the freeze was frozen instead of freed"
        assert gc.get_freeze_count() > 0
        del kept
        gc.collect()
        assert kept_ref() is not None, "a frozen cycle was walked by a full collection"
    finally:
        gc.unfreeze()
    gc.collect()
    assert kept_ref() is None


def test_cpu_freezes_nothing() -> None:
    gc.unfreeze()
    freeze_long_lived(torch.device("cpu"))
    assert gc.get_freeze_count() == 0
