"""``exl3 bench``: engine speed of a random-weight EXL3 model of a given shape, beside its bounds."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from exl3_core.cache_bits import CacheBits, add_cache_bits_arg


def add_cli(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench", help="decode/prefill speed of a random-weight EXL3 model of a given shape",
        description="Builds a random-weight EXL3 model of --shape on the GPU (no checkpoint needed) and reports "
                    "b=1 decode tok/s at contexts 256 and 4096, b=8/b=32 decode throughput, prefill tok/s, and beside "
                    "them the memory roofline (bytes per token / measured copy bandwidth) and the decode-only "
                    "ceiling of the quantized weights. With --cache-bits (repeatable) the decode and prefill figures "
                    "are measured over each KV cache in turn, with their ratios to the first.")
    p.add_argument("--shape", default="1b",
                   help="a named shape (see exl3_core/data/bench_shapes.json: 1b, 8b and aliases) or "
                        "custom(hidden,intermediate,layers,heads,kv_heads,vocab[,head_dim])")
    p.add_argument("--bpw", type=float, default=4.0, help="bits per weight of the decoder layers (1-8)")
    p.add_argument("--head-bits", type=int, default=6, help="bits per weight of the output head (0 = dense fp16)")
    p.add_argument("--codebook", default="mcg", choices=["3inst", "mcg", "mul1"])
    p.add_argument("--device", default=None, help="torch device (default cuda when present)")
    p.add_argument("--contexts", default="256,4096", help="b=1 decode contexts, comma-separated")
    p.add_argument("--batches", default="8,32", help="decode batch sizes at the smallest context")
    p.add_argument("--prefill", default="2048",
                   help="prefill lengths, comma-separated (0 or empty = skip); the longest is the headline figure")
    p.add_argument("--prefill-past", type=int, default=0,
                   help="also time each prefill length as a chunk after this many cached tokens (a prefix-cache hit)")
    p.add_argument("--new-tokens", type=int, default=128, help="decode tokens timed per run")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table of eager b=1 decode steps")
    p.add_argument("--vs-transformers", action="store_true", help="also time the shape in bf16 through transformers")
    p.add_argument("--ceiling-lib", type=Path, default=None, metavar="SO",
                   help="the bench extension with the decode-only ceiling kernel (python bench/ext/build.py writes "
                        "bench/ext/build/exl3_bench.so, the default in a source checkout); without it the ceiling "
                        "is left out")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write every figure to this JSON file")
    add_cache_bits_arg(p, repeat=True)
    p.add_argument("--cache-memory", type=float, default=None, metavar="GIB",
                   help="cache memory of the capacity report (the 4096-token sequences it holds at once, per "
                        "--cache-bits); default: the device's memory less the weights (16 GiB on the CPU)")
    p.set_defaults(func=_bench_cmd)


def _ints(text: str, opt: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{opt} {text!r}: expected comma-separated integers") from None


def _bench_cmd(args: argparse.Namespace) -> int:
    from exl3_core.bench.models import parse_shape
    from exl3_core.bench.run import run_bench

    shape = parse_shape(args.shape)
    contexts = _ints(args.contexts, "--contexts")
    if not contexts:
        raise ValueError("--contexts needs at least one context length")
    if args.cache_memory is not None and args.cache_memory <= 0:
        raise ValueError(f"--cache-memory {args.cache_memory}: give a positive size in GiB")
    res = run_bench(shape, bpw=args.bpw, head_bits=args.head_bits or None, codebook=args.codebook,
                    device=args.device, contexts=contexts, batches=_ints(args.batches, "--batches"),
                    prefill_tokens=_ints(args.prefill, "--prefill"), prefill_past=args.prefill_past,
                    new_tokens=args.new_tokens, profile=args.profile,
                    vs_transformers=args.vs_transformers, ceiling_lib=args.ceiling_lib,
                    cache_bits=tuple(args.cache_bits or (CacheBits(),)),
                    cache_memory=None if args.cache_memory is None else int(args.cache_memory * 2**30))
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
    return 0
