"""A/B runner for the decode step: any exl3 CLI command (usually ``exl3 bench``) or bench/ script, with the
engine's tuning or the attention backends' in-process tunables switched first. These have no user setting;
flip one, run, flip back, and compare in one device call (the card's clock moves between calls).

    python bench/ab_run.py --predecode 0 -- bench --shape 1b --codebook mul1 --contexts 256 --batches , --prefill 0
    python bench/ab_run.py --tune fusion.deferred_norm=off -- bench --shape 1b --contexts 256 --batches , --prefill 0
    python bench/ab_run.py --script bench/profile_gpu.py -- decode --shape 1b --tokens 256

The engine's choices are a :class:`~exl3_core.tuning.Tuning`: the run's commands build their execution plans
without one of their own (``Generator(model, ...)``, ``ExecutionPlan(model)``), so they take
``Tuning.for_device``'s, and this runner makes that the device's default with the changes asked for (built with
``dataclasses.replace``; the compiled ops then get the kernel fields as their per-call ``launch`` argument).
--tune PART.FIELD=VALUE (repeatable): any field of the tuning's ``fusion``, ``kernels`` or ``graphs`` part
(booleans: on/off, 1/0, true/false; tuples: comma-separated). Shorthands: --fused-rows N (kernels.
fused_linear_max_rows: the one-launch linear and the deferred norms up to N rows; models wider than
kernels.fused_linear_wide_width stop at kernels.fused_linear_wide_max_rows), --xh-min-rows N
(kernels.xh_min_rows: x transformed once per fused launch from N rows), --predecode 0|1|2
(kernels.predecode: the fused linear's pre-decoding mode), --pd-max-kt N (kernels.predecode_max_kt: its
longest chunk; 0: the ring's length), --pdl 0|1 (kernels.pdl: programmatic dependent launch).

--programs-per-sm N, --max-splits N, --merge-tile N: the split-KV decode attention's heuristic
(exl3_attn_backends.triton_paged's PROGRAMS_PER_SM, MAX_SPLITS, MERGE_TILE). --cuda-decode-max-keys N: a cap
on the longest bound the CUDA short-bound decode attention serves (exl3_attn_backends.cuda_decode.MAX_KEYS,
per head dim; 0: it declines every spec, Triton serves all). These are the plugin's module constants, outside
the engine's tuning.
--ablate-attention: TIMING ONLY, the outputs are wrong: every split-KV decode call is replaced by one minimal
dependent kernel (wait, signal, copy q's leading channels to the output), which bounds what a faster decode
attention could save in the step.
"""
from __future__ import annotations

import argparse
import dataclasses
import runpy
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from exl3_core.tuning import Tuning

#: the tuning's parts that --tune may change
TUNING_PARTS = ("fusion", "kernels", "graphs")
_TRUE, _FALSE = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def _parse_value(key: str, raw: str, current: object) -> object:
    """``raw`` as the type of the field's current value (bool, int, float or a tuple of ints)."""
    try:
        if isinstance(current, bool):
            if raw.lower() not in _TRUE + _FALSE:
                raise ValueError(f"expected one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}")
            return raw.lower() in _TRUE
        if isinstance(current, int):
            return int(raw)
        if isinstance(current, float):
            return float(raw)
        if isinstance(current, tuple):
            return tuple(int(v) for v in raw.split(",") if v.strip())
    except ValueError as e:
        raise SystemExit(f"--tune {key}={raw}: {e}") from None
    raise SystemExit(f"--tune {key}: a {type(current).__name__} field cannot be set from the command line")


def tuning_variant(base: Tuning, changes: Mapping[str, str]) -> Tuning:
    """``base`` with ``changes`` (``"part.field" -> value as text``) applied through ``dataclasses.replace``."""
    parts: dict[str, dict[str, object]] = {}
    for key, raw in changes.items():
        part, _, name = key.partition(".")
        if part not in TUNING_PARTS:
            raise SystemExit(f"--tune {key}: expected PART.FIELD with PART one of {', '.join(TUNING_PARTS)}")
        sub = getattr(base, part)
        names = [f.name for f in dataclasses.fields(sub)]
        if name not in names:
            raise SystemExit(f"--tune {key}: {type(sub).__name__} has no field {name!r}; its fields: {', '.join(names)}")
        parts.setdefault(part, {})[name] = _parse_value(key, raw, getattr(sub, name))
    try:
        return dataclasses.replace(base, **{p: dataclasses.replace(getattr(base, p), **kw) for p, kw in parts.items()})
    except ValueError as e:  # the tuning's own checks (e.g. KernelTuning.predecode)
        raise SystemExit(f"--tune: {e}") from None


def install_default_tuning(changes: Mapping[str, str]) -> None:
    """Every plan built without a tuning of its own takes :meth:`Tuning.for_device`'s: make that the device's
    default with ``changes``, so that the command run here needs no option of its own."""
    device_default = Tuning.for_device

    def for_device(cls: type[Tuning], device: Any) -> Tuning:
        return tuning_variant(device_default(device), changes)

    Tuning.for_device = classmethod(for_device)  # type: ignore[method-assign, assignment]


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
    ap.add_argument("--tune", action="append", default=[], metavar="PART.FIELD=VALUE",
                    help="a field of the engine's tuning (fusion, kernels, graphs), e.g. fusion.deferred_norm=off")
    ap.add_argument("--fused-rows", type=int, default=0,
                    help="kernels.fused_linear_max_rows: rows up to which the one-launch linear runs (0: default; "
                         "models wider than kernels.fused_linear_wide_width stop at kernels.fused_linear_wide_max_rows)")
    ap.add_argument("--xh-min-rows", type=int, default=-1,
                    help="kernels.xh_min_rows: rows from which the fused linear transforms x once per launch "
                         "(0: never; -1: default)")
    ap.add_argument("--predecode", type=int, choices=(-1, 0, 1, 2), default=-1,
                    help="kernels.predecode: 0 off, 1 on, 2 on with the early signal (-1: the device's default)")
    ap.add_argument("--pd-max-kt", type=int, default=-1,
                    help="kernels.predecode_max_kt: longest chunk of a pre-decoding launch (0: the ring's length; "
                         "-1: default)")
    ap.add_argument("--pdl", type=int, choices=(-1, 0, 1), default=-1,
                    help="kernels.pdl: programmatic dependent launch off or on (-1: the device's default)")
    ap.add_argument("--ablate-attention", action="store_true",
                    help="TIMING ONLY (wrong outputs): a minimal kernel in the split-KV decode's place")
    ap.add_argument("--script", default=None, help="run this script with the arguments after -- (not the CLI)")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    import exl3_attn_backends.cuda_decode as cd
    import exl3_attn_backends.triton_paged as tp

    from exl3_core import ext

    changes: dict[str, str] = {}
    for item in a.tune:
        key, eq, raw = item.partition("=")
        if not eq:
            raise SystemExit(f"--tune {item}: expected PART.FIELD=VALUE")
        changes[key.strip()] = raw.strip()
    for flag, key in (("fused_rows", "kernels.fused_linear_max_rows"), ("xh_min_rows", "kernels.xh_min_rows"),
                      ("predecode", "kernels.predecode"), ("pd_max_kt", "kernels.predecode_max_kt"),
                      ("pdl", "kernels.pdl")):
        value = getattr(a, flag)
        if value > 0 or (value == 0 and flag != "fused_rows"):
            if key in changes and changes[key] != str(value):
                raise SystemExit(f"--{flag.replace('_', '-')} {value} and --tune {key}={changes[key]} disagree")
            changes[key] = str(value)
    if changes:
        variant = tuning_variant(Tuning.h200(), changes)  # bad names and values fail here, before any work
        print("# ab_run tuning: " + "; ".join(variant.describe()), flush=True)
        install_default_tuning(changes)
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
