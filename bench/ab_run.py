"""A/B runner for device calls: `exl3 bench` (or any exl3 CLI command) with the decode step's tunables
switched in-process, which have no setting of their own.

    python bench/ab_run.py --merge 0|1 --kt-exceptions 0|1 -- bench --shape 8b ...

--merge: the split-KV decode's merge in the split kernel (1) or a combine kernel (0)
(exl3_attn_backends.triton_paged.MERGE_IN_SPLIT_KERNEL); --kt-exceptions 0: the EXL3 linear's k-chunk
cost model everywhere (exl3_core.ext.KT_EXCEPTIONS not installed); --late-trigger: with the merge,
the split kernel signals its dependent after its partial stores (1) or right after its wait (0);
--merge-tile, --programs-per-sm, --max-splits, --used-only: exl3_attn_backends.triton_paged's MERGE_TILE,
PROGRAMS_PER_SM, MAX_SPLITS and MERGE_USED_SPLITS_ONLY;
--fused-rows N: the one-launch linear (and the deferred norms) up to N rows
(exl3_core.quant.exl3.linear.FUSED_GROUP_MAX_ROWS); --xh-min-rows N: x transformed once per fused
launch from N rows (exl3::set_xh_min_rows). With `--script PATH` the command after `--` runs PATH (a
bench/ script and its arguments) instead of the exl3 CLI. --predecode 0|1|2: the fused linear's
pre-decoding mode (exl3::set_predecode; EXL3_PREDECODE is the setting; -1: the setting's); --pd-max-kt N:
its longest chunk (exl3::set_predecode_max_kt; 0: the ring's length). --preload-bytes N, --split-warps N:
the split-KV kernel's key tile loaded before its wait and its warps (PRELOAD_BYTES, SPLIT_WARPS);
--decode-block-n N, --used-only-b1 0|1: its key chunk and whether one sequence arrives with its used
splits only (DECODE_BLOCK_N, USED_ONLY_AT_B1). --cuda-decode-max-keys N: a cap on the longest bound the
CUDA short-bound decode attention serves (exl3_attn_backends.cuda_decode.MAX_KEYS, per head dim; 0 sends
every call to Triton).
--ablate-attention: TIMING ONLY, the outputs are wrong: every split-KV decode call is replaced by one
minimal dependent kernel (wait, signal, copy q's leading channels to the output), which bounds what a
faster decode attention could save in the step. --ablate-merge: TIMING ONLY, the outputs are wrong: the
split kernel stores every split's partials and nothing merges them (no arrival, no combine launch), which
bounds what a merge moved out of the attention's critical path could save.
"""
from __future__ import annotations

import argparse
import runpy
import sys


def _ablated_attention():  # the minimal stand-in for --ablate-attention (Triton imported only then)
    import torch
    import triton
    import triton.language as tl

    from exl3_core.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_opts

    @triton.jit
    def _copy_q(Q, Out, stride_qt, stride_qh, stride_ot, stride_oh, DV: tl.constexpr, BLOCK: tl.constexpr,
                PDL: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        d = tl.arange(0, BLOCK)
        x = tl.load(Q + t * stride_qt + h * stride_qh + d, mask=d < DV, other=0.0)
        tl.store(Out + t * stride_ot + h * stride_oh + d, x, mask=d < DV)

    def decode(args, num_splits, reload_fresh=None, merge=None, block_n0=None):
        q = args.q
        out = torch.empty((q.shape[0], q.shape[1], args.spec.v_dim), dtype=q.dtype, device=q.device)
        _copy_q[(q.shape[0], q.shape[1])](q, out, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                                          DV=args.spec.v_dim, BLOCK=triton.next_power_of_2(args.spec.v_dim),
                                          **launch_opts(out))
        return out

    return decode


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` launches nothing (--ablate-merge)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--merge", type=int, choices=(0, 1), default=1)
    ap.add_argument("--kt-exceptions", type=int, choices=(0, 1), default=1)
    ap.add_argument("--late-trigger", type=int, choices=(-1, 0, 1), default=-1, help="-1: the module's default")
    ap.add_argument("--programs-per-sm", type=int, default=0, help="split-KV programs per SM (0: default)")
    ap.add_argument("--merge-tile", type=int, default=0, help="fp32 elements of the merge's tile per round (0: default)")
    ap.add_argument("--max-splits", type=int, default=0, help="split-KV splits at most (0: default)")
    ap.add_argument("--used-only", type=int, choices=(0, 1), default=1,
                    help="split kernel with the merge: only the used splits arrive (1) or all (0)")
    ap.add_argument("--fused-rows", type=int, default=0, help="rows up to which the one-launch linear runs (0: default)")
    ap.add_argument("--xh-min-rows", type=int, default=-1,
                    help="rows from which the fused linear transforms x once per launch (0: never; -1: default)")
    ap.add_argument("--predecode", type=int, choices=(-1, 0, 1, 2), default=-1,
                    help="pre-decoding: 0 off, 1 on, 2 on with the early signal (-1: EXL3_PREDECODE)")
    ap.add_argument("--pd-max-kt", type=int, default=-1,
                    help="longest chunk of a pre-decoding launch (0: the ring's length; -1: leave as built)")
    ap.add_argument("--preload-bytes", type=int, default=-1,
                    help="split-KV key tile loaded before the wait, bytes (0: one chunk; -1: default)")
    ap.add_argument("--split-warps", type=int, default=-1, help="split-KV kernel's warps (0: its rule; -1: default)")
    ap.add_argument("--decode-block-n", type=int, default=0, help="split-KV key chunk (0: default)")
    ap.add_argument("--used-only-b1", type=int, choices=(0, 1), default=0,
                    help="split-KV merge: one sequence arrives with its used splits only (1)")
    ap.add_argument("--ablate-attention", action="store_true",
                    help="TIMING ONLY (wrong outputs): a minimal kernel in the split-KV decode's place")
    ap.add_argument("--ablate-merge", action="store_true",
                    help="TIMING ONLY (wrong outputs): split-KV partials stored, never merged")
    ap.add_argument("--cuda-decode-max-keys", type=int, default=-1,
                    help="longest bound the CUDA decode attention serves (-1: default; 0: never, Triton serves all)")
    ap.add_argument("--script", default=None, help="run this script with the arguments after -- (not the CLI)")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    import exl3_attn_backends.triton_paged as tp

    from exl3_core import ext

    if a.fused_rows:
        from exl3_core.quant.exl3 import linear

        linear.FUSED_GROUP_MAX_ROWS = a.fused_rows
    tp.MERGE_IN_SPLIT_KERNEL = bool(a.merge)
    if a.late_trigger >= 0:
        tp.LATE_TRIGGER_WHEN_MERGED = bool(a.late_trigger)
    if a.programs_per_sm:
        tp.PROGRAMS_PER_SM = a.programs_per_sm
    if a.max_splits:
        tp.MAX_SPLITS = a.max_splits
    tp.MERGE_USED_SPLITS_ONLY = bool(a.used_only)
    if a.preload_bytes >= 0:
        tp.PRELOAD_BYTES = a.preload_bytes
    if a.split_warps >= 0:
        tp.SPLIT_WARPS = a.split_warps
    if a.decode_block_n:
        tp.DECODE_BLOCK_N = a.decode_block_n
    tp.USED_ONLY_AT_B1 = bool(a.used_only_b1)
    if a.ablate_attention:
        tp.decode_split_kv = _ablated_attention()
    if a.ablate_merge:
        tp.MERGE_IN_SPLIT_KERNEL = False
        tp._decode_combine = _NoLaunch()
    if a.merge_tile:
        tp.MERGE_TILE = a.merge_tile
    import exl3_attn_backends.cuda_decode as cd

    if a.cuda_decode_max_keys >= 0:
        cd.MAX_KEYS = {d: min(k, a.cuda_decode_max_keys) for d, k in cd.MAX_KEYS.items()}
    if not ext.load():
        sys.exit("exl3_core._C did not load")
    ext.set_kt_exceptions(ext.KT_EXCEPTIONS if a.kt_exceptions else ())
    import torch

    if a.predecode >= 0 and hasattr(torch.ops.exl3, "set_predecode"):
        torch.ops.exl3.set_predecode(a.predecode)
    if a.pd_max_kt >= 0 and hasattr(torch.ops.exl3, "set_predecode_max_kt"):
        torch.ops.exl3.set_predecode_max_kt(a.pd_max_kt)
    if a.xh_min_rows >= 0:
        torch.ops.exl3.set_xh_min_rows(a.xh_min_rows)
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    print(f"# ab_run: merge={a.merge} late_trigger={a.late_trigger} merge_tile={a.merge_tile} "
          f"programs_per_sm={a.programs_per_sm} max_splits={a.max_splits} used_only={a.used_only} "
          f"kt_exceptions={a.kt_exceptions} predecode={a.predecode} pd_max_kt={a.pd_max_kt} fused_rows={a.fused_rows} xh_min_rows={a.xh_min_rows} "
          f"preload_bytes={a.preload_bytes} split_warps={a.split_warps} ablate_attention={a.ablate_attention} "
          f"ablate_merge={a.ablate_merge} "
          f"cuda_decode_max_keys={a.cuda_decode_max_keys} "
          f"decode_block_n={a.decode_block_n} used_only_b1={a.used_only_b1}: "
          f"{a.script or 'exl3'} {' '.join(rest)}", flush=True)
    if a.script:
        sys.argv = [a.script, *rest]
        runpy.run_path(a.script, run_name="__main__")
    else:
        sys.argv = ["exl3", *rest]
        runpy.run_module("exl3_core", run_name="__main__")


if __name__ == "__main__":
    main()
