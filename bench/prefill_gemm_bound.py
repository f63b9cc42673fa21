"""Device script: how fast can the tensor-core work of a prefill alone run, back to back and from idle?

A 2048-token prefill of the 8B shape is ~28.6 TFLOP of fp16 GEMMs (q/k/v, o, gate/up, down per layer)
plus everything around them (the W rebuild, attention, norms, SiLU * mul). This script times only those
GEMMs, one dense fp16 weight per linear and layer (as the rebuilt W the engine multiplies by), captured
in one CUDA graph with torch.matmul (the engine's cuBLAS call), and logs nvidia-smi as
bench/prefill_clock.py does. Its back-to-back figure bounds any engine that does the prefill's math as
16-bit tensor-core GEMMs on this card: the rest of the forward has to fit in the difference.

    python bench/prefill_gemm_bound.py [--shape 8b] [--tokens 2048] [--idle 1.0] [--dtype bfloat16]

``--dtype`` runs the same GEMMs in bf16 (the engine's fresh-prompt prefill), whose operands draw less power
at the card's cap than fp16 ones.
"""
from __future__ import annotations

import statistics

import torch
from prefill_clock import back_to_back_and_idle, prefill_args

from exl3_core.bench.models import parse_shape
from exl3_core.bench.run import time_median


def main() -> None:
    args = prefill_args(extra=True)
    s = parse_shape(args.shape)
    dev = torch.device("cuda")
    hd = s.head_dim or s.hidden // s.heads
    dims = [(s.hidden, (s.heads + 2 * s.kv_heads) * hd), (s.heads * hd, s.hidden), (s.hidden, 2 * s.intermediate),
            (s.intermediate, s.hidden)]
    dt = getattr(torch, args.dtype)

    def weight(k: int, n: int) -> torch.Tensor:
        return (torch.randn(k, n, device=dev, dtype=torch.float32) * k**-0.5).to(dt)

    ws = [[weight(k, n) for k, n in dims] for _ in range(s.layers)]
    xs = {k: torch.randn(args.tokens, k, device=dev, dtype=dt) for k, _ in dims}
    outs = {n: torch.empty(args.tokens, n, device=dev, dtype=dt) for _, n in dims}
    flop = 2.0 * args.tokens * sum(k * n for k, n in dims) * s.layers

    def forward() -> None:
        for layer in ws:
            for (k, n), w in zip(dims, layer):
                torch.matmul(xs[k], w, out=outs[n])

    forward()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        forward()

    def replay_ms() -> float:
        return time_median(g.replay, dev, warmup=0, iters=1) * 1e3

    phases = back_to_back_and_idle(replay_ms, args.idle)
    print(f"{args.shape}: {len(dims) * s.layers} {args.dtype} GEMMs of a {args.tokens}-token prefill, {flop / 1e12:.2f} TFLOP")
    for name, ms, (clk, pw, ex) in phases:
        med = statistics.median(ms)
        print(f"GEMMs only, {name}: median {med:.2f} ms = {args.tokens / med * 1e3:,.0f} tok/s, "
              f"{flop / med / 1e9:.0f} TFLOP/s (min {min(ms):.2f}, max {max(ms):.2f}); "
              f"nvidia-smi: SM {clk:.0f} MHz, {pw:.0f} W{ex}")


if __name__ == "__main__":
    main()
