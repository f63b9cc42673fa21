"""A/B runner for the decode step: any exl3 CLI command (usually ``exl3 bench``) or bench/ script, with the
step's in-process tunables switched first. These have no user setting; flip one, run, flip back, and compare
in one device call (the card's clock moves between calls).

    python bench/ab_run.py --predecode 0 -- bench --shape 1b --codebook mul1 --contexts 256 --batches , --prefill 0
    python bench/ab_run.py --script bench/profile_gpu.py -- decode --shape 1b --tokens 256

--programs-per-sm N, --max-splits N, --merge-tile N: the split-KV decode attention's heuristic
(exl3_attn_backends.triton_paged's PROGRAMS_PER_SM, MAX_SPLITS, MERGE_TILE). --cuda-decode-max-keys N: a cap
on the longest bound the CUDA short-bound decode attention serves (exl3_attn_backends.cuda_decode.MAX_KEYS,
per head dim; 0 sends every call to Triton). --fused-rows N: the one-launch linear and the deferred norms up
to N rows (exl3_core.quant.exl3.linear.FUSED_GROUP_MAX_ROWS). --xh-min-rows N: x transformed once per fused
launch from N rows (exl3::set_xh_min_rows). --predecode 0|1|2: the fused linear's pre-decoding mode
(exl3::set_predecode; -1 leaves EXL3_PREDECODE's); --pd-max-kt N: its longest chunk
(exl3::set_predecode_max_kt; 0: the ring's length).
--ablate-attention: TIMING ONLY, the outputs are wrong: every split-KV decode call is replaced by one minimal
dependent kernel (wait, signal, copy q's leading channels to the output), which bounds what a faster decode
attention could save in the step.
"""
from __future__ import annotations

import argparse
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _ablated_attention() -> Callable[..., Any]:  # the stand-in for --ablate-attention (Triton imported only then)
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

    def decode(args: Any, num_splits: int, reload_fresh: bool | None = None) -> torch.Tensor:
        q = args.q
        out = torch.empty((q.shape[0], q.shape[1], args.spec.v_dim), dtype=q.dtype, device=q.device)
        _copy_q[(q.shape[0], q.shape[1])](q, out, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                                          DV=args.spec.v_dim, BLOCK=triton.next_power_of_2(args.spec.v_dim),
                                          **launch_opts(out))
        return out

    return decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs-per-sm", type=int, default=0, help="split-KV programs per SM (0: default)")
    ap.add_argument("--max-splits", type=int, default=0, help="split-KV splits at most (0: default)")
    ap.add_argument("--merge-tile", type=int, default=0, help="fp32 elements of the merge's tile per round (0: default)")
    ap.add_argument("--cuda-decode-max-keys", type=int, default=-1,
                    help="longest bound the CUDA decode attention serves (-1: default; 0: never, Triton serves all)")
    ap.add_argument("--fused-rows", type=int, default=0, help="rows up to which the one-launch linear runs (0: default)")
    ap.add_argument("--xh-min-rows", type=int, default=-1,
                    help="rows from which the fused linear transforms x once per launch (0: never; -1: default)")
    ap.add_argument("--predecode", type=int, choices=(-1, 0, 1, 2), default=-1,
                    help="pre-decoding: 0 off, 1 on, 2 on with the early signal (-1: EXL3_PREDECODE)")
    ap.add_argument("--pd-max-kt", type=int, default=-1,
                    help="longest chunk of a pre-decoding launch (0: the ring's length; -1: leave as built)")
    ap.add_argument("--ablate-attention", action="store_true",
                    help="TIMING ONLY (wrong outputs): a minimal kernel in the split-KV decode's place")
    ap.add_argument("--script", default=None, help="run this script with the arguments after -- (not the CLI)")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    import exl3_attn_backends.cuda_decode as cd
    import exl3_attn_backends.triton_paged as tp
    import torch

    from exl3_core import ext

    if a.fused_rows:
        from exl3_core.quant.exl3 import linear

        linear.FUSED_GROUP_MAX_ROWS = a.fused_rows
    if a.programs_per_sm:
        tp.PROGRAMS_PER_SM = a.programs_per_sm
    if a.max_splits:
        tp.MAX_SPLITS = a.max_splits
    if a.merge_tile:
        tp.MERGE_TILE = a.merge_tile
    if a.ablate_attention:
        tp.decode_split_kv = _ablated_attention()
    if a.cuda_decode_max_keys >= 0:
        cd.MAX_KEYS = {d: min(k, a.cuda_decode_max_keys) for d, k in cd.MAX_KEYS.items()}
    if not ext.load():
        sys.exit(f"exl3_core._C did not load: {ext.load_error}")
    if a.predecode >= 0:
        torch.ops.exl3.set_predecode(a.predecode)
    if a.pd_max_kt >= 0:
        torch.ops.exl3.set_predecode_max_kt(a.pd_max_kt)
    if a.xh_min_rows >= 0:
        torch.ops.exl3.set_xh_min_rows(a.xh_min_rows)
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    switches = {k: v for k, v in vars(a).items() if k not in ("rest", "script")}
    print(f"# ab_run: {' '.join(f'{k}={v}' for k, v in switches.items())}: {a.script or 'exl3'} {' '.join(rest)}",
          flush=True)
    if a.script:
        sys.argv = [a.script, *rest]
        sys.path.insert(0, str(Path(a.script).resolve().parent))  # its sibling imports, as when run directly
        runpy.run_path(a.script, run_name="__main__")
    else:
        sys.argv = ["exl3", *rest]
        runpy.run_module("exl3_core", run_name="__main__")


if __name__ == "__main__":
    main()
