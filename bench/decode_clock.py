"""Device script: the b=1 decode against the decode-only ceiling, measured in alternation, with the card's clock.

`exl3 bench` measures the ceiling before and after its b=1 runs and divides by the faster one; the two
differ by up to ~4%. This script alternates the two measurements ``--rounds`` times on one model and logs
nvidia-smi (SM clock, power, clock event reasons) during each, so that every fraction pairs an engine run
with a ceiling measured right before it, under the same clock.

    python bench/decode_clock.py [--shape 8b] [--ctx 256] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

from prefill_clock import SmiLog

from exl3_core.bench.models import build_model, parse_shape
from exl3_core.bench.run import bench_decode, decode_ceiling


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    model, cache = build_model(parse_shape(args.shape), bpw=4.0, head_bits=6, codebook="mul1", device="cuda",
                               cache_tokens=4 * (args.ctx + args.new_tokens + 512))
    bench_decode(model, cache, batch=1, ctx=args.ctx, new_tokens=16)  # graphs captured, kernels loaded
    rounds = []
    with SmiLog() as smi:
        time.sleep(0.5)
        for _ in range(args.rounds):
            t0 = time.time()
            ceil = decode_ceiling(model)["tok_s"]
            t1 = time.time()
            eng = bench_decode(model, cache, batch=1, ctx=args.ctx, new_tokens=args.new_tokens)["tok_s"]
            rounds.append((ceil, (t0, t1), eng, (t1, time.time())))
    fr = []
    for i, (ceil, wc, eng, we) in enumerate(rounds):
        cc, pc, xc = smi.phase([wc])
        ce, pe, xe = smi.phase([we])
        fr.append(eng / ceil)
        print(f"round {i}: ceiling {ceil:.1f} tok/s (SM {cc:.0f} MHz, {pc:.0f} W{xc}) | engine b=1 ctx {args.ctx} "
              f"{eng:.1f} tok/s (SM {ce:.0f} MHz, {pe:.0f} W{xe}) | {100 * eng / ceil:.1f}%")
    ceils = [r[0] for r in rounds]
    engs = [r[2] for r in rounds]
    print(f"{args.shape}: ceiling median {statistics.median(ceils):.1f} (min {min(ceils):.1f}, max {max(ceils):.1f}); "
          f"engine median {statistics.median(engs):.1f} (min {min(engs):.1f}, max {max(engs):.1f}); "
          f"paired fraction median {100 * statistics.median(fr):.1f}% (min {100 * min(fr):.1f}%, "
          f"max {100 * max(fr):.1f}%); engine median / strictest ceiling {100 * statistics.median(engs) / max(ceils):.1f}%")


if __name__ == "__main__":
    main()
