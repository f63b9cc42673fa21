"""Device script: can the prefill's W rebuilds run beside its GEMMs when cuBLAS leaves some SMs free?

Back to back, an 8B-shape 2048-token prefill runs at the card's 700 W cap; the fp16 GEMMs alone take
~43.8 ms of its ~55 ms, and the W rebuild (~5.9 ms at full clock) runs between them, on all SMs, one
after another (docs/performance.md, runs 14 and 18). Here the GEMMs of cuBLAS are told to leave ``c``
SMs free (``torch._C._set_sm_carveout_experimental``) while the next group's W is rebuilt on a side
stream, two W buffers in turn. Variants, each one CUDA graph of 32 layers x 4 groups (q/k/v, o,
gate/up, down; K = 4 MUL1 random trellis), timed back to back in alternating rounds:

- ``gemm``: the GEMMs alone (the bound), ``gemm-c<c>``: with ``c`` SMs carved out
- ``serial``: rebuild, then GEMM, on one stream (today's engine)
- ``overlap-c<c>``: rebuild i + 1 on the side stream beside GEMM i; ``-hi`` puts the side stream at high priority

The carveout only takes effect on cuBLASLt (``--blas cublaslt``; torch 2.11's default cuBLAS path ignores
it, run 29). The engine-level version (the W of the next linear rebuilt on a side stream,
``EXL3_PREFILL_PREFETCH`` / ``EXL3_PREFILL_CARVEOUT``) is on branch ``wip/prefill-overlap``.

    python bench/prefill_overlap.py [--carveouts 0,8,16,32] [--rounds 3] [--hi] [--blas cublaslt]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from exl3_kernels import event_ms  # bench/ is the script's directory

from exl3_core.quant.exl3.cuda_ops import reconstruct_full_into_cuda

K, CB = 4, 2
GROUPS = [(4096, [4096, 1024, 1024]), (4096, [4096]), (4096, [14336, 14336]), (14336, [4096])]


def rand_member(k: int, n: int, dev: torch.device) -> dict:
    tr = torch.randint(-32768, 32767, (k // 16, n // 16, 16 * K), dtype=torch.int16, device=dev)
    return {"trellis": tr, "suh": (torch.randn(k, device=dev).sign() * 0.02).half(),
            "svh": torch.randn(n, device=dev).sign().half(), "n": n}


def carve(c: int | None) -> None:
    torch._C._set_sm_carveout_experimental(c if c else None)


def kernels(args: argparse.Namespace) -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    layers = [[[rand_member(k, n, dev) for n in ns] for k, ns in GROUPS] for _ in range(32)]
    steps = [(k, sum(m["n"] for m in ms), ms) for layer in layers for (k, _), ms in zip(GROUPS, layer)]
    wmax = max(k * n for k, n, _ in steps)
    bufs = [torch.empty(wmax, dtype=torch.float16, device=dev) for _ in range(2)]
    xs = {k: torch.randn(args.tokens, k, device=dev).half() * 0.1 for k in (4096, 14336)}
    ys = {n: torch.empty(args.tokens, n, device=dev, dtype=torch.float16) for _, n, _ in steps}

    def wv(i: int) -> torch.Tensor:
        k, n, _ = steps[i]
        return bufs[i % 2][: k * n].view(k, n)

    def rebuild(i: int) -> None:
        w, off = wv(i), 0
        for m in steps[i][2]:
            reconstruct_full_into_cuda(m["trellis"], m["suh"], m["svh"], K, CB, w[:, off:off + m["n"]])
            off += m["n"]

    def gemm(i: int) -> None:
        k, n, _ = steps[i]
        torch.matmul(xs[k], wv(i), out=ys[n])

    def f_gemm() -> None:
        for i in range(len(steps)):
            gemm(i)

    def f_serial() -> None:
        for i in range(len(steps)):
            rebuild(i)
            gemm(i)

    def make_overlap(hi: bool) -> Callable[[], None]:
        side = torch.cuda.Stream(dev, priority=-1 if hi else 0)

        def f() -> None:
            main = torch.cuda.current_stream(dev)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                rebuild(0)
            ready = torch.cuda.Event()
            ready.record(side)
            for i in range(len(steps)):
                if i + 1 < len(steps):
                    # buffer (i + 1) % 2 was last read by GEMM i - 1, already on main: wait for main so far
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        rebuild(i + 1)
                    nxt = torch.cuda.Event()
                    nxt.record(side)
                main.wait_event(ready)
                gemm(i)
                if i + 1 < len(steps):
                    ready = nxt
            main.wait_stream(side)
        return f

    variants: dict[str, tuple[Callable[[], None], int]] = {"gemm": (f_gemm, 0), "serial": (f_serial, 0)}
    for c in args.carveouts:
        if c:
            variants[f"gemm-c{c}"] = (f_gemm, c)
        variants[f"overlap-c{c}"] = (make_overlap(False), c)
    if args.hi:
        for c in args.carveouts:
            variants[f"overlap-c{c}-hi"] = (make_overlap(True), c)

    # correctness: the overlapped order computes what the serial one does (last group's y)
    graphs = {}
    for name, (fn, c) in variants.items():
        carve(c)
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream(dev).wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        carve(0)
        graphs[name] = g
    graphs["serial"].replay()
    torch.cuda.synchronize()
    ref = ys[4096].clone()
    graphs[f"overlap-c{args.carveouts[-1]}"].replay()
    torch.cuda.synchronize()
    print(f"overlap vs serial, last down_proj y: max |diff| {(ys[4096].float() - ref.float()).abs().max().item():.3e}")

    res: dict[str, list[float]] = {n: [] for n in graphs}
    for _ in range(args.rounds):
        for name, g in graphs.items():
            event_ms(g.replay, 2)
            res[name] += event_ms(g.replay, args.iters)
    # from idle (full clock): does the carveout take effect at all? (fewer SMs: a slower GEMM)
    for name in [n for n in graphs if n.startswith("gemm")]:
        idle = []
        for _ in range(3):
            time.sleep(1.0)
            idle += event_ms(graphs[name].replay, 1)
        print(f"{name:>16} after 1 s idle: median {statistics.median(idle):7.2f} ms")
    flop = 2.0 * args.tokens * sum(k * n for k, n, _ in steps)
    base = statistics.median(res["serial"])
    for name, ms in res.items():
        med = statistics.median(ms)
        print(f"{name:>16}: median {med:7.2f} ms (min {min(ms):.2f}, max {max(ms):.2f}), "
              f"{flop / med / 1e9:4.0f} TFLOP/s, {med - base:+6.2f} ms vs serial")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--carveouts", default="0,8,16,32")
    ap.add_argument("--hi", action="store_true", help="also the side stream at high priority")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--blas", default="", help="torch's preferred BLAS library (cublas, cublaslt)")
    args = ap.parse_args()
    args.carveouts = [int(c) for c in args.carveouts.split(",")]
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    kernels(args)


if __name__ == "__main__":
    main()
