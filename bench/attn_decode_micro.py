"""Decode attention alone: per-launch time of the CUDA tensor-core short-bound kernel and the Triton split kernel on one
shape, from a CUDA graph of back-to-back launches (no PDL, nothing else running). Intrinsic latency only:
the decode step overlaps each launch with its neighbours (docs/performance.md, run 24).

    python bench/attn_decode_micro.py --head-dim 64 --q-heads 32 --kv-heads 8 --keys 256 --bound 512 [--batch 1]
"""
from __future__ import annotations

import argparse
import statistics

import torch


def _graph_time(fn, launches: int = 100, rounds: int = 7) -> float:
    """Median us per launch over ``rounds`` replays of a graph of ``launches`` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / launches)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--keys", type=int, default=256)
    ap.add_argument("--bound", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=256)
    a = ap.parse_args()
    import exl3_attn_backends.triton_paged as tp

    from exl3_core import ext
    from exl3_core.attention import AttnSpec
    from exl3_core.attention.spec import device_cc
    from exl3_core.testing.attention import Case, make_args

    if not ext.has_op("decode_attention"):
        raise SystemExit(f"exl3_core._C lacks decode_attention (load errors: {ext.load_error})")
    spec = AttnSpec(head_dim=a.head_dim, num_q_heads=a.q_heads, num_kv_heads=a.kv_heads, dtype=torch.float16,
                    cache="kv/fp16", phase="decode", page_size=a.page_size, device_type="cuda",
                    device_cc=device_cc(torch.device("cuda")))
    args = make_args(Case(spec, (1,) * a.batch, (a.keys - 1,) * a.batch), "cuda", seed=0)
    args = args._replace(max_seqlen_k=a.bound)
    splits = tp.choose_num_splits(args)
    ref = tp.decode_split_kv(args, splits)
    print(f"# d={a.head_dim} heads {a.q_heads}/{a.kv_heads} keys {a.keys} bound {a.bound} batch {a.batch}")
    def fn() -> torch.Tensor:
        return torch.ops.exl3.decode_attention(args.q, args.k_cache, args.v_cache, args.page_table,
                                               args.cu_seqlens_q, args.seq_lens_k, args.scale, False)

    err = (fn().float() - ref.float()).abs().max().item()
    print(f"cuda_decode (one block per kv head): {_graph_time(fn):6.2f} us per launch (max diff vs triton {err:.2e})")
    print(f"triton split ({splits} splits): {_graph_time(lambda: tp.decode_split_kv(args, splits)):6.2f} us per launch")


if __name__ == "__main__":
    main()
