"""Device-memory checks shared by model loading and cache allocation: refuse before allocating."""
from __future__ import annotations

import torch


class InsufficientDeviceMemory(MemoryError):
    """An allocation would need more device memory than is free; the message has the figures."""


def fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def free_bytes(device: torch.device) -> tuple[int, int] | None:
    """``(free, total)`` bytes of a CUDA device, counting blocks torch's allocator holds unused as free;
    None elsewhere (host memory is not checked)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free, total


def check_free(nbytes: int, device: torch.device, what: str) -> None:
    """Raise :class:`InsufficientDeviceMemory` when ``nbytes`` exceed the device's free memory."""
    info = free_bytes(device)
    if info is not None and nbytes > info[0]:
        raise InsufficientDeviceMemory(
            f"{what} needs {fmt_bytes(nbytes)} on {device} but only {fmt_bytes(info[0])} of {fmt_bytes(info[1])} is "
            f"free; make it smaller (e.g. a Cache with a smaller max_num_tokens), free other GPU memory, or use "
            f"another device")
