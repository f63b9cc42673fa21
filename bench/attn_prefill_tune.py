"""Launch shapes of the Triton prefill attention (`_attn_fwd`) on the GPU: TFLOP/s per config.

    PYTHONPATH=.:plugins/attn_backends/src python bench/attn_prefill_tune.py [--tokens 2048]

The 8B shape's attention (32 query / 8 KV heads x 128, fp16, causal, paged cache of 256-token
pages, no cached prefix): one call per layer of a prefill. Each config is checked against the
torch reference first (a wrong config is reported, not timed). FLOPs counted: 4 * heads * d *
(causal pairs) — the two matmuls, no recomputation. CUDA events, warm-up, median of 20.
"""
from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from exl3_core.attention.spec import AttnSpec
from exl3_core.testing.attention import Case, device_cc, make_args, reference_attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    ap.add_argument("--rows", type=int, default=1, help="sequences per call (no cache: the conversion's shape)")
    ap.add_argument("--split-only", action="store_true",
                    help="only compare the built-in launch with the unmasked-chunk loop forced on and off")
    ap.add_argument("--dense", action="store_true",
                    help="only compare the built-in Triton launch with the dense SDPA path (dense.py)")
    a = ap.parse_args()
    import exl3_attn_backends.triton_paged as tp

    dev = torch.device("cuda")
    dtype = getattr(torch, a.dtype)
    paged = dict(cache="kv/fp16", page_size=256) if dtype == torch.float16 else {}
    spec = AttnSpec(head_dim=a.head_dim, num_q_heads=a.heads, num_kv_heads=a.kv_heads, dtype=dtype,
                    device_type="cuda", device_cc=device_cc(dev), **paged)
    args = make_args(Case(spec, (a.tokens,) * a.rows, (0,) * a.rows if paged else ()), dev, seed=0)
    ref = reference_attention(args).float()
    pairs = a.rows * a.tokens * (a.tokens + 1) / 2
    flops = 4 * a.heads * a.head_dim * pairs
    configs: list[dict[str, int]] = [{}] + [dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
                                            for m, n, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))]
    if a.split_only:
        configs = [{"split": 0}, {"split": 1}]
    if a.dense:
        from exl3_attn_backends.dense import dense_causal

        configs = [{}, {"dense": 1}]

    def attend(cfg: dict[str, int]) -> torch.Tensor:
        return dense_causal(args) if cfg.get("dense") else tp.attention_single_pass(args)

    rows = []
    for cfg in configs:
        tp.PREFILL_TUNING.clear()
        tp.PREFILL_TUNING.update({k: v for k, v in cfg.items() if k != "dense"})
        try:
            out = attend(cfg)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err < (2e-3 if dtype == torch.float16 else 1e-5):
                rows.append((cfg, None, f"WRONG rel.err {err:.2e}"))
                continue
            for _ in range(3):
                attend(cfg)
            torch.cuda.synchronize()
            ts = []
            for _ in range(20):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                attend(cfg)
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1) / 1e3)
            t = statistics.median(ts)
            rows.append((cfg, t, f"{flops / t / 1e12:6.1f} TFLOP/s  rel.err {err:.1e}"))
        except Exception as e:  # noqa: BLE001 - an infeasible config (smem, registers) is reported, not fatal
            rows.append((cfg, None, f"failed: {type(e).__name__}: {str(e)[:80]}"))
    tp.PREFILL_TUNING.clear()
    rows.sort(key=lambda r: r[1] if r[1] is not None else 1e9)
    print(f"prefill attention {a.rows} x {a.tokens} tokens, {a.heads}/{a.kv_heads} heads x {a.head_dim}, {a.dtype}, "
          f"causal, {'paged' if paged else 'no cache'}:")
    for cfg, t, msg in rows:
        name = "built-in" if not cfg else " ".join(f"{k}={v}" for k, v in cfg.items())
        print(f"  {name:<52} {'' if t is None else f'{t * 1e6:8.1f} us'}  {msg}")


if __name__ == "__main__":
    main()
