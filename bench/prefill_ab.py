"""Device script: the engine's graphed prefill in two variants, one model, alternating rounds, back to back
and after an idle second (the card's power cap makes cross-call comparisons noisy). ``--ab pruned``: with
and without the last block pruned to the rows whose logits are asked for (``StandardDecoder._last_rows``); ``--ab bf16``: bf16 activations and GEMM operands against fp16
(``StandardDecoder._prefill_dtype``, ``EXL3_PREFILL_BF16``).

    python bench/prefill_ab.py [--ab pruned|bf16] [--shape 8b] [--tokens 2048] [--rounds 4] [--iters 10] [--idle 5]
                               [--eager 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from exl3_kernels import event_ms  # bench/ is the script's directory

from exl3_core.archkit.decoder import StandardDecoder
from exl3_core.bench.models import build_model, parse_shape
from exl3_core.bench.run import prefill_meta
from exl3_core.generator.graphs import PrefillGraphs


def _enqueue_vs_device(model, cache, meta) -> tuple[float, float]:
    """ms the host takes to enqueue one eager forward, and its device time by events (GPU idle at the start)."""
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    e0.record()
    model.forward_batch(meta, cache)
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
    # the second variant of each pair replaces one decoder method while its graph is captured
    attr, names, off = {"pruned": ("_last_rows", ("pruned", "full"), lambda self, meta: (None, 0)),
                        "bf16": ("_prefill_dtype", ("bf16", "fp16"), lambda self, x, meta: None)}[args.ab]
    own = getattr(StandardDecoder, attr)
    graphs, logits = {}, {}
    for name in names:
        if name == names[1]:
            setattr(StandardDecoder, attr, off)
        try:
            g = PrefillGraphs.create(model, cache, len(pages), args.tokens)
            assert g is not None, "prefill graphs declined"
            graphs[name] = g
            logits[name] = g.run(ids, pages).float().clone()
        finally:
            setattr(StandardDecoder, attr, own)
    a, b = logits[names[0]], logits[names[1]]
    print(f"logits rel. difference {names[0]} vs {names[1]}: {((a - b).norm() / b.norm()).item():.2e}; "
          f"same argmax: {bool((a.argmax(-1) == b.argmax(-1)).all())}")
    res: dict[str, list[float]] = {n: [] for n in graphs}
    for _ in range(args.rounds):
        for name, g in graphs.items():
            event_ms(lambda: g.run(ids, pages), 2)
            res[name] += event_ms(lambda: g.run(ids, pages), args.iters)
    idle: dict[str, list[float]] = {n: [] for n in graphs}
    for _ in range(args.idle):
        for name, g in graphs.items():
            time.sleep(1.0)
            idle[name] += event_ms(lambda: g.run(ids, pages), 1)
    # eager forwards (model.forward_batch): host enqueue time and device time by events, GPU idle at the start
    eager: dict[str, list[tuple[float, float]]] = {}
    meta = prefill_meta(model, cache, args.tokens, pages)
    for name in names:
        if name == names[1]:
            setattr(StandardDecoder, attr, off)
        try:
            for _ in range(2):
                model.forward_batch(meta, cache)
            eager[name] = [_enqueue_vs_device(model, cache, meta) for _ in range(args.eager)]
        finally:
            setattr(StandardDecoder, attr, own)
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


if __name__ == "__main__":
    main()
