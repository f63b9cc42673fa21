"""Decode attention alone: per-launch time of each decode kernel on one shape, from a CUDA graph of back-to-back
launches (no PDL, nothing else running), cycling over ``--layers`` independent caches so that a quantized cache's
pages exceed the L2 as a model's layers do. Intrinsic latency only: the decode step overlaps each launch with its
neighbours, so compare designs in the step as well (ab_run.py, ``exl3 bench``).

fp16 cache: the CUDA tensor-core short-bound kernel against the Triton split kernel. ``--cache-bits K,V``: the
quantized view read by the Triton split kernel and, for 4/8-bit widths, the CUDA split kernel (cuda_qsplit), with
the bytes each launch reads per microsecond.

    python bench/attn_decode_micro.py --head-dim 64 --q-heads 32 --kv-heads 8 --keys 256 --bound 512 [--batch 1]
    python bench/attn_decode_micro.py --head-dim 128 --keys 32768 --bound 32768 --cache-bits 4,4 --layers 4
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
    ap.add_argument("--cache-bits", default=None, help="K,V: a quantized cache of these widths (default: fp16)")
    ap.add_argument("--layers", type=int, default=1, help="independent caches the launches cycle over")
    ap.add_argument("--splits", default="", help="comma-separated split counts to time beside the chosen one")
    a = ap.parse_args()
    import exl3_attn_backends.triton_paged as tp

    from exl3_core import ext
    from exl3_core.attention import AttnSpec
    from exl3_core.attention.spec import device_cc
    from exl3_core.testing.attention import Case, make_args

    bits = tuple(int(b) for b in a.cache_bits.split(",")) if a.cache_bits else None
    if bits is not None and len(bits) == 1:
        bits = (bits[0], bits[0])
    spec = AttnSpec(head_dim=a.head_dim, num_q_heads=a.q_heads, num_kv_heads=a.kv_heads, dtype=torch.float16,
                    cache="kv/fp16" if bits is None else "kv/quant", phase="decode", page_size=a.page_size,
                    device_type="cuda", device_cc=device_cc(torch.device("cuda")))
    case = Case(spec, (1,) * a.batch, (a.keys - 1,) * a.batch, bits or (4, 4))
    layers = [make_args(case, "cuda", seed=i)._replace(max_seqlen_k=a.bound) for i in range(a.layers)]
    args = layers[0]
    splits = tp.choose_num_splits(args)
    ref = tp.decode_split_kv(args, splits)
    # bytes one sequence's keys occupy (code words and scales of a quantized cache)
    pages = (args.k_cache, args.v_cache)
    if bits is not None:
        assert args.quant is not None and args.quant.v_scales is not None
        pages += (args.quant.k_scales, args.quant.v_scales)
    per_call = a.keys * sum(t[0, 0].numel() * t.element_size() for t in pages)
    print(f"# d={a.head_dim} heads {a.q_heads}/{a.kv_heads} keys {a.keys} bound {a.bound} batch {a.batch} "
          f"cache {'fp16' if bits is None else f'k{bits[0]}v{bits[1]}'} layers {a.layers}")

    def report(name: str, fn) -> None:
        err = (fn(0).float() - ref.float()).abs().max().item()
        us = time_graph(fn, 100) * 1e6  # 100 back-to-back launches a graph, median of 7 replays
        rate = f", {per_call * a.batch / us / 1e6:.2f} TB/s of pages" if per_call else ""
        print(f"{name}: {us:7.2f} us per launch (max diff vs triton {err:.2e}){rate}")

    report(f"triton split ({splits} splits)", lambda i: tp.decode_split_kv(layers[i % a.layers], splits))
    if bits is None:
        if not ext.has_op("decode_attention"):
            raise SystemExit(f"exl3_core._C lacks decode_attention (load errors: {ext.load_error})")

        def short(i: int) -> torch.Tensor:
            x = layers[i % a.layers]
            return torch.ops.exl3.decode_attention(x.q, x.k_cache, x.v_cache, x.page_table, x.cu_seqlens_q,
                                                   x.seq_lens_k, x.scale, False, a.bound)

        report("cuda_decode (one block per kv head)", short)
        return
    if bits[0] in (4, 8) and bits[1] in (4, 8) and ext.has_op("decode_attention_qsplit"):
        from exl3_attn_backends.cuda_qsplit import choose_splits, decode_attention_qsplit

        def qsplit(i: int, n: int | None) -> torch.Tensor:
            x = layers[i % a.layers]
            assert x.quant is not None
            return decode_attention_qsplit(x.q, x.k_cache, x.v_cache, x.quant, x.page_table, x.cu_seqlens_q,
                                           x.seq_lens_k, x.scale, a.bound, splits=n)

        chosen = choose_splits(a.batch, a.kv_heads, a.bound, torch.cuda.get_device_properties(0).multi_processor_count)
        report(f"cuda_qsplit ({chosen} splits, chosen)", lambda i: qsplit(i, None))
        for n in (int(s) for s in a.splits.split(",") if s):
            report(f"cuda_qsplit ({n} splits)", lambda i, n=n: qsplit(i, n))
    for n in (int(s) for s in a.splits.split(",") if s):
        report(f"triton split ({n} splits)", lambda i, n=n: tp.decode_split_kv(layers[i % a.layers], n))


if __name__ == "__main__":
    main()
