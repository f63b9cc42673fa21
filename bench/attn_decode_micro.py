"""Decode attention alone: per-launch time of the CUDA tensor-core short-bound kernel and the Triton split kernel on one
shape, from a CUDA graph of back-to-back launches (no PDL, nothing else running). Intrinsic latency only:
the decode step overlaps each launch with its neighbours, so compare designs in the step as well (ab_run.py).

    python bench/attn_decode_micro.py --head-dim 64 --q-heads 32 --kv-heads 8 --keys 256 --bound 512 [--batch 1]
"""
from __future__ import annotations

import argparse

import torch
from exl3_kernels import time_graph  # bench/ is the script's directory


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
                                               args.cu_seqlens_q, args.seq_lens_k, args.scale, False, a.bound)

    err = (fn().float() - ref.float()).abs().max().item()
    us = time_graph(lambda i: fn(), 100) * 1e6  # 100 back-to-back launches a graph, median of 7 replays
    print(f"cuda_decode (one block per kv head): {us:6.2f} us per launch (max diff vs triton {err:.2e})")
    us = time_graph(lambda i: tp.decode_split_kv(args, splits), 100) * 1e6
    print(f"triton split ({splits} splits): {us:6.2f} us per launch")


if __name__ == "__main__":
    main()
