"""Device script: does the decode-only ceiling move after engine activity, or from one measurement to the next?

Measures `exl3 bench`'s decode-only ceiling (``decode_ceiling``) of a random-weight model three times right after
the build, then after 2 s of idle, after 30 eager decode steps, after a generator run (CUDA graphs), after
``gc`` + ``empty_cache`` and after 5 s of idle; each line gives the ceiling and each shape's Tweights/s.

    python bench/ceiling_drift.py [8b]
"""
from __future__ import annotations

import gc
import sys
import time

import torch

from exl3_core.bench.models import build_model, parse_shape
from exl3_core.bench.run import bench_decode, decode_ceiling, decode_meta


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "8b"
    model, cache = build_model(parse_shape(shape), bpw=4.0, head_bits=6, codebook="mul1", device="cuda",
                               cache_tokens=8192)

    def ceiling(tag: str) -> None:
        r = decode_ceiling(model)
        per = " ".join(f"{x['trellis'][0]}x{x['trellis'][1]}:{x['tweights_per_s']:.2f}" for x in r["per_shape"])
        print(f"{tag}: ceiling {r['tok_s']:.1f} tok/s | {per}", flush=True)

    for i in range(3):
        ceiling(f"fresh {i}")
    time.sleep(2)
    ceiling("after 2 s idle")
    meta, pages = decode_meta(model, cache, batch=1, ctx=256)
    for _ in range(30):
        model.forward_batch(meta, cache)
    torch.cuda.synchronize()
    cache.allocator.release(pages)
    ceiling("after 30 eager decode steps")
    ceiling("again")
    r = bench_decode(model, cache, batch=1, ctx=256, new_tokens=64)
    print(f"engine {r['tok_s']:.1f}", flush=True)
    ceiling("after generator run")
    ceiling("again")
    gc.collect()
    torch.cuda.empty_cache()
    ceiling("after gc + empty_cache")
    time.sleep(5)
    ceiling("after 5 s idle")


if __name__ == "__main__":
    main()
