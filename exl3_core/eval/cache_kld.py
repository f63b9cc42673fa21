"""What a quantized KV cache costs in quality: the KL divergence of the next-token distributions read through
it from those read through the unquantized cache, on the same text, through the paged engine.

The text is fed as one sequence in prefill chunks; every chunk's rows attend over the cache (this chunk's
keys and values are stored first), so from the second chunk on every position reads keys and values
through the cache under test. The first chunk of a fresh sequence attends to its own unquantized rows (the
engine's fresh-prompt path) and is left out of the mean.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from exl3_core.cache_bits import CacheBits
from exl3_core.eval.kld import kl_per_token


@dataclass(frozen=True)
class CacheKLD:
    """One cache variant against the unquantized cache."""

    label: str  # "k4v4", ...
    kld: float  # mean KL(unquantized ‖ variant) per position, nats
    top1: float  # fraction of positions whose most likely token agrees
    tokens: int  # positions averaged


def cache_kld(model: Any, ids: torch.Tensor, variants: Sequence[CacheBits], *, chunk: int = 256,
              page_size: int | None = None) -> list[CacheKLD]:
    """:class:`CacheKLD` of every variant for the 1-D token ids ``ids`` (at least two chunks long) on the loaded
    ``model``; all caches advance chunk by chunk together, so only one chunk's logits are held at a time."""
    from exl3_core.archkit.batch import BatchMeta
    from exl3_core.cache import Cache
    from exl3_core.plan import ExecutionPlan

    ids = ids.reshape(-1).to(torch.int64)
    n = ids.shape[0]
    if n < 2 * chunk:
        raise ValueError(f"cache_kld: {n} tokens; give at least two chunks ({2 * chunk}) so some positions read the "
                         f"cache")
    plan = ExecutionPlan(model)
    runs = [CacheBits(), *variants]
    caches = [Cache(model, n, page_size=page_size, **v.cache_kwargs()) for v in runs]
    ps = caches[0].page_size
    tables = [torch.tensor([c.allocator.allocate(-(-n // ps))], dtype=torch.int32) for c in caches]
    total = [0.0] * len(variants)
    agree = [0] * len(variants)
    counted = 0
    for start in range(0, n, chunk):
        toks = ids[start:start + chunk].tolist()
        rows = torch.arange(len(toks), device=model.device)
        logits = []
        for cache, table in zip(caches, tables):
            # the sequence holds ring slot 1 where the cache keeps recent rows, as the generator would give it
            meta = BatchMeta.from_lists([toks], [start], device=model.device, page_table=table, page_size=ps,
                                        logits_indices=rows, ring_slots=[1] if cache.ring_slots else None)
            logits.append(plan.forward(meta, cache).float().cpu())
        if start == 0:
            continue
        ref = logits[0]
        for i, lg in enumerate(logits[1:]):
            total[i] += float(kl_per_token(ref, lg).sum())
            agree[i] += int((ref.argmax(-1) == lg.argmax(-1)).sum())
        counted += len(toks)
    return [CacheKLD(v.label(model.dtype), total[i] / counted, agree[i] / counted, counted) for i, v in enumerate(variants)]
