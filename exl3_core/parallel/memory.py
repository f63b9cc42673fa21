"""Per-rank memory accounting before a tensor-parallel load: every rank's share of the weights (a dry run of
the load with that rank's cuts) plus its caches, checked before any worker starts where rank 0 can see the
memory (its own device; the host's memory for ranks on the CPU, which share it). Each worker checks its own
GPU again as it loads (:meth:`Model.load`'s plan), so a share that does not fit is refused there, by rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from exl3_core.devmem import InsufficientDeviceMemory, fmt_bytes, free_bytes

MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class RankShare:
    """What one rank will hold (bytes)."""

    rank: int
    device: torch.device
    weights: int
    caches: int

    @property
    def total(self) -> int:
        return self.weights + self.caches

    def describe(self) -> str:
        return f"rank {self.rank} ({self.device}): {fmt_bytes(self.total)} (weights {fmt_bytes(self.weights)} + " \
               f"caches {fmt_bytes(self.caches)})"


def host_available_bytes() -> int | None:
    """Host memory available to new allocations (Linux's MemAvailable), or None where it cannot be read."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_shares(shares: list[RankShare], what: str) -> None:
    """Refuse, before any worker starts, shares that cannot fit where rank 0 can tell: the CPU ranks' shares
    together against the host's available memory, and rank 0's share against its GPU's free memory.

    :raises InsufficientDeviceMemory: listing every rank's share and the fix."""
    world = len(shares)
    on_cpu = [s for s in shares if s.device.type == "cpu"]
    if on_cpu:
        avail = host_available_bytes()
        need = sum(s.total for s in on_cpu)
        if avail is not None and need > avail:
            raise InsufficientDeviceMemory(
                f"loading {what} over tensor_parallel_size={world} on the CPU needs {fmt_bytes(need)} of host memory "
                f"(" + "; ".join(s.describe() for s in on_cpu) + f") but only {fmt_bytes(avail)} is available; "
                f"use a smaller cache, fewer ranks or GPUs")
    first = shares[0]
    info = free_bytes(first.device)
    if info is not None and first.total > info[0]:
        raise InsufficientDeviceMemory(
            f"loading {what} over tensor_parallel_size={world}: {first.describe()} does not fit in the "
            f"{fmt_bytes(info[0])} free of {fmt_bytes(info[1])}; use more ranks, a smaller cache, or free GPU memory")
