"""``exl3 inspect``: what the engine will do with a model on a device, and why.

Prints the execution plan's decisions per block (each fusion taken or declined, with its reasons), how
each cache layer type is written and read, and the attention backend (and its route) the dispatcher
picks for the static shapes a generator's steps have. Nothing is generated.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from exl3_core.cache_bits import add_cache_bits_arg, cache_variants


def add_cli(sub: Any) -> None:
    p = sub.add_parser("inspect", help="show the execution plan and attention choices for a model on a device",
                       description=__doc__.split("\n\n")[0] if __doc__ else None,
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-m", "--model", type=Path, default=None,
                   help="model folder (HF-style, unquantized or EXL3); default: the embedded default model")
    p.add_argument("--shape", default=None,
                   help="instead of a folder, a random EXL3 model of a bench shape (e.g. 8B, 1B; see exl3 bench)")
    p.add_argument("--device", default=None, help="torch device (default: cuda:0 if available, else cpu)")
    p.add_argument("--cache-tokens", type=int, default=4096, help="cache size the shapes are planned for")
    p.add_argument("--variant", default="fp16",
                   help="cache layer variant, by its registered name (a plugin's too); for the quantized cache "
                        "--cache-bits is the short form")
    add_cache_bits_arg(p)
    p.add_argument("--max-batch", type=int, default=32, help="largest decode batch to show backends for")
    p.add_argument("--plan", action="store_true", default=True, help="show the plan (always on; kept for clarity)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_inspect_cmd)


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    import torch

    from exl3_core.cache import Cache

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device {device}: this torch has no CUDA device; use --device cpu")
    if args.shape:
        from exl3_core.bench.models import build_model, parse_shape

        model, cache = build_model(parse_shape(args.shape), device=device, cache_tokens=args.cache_tokens,
                                   cache_kwargs=_cache_kwargs(args))
        return model, cache
    from exl3_core.archkit import Config, Model

    model_dir = args.model
    if model_dir is None:
        from exl3_core.convert.default_model import default_model_dir

        model_dir = default_model_dir(progress=True)
    model = Model.from_config(Config.from_directory(model_dir))
    cache = Cache(model, max_num_tokens=args.cache_tokens, **_cache_kwargs(args))
    model.load(device=device, caches=[cache])
    return model, cache


def _cache_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The cache's variant and options from ``--variant`` and ``--cache-bits`` (which names variant 'quant')."""
    bits = cache_variants(args)[0]
    if not bits.quantized:
        return {"variant": args.variant}
    if args.variant not in ("fp16", "quant"):
        raise ValueError(f"--variant {args.variant} and --cache-bits {bits.k_bits},{bits.v_bits}"
                         f": --cache-bits chooses the quantized variant; give one of the two")
    return bits.cache_kwargs()


def inspect_model(model: Any, cache: Any, max_batch: int = 32) -> dict[str, Any]:
    """The plan report, cache report and attention choices as plain data."""
    from exl3_core.attention.spec import CallShape, pow2_bucket
    from exl3_core.plan import ExecutionPlan, decode_shapes

    plan = ExecutionPlan(model)
    bound = cache.max_num_tokens
    fresh = [CallShape("prefill", pow2_bucket(2048), 1, 0)]  # a fresh prompt attends to its own rows
    paged = [CallShape("prefill", pow2_bucket(bound), 1, 0), *decode_shapes(bound, max_batch)]
    return {
        "device": str(plan.device),
        "tuning": plan.tuning.name,
        "plan": [{"part": r.part, "kind": r.kind,
                  "decisions": [{"name": d.name, "taken": d.taken, "why": list(d.why)} for d in r.decisions]}
                 for r in plan.report()],
        "cache": plan.cache_report(cache),
        "attention": plan.attention_choices(None, fresh) + plan.attention_choices(cache, paged),
    }


def _inspect_cmd(args: argparse.Namespace) -> int:
    from exl3_core.plan.report import Decision, PartReport, compact_report, merge_layer_runs

    model, cache = _load(args)
    data = inspect_model(model, cache, args.max_batch)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"device {data['device']}, tuning {data['tuning']}")
    parts = [PartReport(part["part"], part["kind"],
                        [Decision(d["name"], d["taken"], tuple(d["why"])) for d in part["decisions"]])
             for part in data["plan"]]
    print("\n".join(compact_report(parts)))
    print("cache layers")
    for line in data["cache"]:
        print(f"    {line}")
    print("attention (per layer and static call shape)")
    for line in merge_layer_runs(data["attention"]):
        print(f"    {line}")
    return 0
