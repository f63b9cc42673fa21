"""Tensor and expert parallelism on torch.distributed: one model over several devices.

``model.load(device="cuda", tensor_parallel_size=N)`` (or ``devices=[...]``) makes the calling process rank 0
of N; exl3 starts the other ranks itself (:class:`WorkerGroup`: torch.multiprocessing workers joined in one
process group, NCCL between GPUs, gloo on the CPU). Every rank holds a share of each layer
(:mod:`exl3_core.parallel.sharding`) and the layers reduce their partial sums across the group; rank 0 runs
the generator, samplers, filters and the server unchanged, driving the workers each step
(:mod:`exl3_core.parallel.runtime`). docs/parallel.md has the user's view and what changes past one host.
"""
from __future__ import annotations

from exl3_core.parallel.group import WorkerGroup
from exl3_core.parallel.protocol import ParallelError
from exl3_core.parallel.sharding import RankSharder

__all__ = ["ParallelError", "RankSharder", "WorkerGroup"]
