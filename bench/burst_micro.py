"""Several decode steps in one CUDA graph: device time per token of S greedy b=1 steps captured back to
back (each step's input id carried on the device from the step before, positions advancing), against
one step per graph replayed S times. Measures what the graph boundary costs a step (the replay's
launch gap and the first kernels' exposed prologue), before the generator learns to run bursts.

    python bench/burst_micro.py --shape 1b --ctx 256 --steps 1,2,4,8
"""
from __future__ import annotations

import argparse
from dataclasses import replace

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--steps", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per timed run (a multiple of every S)")
    ap.add_argument("--codebook", default="mul1")
    ap.add_argument("--device", default="cuda", help="cpu: run each S eagerly once (a check of the script)")
    a = ap.parse_args()
    from exl3_core import ops
    from exl3_core.bench.models import build_model, parse_shape
    from exl3_core.bench.run import time_median
    from exl3_core.generator.batching import Chunk, build_batch
    from exl3_core.generator.graphs import no_gc

    dev = torch.device(a.device)
    model, cache = build_model(parse_shape(a.shape), bpw=4.0, head_bits=6, codebook=a.codebook, device=dev,
                               cache_tokens=4 * (a.ctx + 256) + 1024)
    ps = cache.page_size
    steps = [int(s) for s in a.steps.split(",")]
    top = max(steps)
    W = cache.max_pages_per_seq(a.ctx + top + 1)
    pages = cache.allocator.allocate(W)
    metas = []
    for k in range(top):  # step k: one token after ctx + k cached ones
        m, _ = build_batch([Chunk([1], a.ctx + k, pages, True)], page_size=ps, table_width=W,
                           scratch_page=cache.scratch_page, device=dev, decode=True)
        metas.append(m)
    packed = torch.zeros((top, 2, 1), dtype=torch.float64, device=dev)
    src = torch.zeros(1, dtype=torch.int32, device=dev)  # row 0 takes the carried id
    folds = getattr(model, "folds_carry", False)
    print(f"# {a.shape} ctx {a.ctx}, folds_carry {folds}, pages {W} of {ps}")

    def step(k: int, S: int) -> None:
        carry = (src, packed[(k - 1) % S][0])  # step 0 reads the previous replay's last step
        meta = metas[k]
        if folds:
            meta = replace(meta, carry=carry)
        else:
            ops.carry_ids(meta.input_ids, *carry)
        logits = model.forward_batch(meta, cache, fp32_logits=False)
        ops.greedy_pack(logits, out=packed[k])

    if dev.type != "cuda":
        for S in steps:
            for k in range(S):
                step(k, S)
            print(f"S={S}: ids {packed[:S, 0, 0].tolist()}")
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(0, 1)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    for S in steps:
        g = torch.cuda.CUDAGraph()
        with no_gc(), torch.cuda.graph(g, pool=pool):
            for k in range(S):
                step(k, S)
        graphs[S] = g
    for rnd in range(2):
        for S in steps:
            g, reps = graphs[S], a.tokens // S
            sec = time_median(lambda g=g, reps=reps: [g.replay() for _ in range(reps)], dev, warmup=1, iters=9)
            us = sec * 1e6 / (reps * S)
            print(f"round {rnd} S={S}: {us:7.1f} us per token ({1e6 / us:7.1f} tok/s)")
    cache.allocator.release(pages)


if __name__ == "__main__":
    main()
