"""b=1 decode on the GPU: split-KV decode attention vs the single-pass kernel, fused small ops vs
their unfused torch chains.

Usage (CUDA machine, Triton installed):
    PYTHONPATH=.:plugins/attn_backends/src python bench/fused_decode_gpu.py [--layers 32] [--json out.json]

Shape: the 8b bench shape (hidden 4096, intermediate 14336, 32 q / 8 kv heads, head_dim 128, fp16).
Each figure is one *decode step's* worth of calls: a CUDA graph of ``--layers`` calls, each on its
own layer's tensors (a separate paged cache per layer, so K/V come from HBM as in a real step),
timed with CUDA events around graph replays (median of repeats), divided by nothing: per step.
Attention runs with ``max_seqlen_k`` = the cache capacity, as the decode graphs capture it.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from exl3_core import ops
from exl3_core.attention.spec import AttnArgs, AttnSpec, device_cc
from exl3_core.nn.norm import rms_norm
from exl3_core.nn.rope import apply_rotary

HQ, HKV, HD, HIDDEN, INTER = 32, 8, 128, 4096, 14336
DT = torch.float16


def time_graph(fn: Callable[[], object], reps: int = 15, replays: int = 5) -> float:
    """Median ms of one ``fn()`` (captured once into a CUDA graph) over ``reps`` timed batches."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()  # Triton compiles, allocator warms
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / replays)
    return statistics.median(times)


def attention_rows(layers: int, page_size: int, capacity: int, contexts: list[int], splits: list[int]) -> list[dict]:
    from exl3_attn_backends.triton_paged import TritonPagedAttention, choose_num_splits

    dev = torch.device("cuda")
    spec = AttnSpec(head_dim=HD, num_q_heads=HQ, num_kv_heads=HKV, dtype=DT, cache="kv/fp16", phase="decode",
                    device_type="cuda", device_cc=device_cc(dev), page_size=page_size)
    pages = capacity // page_size
    caches = [(torch.randn(pages, page_size, HKV, HD, device=dev, dtype=DT),
               torch.randn(pages, page_size, HKV, HD, device=dev, dtype=DT)) for _ in range(layers)]
    table = torch.randperm(pages, device=dev).to(torch.int32)[None, :]
    cu = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    q = torch.randn(1, HQ, HD, device=dev, dtype=DT)
    rows = []
    for ctx in contexts:
        lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
        args = [AttnArgs(spec=spec, q=q, cu_seqlens_q=cu, seq_lens_k=lens, max_seqlen_q=1, max_seqlen_k=capacity,
                         scale=HD ** -0.5, k_cache=k, v_cache=v, page_table=table) for k, v in caches]
        kv_bytes = layers * ctx * HKV * HD * 2 * 2
        auto = choose_num_splits(args[0])
        single, split = TritonPagedAttention(), TritonPagedAttention()
        single.decode_num_splits, split.decode_num_splits = 1, auto
        diff = (single.forward(args[0]).float() - split.forward(args[0]).float()).abs().max().item()
        assert diff < 5e-3, f"ctx {ctx}: split-KV x{auto} differs from the single-pass kernel by {diff:.3g}"
        for n in [1, auto, *[s for s in splits if s != auto]]:
            b = TritonPagedAttention()
            b.decode_num_splits = n
            ms = time_graph(lambda b=b, args=args: [b.forward(a) for a in args])
            label = "single-pass (old)" if n == 1 else f"split-KV x{n}" + (" (auto)" if n == auto else "")
            rows.append({"what": f"attention ctx {ctx}", "impl": label, "ms_per_step": ms,
                         "GB/s": kv_bytes / ms / 1e6})
    return rows


def fused_rows(layers: int) -> list[dict]:
    dev = "cuda"
    L = layers
    x = [torch.randn(1, HIDDEN, device=dev, dtype=DT) for _ in range(L)]
    h = [torch.randn(1, HIDDEN, device=dev, dtype=DT) for _ in range(L)]
    w = [1 + 0.1 * torch.randn(HIDDEN, device=dev) for _ in range(L)]
    g = [torch.randn(1, INTER, device=dev, dtype=DT) for _ in range(L)]
    u = [torch.randn(1, INTER, device=dev, dtype=DT) for _ in range(L)]
    qs = [torch.randn(1, HQ, HD, device=dev, dtype=DT) for _ in range(L)]
    ks = [torch.randn(1, HKV, HD, device=dev, dtype=DT) for _ in range(L)]
    f = torch.arange(HD // 2, device=dev).float()[None, :] * 0.01 * 1000
    cos, sin = f.cos(), f.sin()
    cases: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
        ("residual add + RMSNorm x2/layer",
         lambda: [(rms_norm(x[i] + h[i], w[i], 1e-5), rms_norm(h[i] + x[i], w[i], 1e-5)) for i in range(L)],
         lambda: [(ops.rms_norm_residual(h[i], x[i], w[i], 1e-5), ops.rms_norm_residual(x[i], h[i], w[i], 1e-5))
                  for i in range(L)]),
        ("SiLU(gate) * up", lambda: [F.silu(g[i]) * u[i] for i in range(L)],
         lambda: [ops.silu_mul((g[i], u[i])) for i in range(L)]),
        ("RoPE q and k", lambda: [(apply_rotary(qs[i], cos, sin, HD, False), apply_rotary(ks[i], cos, sin, HD, False))
                                  for i in range(L)],
         lambda: [ops.rope_apply(qs[i], ks[i], cos, sin, HD, False) for i in range(L)]),
    ]
    rows = []
    for name, unfused, fused in cases:
        for impl, fn in (("torch (unfused)", unfused), ("Triton (fused)", fused)):
            rows.append({"what": name, "impl": impl, "ms_per_step": time_graph(fn), "GB/s": None})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--capacity", type=int, default=8192, help="cache tokens per sequence (graph max_seqlen_k)")
    ap.add_argument("--contexts", default="256,4096")
    ap.add_argument("--splits", default="8,16,32,64", help="extra split counts to time besides the heuristic")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/fused_decode_gpu.py needs a CUDA device")
    assert ops.fused_enabled(torch.zeros(1, device="cuda")), "Triton not importable: fused ops unavailable"
    torch.manual_seed(0)
    rows = attention_rows(a.layers, a.page_size, a.capacity, [int(c) for c in a.contexts.split(",")],
                          [int(s) for s in a.splits.split(",") if s])
    rows += fused_rows(a.layers)
    print(f"{torch.cuda.get_device_name()}, {a.layers} layers per step, b=1, fp16, 32/8 heads x 128")
    print(f"{'what':34} {'impl':26} {'ms/step':>9} {'us/layer':>9} {'K/V GB/s':>9}")
    for r in rows:
        bw = f"{r['GB/s']:.0f}" if r["GB/s"] else ""
        print(f"{r['what']:34} {r['impl']:26} {r['ms_per_step']:9.4f} {1000 * r['ms_per_step'] / a.layers:9.2f} {bw:>9}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(a), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
