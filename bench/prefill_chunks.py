"""Prefill GEMMs with W rebuilt in L2-sized column chunks (timing study, H200).

Today a prefill linear rebuilds its whole fp16 W in the original basis (``reconstruct_full_into``:
the writes go to HBM) and one cuBLAS GEMM reads it back. Here each linear (or group sharing x) is
rebuilt ``--chunk`` columns at a time into one scratch buffer that stays in L2, and each chunk's
GEMM writes its column block of y (``mm(out=y[:, cols])``). The column chunks are cut from the trellis
ahead of the timing (a strided launch would read the same bytes), so only the rebuild + GEMM pattern
is measured. 8B-shape layers, 2048 tokens, K=4 MUL1, four layers' distinct weights in turn, back to
back (the clock as it settles under load). Usage::

    python bench/prefill_chunks.py [--tokens 2048] [--chunks 0,1024,2048,3072] [--rounds 12] [--down]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from exl3_core.quant.exl3.cuda_ops import reconstruct_full_into_cuda

K, CB = 4, 2
# (k, [n per member]) of one 8B layer: q/k/v, o_proj, gate/up, down
GROUPS = [(4096, [4096, 1024, 1024]), (4096, [4096]), (4096, [14336, 14336]), (14336, [4096])]


def rand_member(k: int, n: int, dev: torch.device) -> dict:
    tr = torch.randint(-32768, 32767, (k // 16, n // 16, 16 * K), dtype=torch.int16, device=dev)
    suh = (torch.randn(k, device=dev).sign() * 0.02).half()
    svh = (torch.randn(n, device=dev).sign()).half()
    return {"trellis": tr, "suh": suh, "svh": svh, "n": n}


def cut(member: dict, chunk: int) -> list[dict]:
    out = []
    for j0 in range(0, member["n"], chunk):
        j1 = min(j0 + chunk, member["n"])
        out.append({"trellis": member["trellis"][:, j0 // 16:j1 // 16].contiguous(), "suh": member["suh"],
                    "svh": member["svh"][j0:j1].contiguous(), "n": j1 - j0})
    return out


def run_group(x: torch.Tensor, members: list[dict], chunk: int, scratch: torch.Tensor | None,
              pieces: list[list[dict]] | None) -> torch.Tensor:
    k = x.shape[1]
    ns = [m["n"] for m in members]
    if chunk <= 0 or pieces is None:
        w = torch.empty((k, sum(ns)), dtype=torch.float16, device=x.device)
        off = 0
        for m in members:
            reconstruct_full_into_cuda(m["trellis"], m["suh"], m["svh"], K, CB, w[:, off:off + m["n"]])
            off += m["n"]
        return x @ w
    y = torch.empty((x.shape[0], sum(ns)), dtype=torch.float16, device=x.device)
    off = 0
    for parts in pieces:
        for p in parts:
            w = scratch[:, :p["n"]]
            reconstruct_full_into_cuda(p["trellis"], p["suh"], p["svh"], K, CB, w)
            torch.mm(x, w, out=y[:, off:off + p["n"]])
            off += p["n"]
    return y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunks", default="0,1024,2048,3072")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--down", action="store_true", help="chunk down_proj too (its x is larger than L2)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    layers = [[[rand_member(k, n, dev) for n in ns] for k, ns in GROUPS] for _ in range(4)]
    xs = {k: torch.randn(a.tokens, k, device=dev).half() * 0.1 for k in (4096, 14336)}
    chunks = [int(c) for c in a.chunks.split(",")]
    # correctness of the chunked pattern against the whole-W path (same rounding: one GEMM per column)
    for chunk in [c for c in chunks if c > 0][:1]:
        members = layers[0][2]
        ref = run_group(xs[4096], members, 0, None, None)
        scratch = torch.empty((4096, chunk), dtype=torch.float16, device=dev)
        got = run_group(xs[4096], members, chunk, scratch, [cut(m, chunk) for m in members])
        print(f"check chunk {chunk}: max |diff| {float((ref - got).abs().max()):.3e} "
              f"(ref max {float(ref.abs().max()):.3e})")
    # variants interleaved round by round (rotating order), so that each sees the same clock: back to
    # back, the card's SM clock drops under sustained tensor-core load (docs/performance.md, run 7)
    variants = [(c, False) for c in chunks] + ([(c, True) for c in chunks if c > 0] if a.down else [])
    plans = []
    for chunk, down in variants:
        plan = []
        for layer in layers:
            for gi, (k, _) in enumerate(GROUPS):
                members = layer[gi]
                use = chunk > 0 and (gi != 3 or down)
                pieces = [cut(m, chunk) for m in members] if use else None
                plan.append((k, members, chunk if use else 0, pieces))
        plans.append(plan)
    scratch = {k: torch.empty((k, max(max(chunks), 1)), dtype=torch.float16, device=dev) for k in (4096, 14336)}
    times: list[list[float]] = [[] for _ in variants]
    for r in range(a.rounds + 1):
        for i in [(r + j) % len(variants) for j in range(len(variants))]:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for k, members, c, pieces in plans[i]:
                run_group(xs[k], members, c, scratch[k], pieces)
            e.record()
            e.synchronize()
            if r >= 1:
                times[i].append(s.elapsed_time(e) / len(layers))
    for (chunk, down), t in zip(variants, times):
        med = statistics.median(t)
        print(f"chunk {chunk:5d}{' (down too)' if down else ''}: {med:.3f} ms per layer "
              f"(min {min(t):.3f}, max {max(t):.3f}); x 32 layers = {32 * med:.2f} ms")

if __name__ == "__main__":
    main()
