"""Benchmarks of the EXL3 CUDA kernels: decode-only ceiling, GEMV/GEMM (with the one-launch fused
linear next to the 4-kernel chain at m <= 16), grouped fused linears, reconstruct, reconstruct_full
(W in the original basis) and the prefill chains around it.

Usage (on a CUDA machine, after building exl3_core._C, and bench/ext for the decode-only ceiling):
    PYTHONPATH=. python bench/exl3_kernels.py [--quick] [--json out.json] [--skip decode,gemm,...]

Every figure is printed with its two bounds: the memory roofline (bytes moved / measured copy
bandwidth) and the decode-only ceiling (weights / decode-only rate of the same decoder for that K
and codebook: ``torch.ops.exl3_bench.decode_only``, built by ``python bench/ext/build.py``; without it
the ceiling columns are left out). Timing: CUDA graphs of several calls over rotating buffers larger
than L2, CUDA events, warm-up, median of repeats.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from exl3_core import ext
from exl3_core.bench.run import decode_only_op

CB_NAMES = {0: "3inst", 1: "mcg", 2: "mul1"}
L2_BYTES = 60 * 2**20  # H200; overridden by the device property when torch exposes it


def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(0)
    return int(getattr(props, "L2_cache_size", L2_BYTES) or L2_BYTES)


def time_graph(fn, calls: int, reps: int = 7) -> float:
    """Median seconds per call of ``fn(i)`` for i in range(calls), captured once as a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(calls):  # warm-up outside the graph (lazy init, allocator)
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    return statistics.median(times)


def event_ms(fn, n: int) -> list[float]:
    """``n`` calls of ``fn``, each timed alone by CUDA events: milliseconds."""
    out = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def time_events(fn, warm: int = 2, reps: int = 5) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    return statistics.median(event_ms(fn, reps)) / 1e3


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = 2**30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    t = time_events(lambda: dst.copy_(src), warm=3, reps=10)
    return 2 * n / t


def rand_trellis(k: int, n: int, K: int) -> torch.Tensor:
    return torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=torch.int16, device="cuda")


def decode_ceiling(op, quick: bool, rows: list) -> dict:
    """Decode-only rate (weights/s) per (K, codebook) of the bench extension's kernel ``op``: 2^28 weights,
    every tile decoded once."""
    k = n = 16384
    out = {}
    ks = [4] if quick else range(1, 9)
    for K in ks:
        t = rand_trellis(k, n, K)
        for cb in (0, 1, 2):
            sec = time_events(lambda: op(t, cb, 0))
            rate = k * n / sec
            out[(K, cb)] = rate
            mem = t.numel() * 2 / BW
            rows.append(dict(kind="decode_only", K=K, cb=CB_NAMES[cb], weights=k * n, ms=sec * 1e3,
                             tw_s=rate / 1e12, mem_bound_ms=mem * 1e3))
            print(f"decode-only K={K} {CB_NAMES[cb]:5s}: {rate / 1e12:6.3f} Tweights/s  "
                  f"({sec * 1e3:7.3f} ms; memory floor {mem * 1e3:6.3f} ms)", flush=True)
        del t
    # occupancy / split sensitivity at the headline point
    t = rand_trellis(k, n, 4)
    for kt in (4, 8, 16, 32, 128):
        sec = time_events(lambda: op(t, 2, kt))
        rows.append(dict(kind="decode_only_kt", K=4, cb="mul1", kt_per_warp=kt, tw_s=k * n / sec / 1e12))
        print(f"decode-only K=4 mul1 kt_per_warp={kt}: {k * n / sec / 1e12:6.3f} Tweights/s", flush=True)
    return out


def gemm_bench(ceil: dict, quick: bool, rows: list) -> None:
    ops = torch.ops.exl3
    shapes = [(4096, 14336), (14336, 4096)]
    cbs = (2, 0) if quick else (2, 0, 1)
    for (k, n) in shapes:
        for cb in cbs:
            K = 4
            wbytes = k * n * K // 8
            copies = max(2, -(-3 * l2_bytes() // wbytes))  # rotate through > 3x L2 of trellis
            ts = [rand_trellis(k, n, K) for _ in range(copies)]
            su = (torch.randn(k, device="cuda").sign()).half()
            sv = (torch.rand(n, device="cuda") * 0.01).half()
            for m in (1, 2, 4, 8, 32):
                x = torch.randn(m, k, device="cuda").half()
                xh = ops.had128(x, su, None, True)
                sec_in = time_graph(lambda i: ops.exl3_gemm_xh(xh, ts[i % copies], K, cb, 0), copies)
                sec_full = time_graph(lambda i: ops.exl3_gemm(x, ts[i % copies], su, sv, cb), copies)
                mem = (wbytes + m * k * 2 + m * n * 4) / BW
                dec = k * n / ceil[(K, cb)] if (K, cb) in ceil else float("nan")
                row = dict(kind="gemm", k=k, n=n, m=m, K=K, cb=CB_NAMES[cb], us_inner=sec_in * 1e6,
                           us_full=sec_full * 1e6, mem_bound_us=mem * 1e6, decode_bound_us=dec * 1e6,
                           frac_of_decode_ceiling=dec / sec_in)
                fused = ""
                if m <= 16 and hasattr(ops, "exl3_linear"):  # exl3_gemm is the fused op here; time the old chain too
                    sec_fused = time_graph(lambda i: ops.exl3_linear(x, ts[i % copies], su, sv, cb), copies)
                    sec_chain = time_graph(
                        lambda i: ops.had128(ops.exl3_gemm_xh(ops.had128(x, su, None, True), ts[i % copies], K, cb, 0),
                                             None, sv, True), copies)
                    row.update(us_fused=sec_fused * 1e6, us_4kernel=sec_chain * 1e6)
                    fused = f", fused 1-launch {sec_fused * 1e6:7.2f} us vs 4-kernel chain {sec_chain * 1e6:7.2f} us"
                rows.append(row)
                print(f"gemm {k}x{n} K={K} {CB_NAMES[cb]:5s} m={m:2d}: inner {sec_in * 1e6:7.2f} us, full op "
                      f"{sec_full * 1e6:7.2f} us{fused} | memory floor {mem * 1e6:6.2f} us, decode-only floor "
                      f"{dec * 1e6:6.2f} us -> {100 * dec / sec_in:5.1f}% of decode ceiling, "
                      f"{k * n * m * 2 / sec_in / 1e12:6.2f} TFLOP/s", flush=True)
            if cb == 2:  # split-k sensitivity at the headline point
                x = torch.randn(1, k, device="cuda").half()
                for kt in (4, 8, 16, 24, 32):
                    sec = time_graph(lambda i: ops.exl3_gemm_xh(x, ts[i % copies], K, cb, kt), copies)
                    rows.append(dict(kind="gemm_kt", k=k, n=n, m=1, kt_per_warp=kt, us_inner=sec * 1e6))
                    print(f"  gemm {k}x{n} m=1 kt_per_warp={kt}: {sec * 1e6:7.2f} us", flush=True)
            # dense fp16 reference (cuBLAS) for the same shape, m=1
            wd = [torch.randn(k, n, device="cuda").half() for _ in range(max(2, -(-3 * l2_bytes() // (k * n * 2))))]
            x = torch.randn(1, k, device="cuda").half()
            sec = time_graph(lambda i: torch.matmul(x, wd[i % len(wd)]), len(wd))
            rows.append(dict(kind="fp16_gemv", k=k, n=n, us=sec * 1e6, mem_bound_us=k * n * 2 / BW * 1e6))
            print(f"fp16 cuBLAS GEMV {k}x{n}: {sec * 1e6:7.2f} us (memory floor {k * n * 2 / BW * 1e6:6.2f} us)",
                  flush=True)
            ts, wd = [], []  # drop this shape's copies before the next one allocates its own


def fused_group_bench(rows: list) -> None:
    """Decode-step shapes (m=1): q/k/v-like and gate/up-like groups in one launch vs one launch each."""
    ops = torch.ops.exl3
    if not hasattr(ops, "exl3_linear_group"):
        print("fused group: op not built, skipped", flush=True)
        return
    K, cb = 4, 2
    for k, ns in ((4096, (4096, 1024, 1024)), (4096, (14336, 14336))):
        wbytes = sum(k * n * K // 8 for n in ns)
        copies = max(2, -(-3 * l2_bytes() // wbytes))
        ts = [[rand_trellis(k, n, K) for n in ns] for _ in range(copies)]
        su = [(torch.randn(k, device="cuda").sign()).half() for _ in ns]
        sv = [(torch.rand(n, device="cuda") * 0.01).half() for n in ns]
        x = torch.randn(1, k, device="cuda").half()
        sec_g = time_graph(lambda i: ops.exl3_linear_group(x, ts[i % copies], su, sv, cb), copies)
        sec_s = time_graph(lambda i: [ops.exl3_linear(x, t, a, b, cb) for t, a, b in zip(ts[i % copies], su, sv)], copies)
        mem = wbytes / BW
        rows.append(dict(kind="fused_group", k=k, ns=list(ns), m=1, K=K, cb=CB_NAMES[cb], us_group=sec_g * 1e6,
                         us_separate=sec_s * 1e6, mem_bound_us=mem * 1e6))
        print(f"fused group k={k} n={ns} K={K} m=1: one launch {sec_g * 1e6:7.2f} us, {len(ns)} launches "
              f"{sec_s * 1e6:7.2f} us (memory floor {mem * 1e6:6.2f} us)", flush=True)
        ts = []  # drop this shape's copies before the next one allocates its own


def reconstruct_bench(ceil: dict, rows: list) -> None:
    ops = torch.ops.exl3
    k, n = 14336, 4096
    for K, cb in ((4, 2), (4, 0)):
        ts = [rand_trellis(k, n, K) for _ in range(4)]
        sec = time_graph(lambda i: ops.reconstruct(ts[i % 4], K, cb), 4)
        mem = (k * n * K // 8 + k * n * 2) / BW
        rows.append(dict(kind="reconstruct", k=k, n=n, K=K, cb=CB_NAMES[cb], us=sec * 1e6, mem_bound_us=mem * 1e6))
        print(f"reconstruct {k}x{n} K={K} {CB_NAMES[cb]}: {sec * 1e6:7.2f} us (memory floor {mem * 1e6:6.2f} us, "
              f"decode-only floor {k * n / ceil.get((K, cb), float('nan')) * 1e6:6.2f} us)", flush=True)


def reconstruct_full_bench(rows: list, quick: bool) -> None:
    """W in the original basis (exl3::reconstruct_full) vs its memory floor, then the prefill chains:
    the old had128 -> reconstruct -> cuBLAS -> had128 against cuBLAS on reconstruct_full, per m
    (the crossover sets FULL_MIN_M in csrc/exl3/exl3_ops.cu), and exl3_gemm as routed."""
    ops = torch.ops.exl3
    if not hasattr(ops, "reconstruct_full"):
        print("reconstruct_full: op not built, skipped", flush=True)
        return
    for k, n in ((4096, 14336), (14336, 4096)):
        for K, cb in ((4, 2), (4, 0)):
            copies = max(2, -(-3 * l2_bytes() // (k * n * K // 8)))
            ts = [rand_trellis(k, n, K) for _ in range(copies)]
            su = (torch.randn(k, device="cuda").sign()).half()
            sv = (torch.rand(n, device="cuda") * 0.01).half()
            sec = time_graph(lambda i: ops.reconstruct_full(ts[i % copies], su, sv, K, cb), copies)
            sec_r = time_graph(lambda i: ops.reconstruct(ts[i % copies], K, cb), copies)
            mem = (k * n * K // 8 + k * n * 2) / BW
            rows.append(dict(kind="reconstruct_full", k=k, n=n, K=K, cb=CB_NAMES[cb], us=sec * 1e6,
                             us_reconstruct=sec_r * 1e6, mem_bound_us=mem * 1e6))
            print(f"reconstruct_full {k}x{n} K={K} {CB_NAMES[cb]}: {sec * 1e6:7.2f} us (memory floor "
                  f"{mem * 1e6:6.2f} us, {100 * mem / sec:5.1f}%; reconstruct of Ŵ {sec_r * 1e6:7.2f} us)", flush=True)
            if cb == 2:
                for m in ((256, 2048) if quick else (65, 128, 256, 512, 1024, 2048)):
                    x = torch.randn(m, k, device="cuda").half()
                    t_old = time_graph(lambda i: ops.had128(torch.matmul(ops.had128(x, su, None, True),
                                                                         ops.reconstruct(ts[i % copies], K, cb)),
                                                            None, sv, True), copies)
                    t_new = time_graph(lambda i: torch.matmul(x, ops.reconstruct_full(ts[i % copies], su, sv, K, cb)),
                                       copies)
                    t_op = time_graph(lambda i: ops.exl3_gemm(x, ts[i % copies], su, sv, cb), copies)
                    rows.append(dict(kind="prefill_chain", k=k, n=n, m=m, K=K, cb=CB_NAMES[cb], us_4kernel=t_old * 1e6,
                                     us_full=t_new * 1e6, us_exl3_gemm=t_op * 1e6))
                    print(f"  prefill {k}x{n} m={m:4d}: had+reconstruct+GEMM+had {t_old * 1e6:8.2f} us, "
                          f"reconstruct_full+GEMM {t_new * 1e6:8.2f} us, exl3_gemm {t_op * 1e6:8.2f} us "
                          f"({m / t_op / 1e3:7.1f} k rows/s)", flush=True)
            ts.clear()  # free the copies before the next shape


def main() -> None:
    global BW
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip", default="", help="comma list of: decode,gemm,group,reconstruct,full")
    ap.add_argument("--ceiling-lib", type=Path, default=None,
                    help="the bench extension (default: bench/ext/build/exl3_bench.so when built)")
    args = ap.parse_args()
    if not ext.has_op("exl3_gemm"):
        raise SystemExit(f"exl3 CUDA ops not built: {ext.load_error}")
    op = decode_only_op(args.ceiling_lib)
    if op is None:
        print("decode-only ceiling: left out (build the bench extension: python bench/ext/build.py)")
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, L2 {l2_bytes() >> 20} MiB, torch {torch.__version__}")
    BW = copy_bandwidth()
    print(f"device copy bandwidth: {BW / 1e12:.3f} TB/s (read+write)", flush=True)
    rows: list = [dict(kind="copy_bw", tb_s=BW / 1e12, device=props.name)]
    skip = set(filter(None, args.skip.split(",")))
    ceil = decode_ceiling(op, args.quick, rows) if "decode" not in skip and op is not None else {}
    if "gemm" not in skip:
        gemm_bench(ceil, args.quick, rows)
    if "group" not in skip:
        fused_group_bench(rows)
    if "reconstruct" not in skip:
        reconstruct_bench(ceil, rows)
    if "full" not in skip:
        reconstruct_full_bench(rows, args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


BW = 4.25e12

if __name__ == "__main__":
    main()
