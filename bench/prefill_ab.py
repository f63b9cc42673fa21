"""Device script: the engine's graphed prefill in two variants, one model, alternating rounds, back to back
and after an idle second (the card's power cap makes cross-call comparisons noisy). Each variant is an
execution plan with its own tuning: ``--ab pruned``: with and without the last block pruned to the rows whose
logits are asked for (``FusionTuning.last_rows``); ``--ab bf16``: bf16 activations and GEMM operands against
fp16 (``FusionTuning.prefill_bf16``).

    python bench/prefill_ab.py [--ab pruned|bf16] [--shape 8b] [--tokens 2048] [--rounds 4] [--iters 10] [--idle 5]
                               [--eager 5]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from exl3_kernels import event_ms  # bench/ is the script's directory

from exl3_core.archkit.batch import BatchMeta
from exl3_core.bench.models import build_model, parse_shape
from exl3_core.bench.run import prefill_meta
from exl3_core.cache import Cache
from exl3_core.generator.graphs import PrefillGraphs
from exl3_core.plan import ExecutionPlan
from exl3_core.tuning import Tuning

#: per --ab: the FusionTuning field switched, and the names of its on and off variants
VARIANTS = {"pruned": ("last_rows", ("pruned", "full")), "bf16": ("prefill_bf16", ("bf16", "fp16"))}


def _enqueue_vs_device(plan: ExecutionPlan, cache: Cache, meta: BatchMeta) -> tuple[float, float]:
    """ms the host takes to enqueue one eager forward, and its device time by events (GPU idle at the start)."""
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    e0.record()
    plan.forward(meta, cache)
    enqueue = (time.perf_counter() - t) * 1e3
    e1.record()
    e1.synchronize()
    return enqueue, e0.elapsed_time(e1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ab", choices=("pruned", "bf16"), default="pruned")
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--idle", type=int, default=5, help="replays per variant, each after 1 s idle")
    ap.add_argument("--eager", type=int, default=5, help="eager forwards per variant (host enqueue vs device)")
    args = ap.parse_args()
    model, cache = build_model(parse_shape(args.shape), bpw=4.0, head_bits=6, codebook="mul1", device="cuda",
                               cache_tokens=2 * args.tokens + 1024)
    pages = cache.allocator.allocate(-(-args.tokens // cache.page_size))
    ids = prefill_meta(model, cache, args.tokens, pages).input_ids.tolist()
    field, names = VARIANTS[args.ab]
    base = Tuning.for_device(model.device)
    plans = {name: ExecutionPlan(model, dataclasses.replace(base, fusion=dataclasses.replace(base.fusion, **{field: on})))
             for name, on in zip(names, (True, False))}
    for name, plan in plans.items():
        print(f"{name}: tuning {plan.tuning.name}" + "".join(f"; {d}" for d in plan.tuning.describe()))
    graphs, logits = {}, {}
    for name in names:
        g = PrefillGraphs.create(plans[name], cache, len(pages), args.tokens)
        assert g is not None, "prefill graphs declined"
        graphs[name] = g
        logits[name] = g.run(ids, pages).float().clone()
    a, b = logits[names[0]], logits[names[1]]
    print(f"logits rel. difference {names[0]} vs {names[1]}: {((a - b).norm() / b.norm()).item():.2e}; "
          f"same argmax: {bool((a.argmax(-1) == b.argmax(-1)).all())}")
    res: dict[str, list[float]] = {n: [] for n in graphs}
    for _ in range(args.rounds):
        for name, g in graphs.items():
            event_ms(lambda g=g: g.run(ids, pages), 2)
            res[name] += event_ms(lambda g=g: g.run(ids, pages), args.iters)
    idle: dict[str, list[float]] = {n: [] for n in graphs}
    for _ in range(args.idle):
        for name, g in graphs.items():
            time.sleep(1.0)
            idle[name] += event_ms(lambda g=g: g.run(ids, pages), 1)
    # eager forwards (each plan's forward): host enqueue time and device time by events, GPU idle at the start
    eager: dict[str, list[tuple[float, float]]] = {}
    meta = prefill_meta(model, cache, args.tokens, pages)
    for name in names:
        for _ in range(2):
            plans[name].forward(meta, cache)
        eager[name] = [_enqueue_vs_device(plans[name], cache, meta) for _ in range(args.eager)]
    n = args.tokens
    for name in names:
        enq = statistics.median(e for e, _ in eager[name])
        dev = statistics.median(d for _, d in eager[name])
        print(f"{args.shape} prefill {n} {name:>6} eager: host enqueue {enq:6.2f} ms, device {dev:6.2f} ms = {n / dev * 1e3:,.0f} tok/s")
    for name in graphs:
        m, mi = statistics.median(res[name]), statistics.median(idle[name])
        print(f"{args.shape} prefill {n} {name:>6}: back to back {m:6.2f} ms = {n / m * 1e3:,.0f} tok/s "
              f"(min {min(res[name]):.2f}, max {max(res[name]):.2f}); after 1 s idle {mi:6.2f} ms = {n / mi * 1e3:,.0f} tok/s")
    model.unload()
    cache.free()


if __name__ == "__main__":
    main()
