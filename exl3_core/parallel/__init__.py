"""Tensor and expert parallelism on torch.distributed: one model over several devices.

``model.load(device="cuda", tensor_parallel_size=N)`` (or ``devices=[...]``) makes the calling process rank 0
of N; exl3 starts the other ranks itself (:class:`WorkerGroup`: torch.multiprocessing workers joined in one
process group, NCCL between GPUs, gloo on the CPU). Every rank holds a share of each layer
(:mod:`exl3_core.parallel.sharding`) and the layers reduce their partial sums across the group; rank 0 runs
the generator, samplers, filters and the server unchanged, driving the workers each step
(:mod:`exl3_core.parallel.runtime`). docs/parallel.md has the user's view and what changes past one host.

Names resolve on first use, so the command line's option parsing (:mod:`exl3_core.parallel.cli`) stays
free of torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "WorkerGroup": "exl3_core.parallel.group",
    "ParallelError": "exl3_core.parallel.protocol",
    "RankSharder": "exl3_core.parallel.sharding",
}

__all__ = ["ParallelError", "RankSharder", "WorkerGroup"]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'exl3_core.parallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
