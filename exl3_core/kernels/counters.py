"""Arrival counters for kernels whose last-arriving program finishes the job (a "last block" reduction).

Such a kernel's programs each store a partial result, then add 1 to their group's counter; the one
that sees ``count == programs - 1`` reads every partial, writes the result and sets the counter back
to 0. So the counters are zero between calls and one buffer per kernel family and device serves every
call, eager or replayed in a CUDA graph, as long as calls of one family do not run concurrently on
two streams of the same device (the decode step runs on one stream).
"""
from __future__ import annotations

import torch

_cache: dict[tuple[str, str, int | None], torch.Tensor] = {}
#: buffers a larger one replaced: CUDA graphs captured earlier still point at them, so they are never freed
_retired: list[torch.Tensor] = []


def arrival_counters(name: str, device: torch.device, rows: int) -> torch.Tensor:
    """int32 counters, zero, at least ``rows`` of them, for the kernel family ``name`` on ``device``.

    A buffer that must grow while a CUDA graph is being captured comes from that graph's private
    pool (and its zeroing is a captured node): the graph keeps it, and it is not cached for later
    calls, whose memory the pool could hand out again once the graph is gone. A cached buffer that
    an eager call outgrows is retired, not freed: graphs captured with it replay on it (e.g. a small
    decode bucket's after a larger bucket's warm-up)."""
    key = (name, device.type, device.index)
    buf = _cache.get(key)
    if buf is None or buf.numel() < rows:
        # at least double: retired buffers then add up to less than the live one
        fresh = torch.zeros(max(rows, 1024, 2 * (buf.numel() if buf is not None else 0)), dtype=torch.int32,
                            device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return fresh
        if buf is not None:
            _retired.append(buf)
        buf = _cache[key] = fresh
    return buf
