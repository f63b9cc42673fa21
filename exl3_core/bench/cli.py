"""``exl3 bench``: engine speed of a random-weight EXL3 model of a given shape, beside its bounds."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_cli(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench", help="decode/prefill speed of a random-weight EXL3 model of a given shape",
        description="Builds a random-weight EXL3 model of --shape on the GPU (no checkpoint needed) and reports "
                    "b=1 decode tok/s at contexts 256 and 4096, b=8/b=32 decode throughput, prefill tok/s, and beside "
                    "them the memory roofline (bytes per token / measured copy bandwidth) and the decode-only "
                    "ceiling of the quantized weights.")
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
    p.add_argument("--draft", default=None, metavar="SHAPE",
                   help="instead of the figures above: speculative decoding of --shape with a draft of this shape at "
                        "controlled acceptance rates (--draft-alphas), each draft length of --draft-k, against the "
                        "ideal speedup (exl3_core/bench/spec.py)")
    p.add_argument("--draft-alphas", default="0.6,0.8,0.9", help="per-token acceptance rates of the bench draft")
    p.add_argument("--draft-k", default="1,2,3,4,5,6,8", help="draft lengths to time")
    p.add_argument("--draft-batch", type=int, default=1, help="sequences decoding at once in the --draft runs")
    p.add_argument("--ngram-bench", action="store_true",
                   help="with --draft (or alone): n-gram drafting on the default model rewriting a paragraph, b=1 "
                        "and b=16, against plain decoding")
    p.set_defaults(func=_bench_cmd)


def _ints(text: str, opt: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{opt} {text!r}: expected comma-separated integers") from None


def _floats(text: str, opt: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{opt} {text!r}: expected comma-separated numbers") from None


def _bench_cmd(args: argparse.Namespace) -> int:
    from exl3_core.bench.models import parse_shape
    from exl3_core.bench.run import run_bench

    shape = parse_shape(args.shape)
    if args.draft is not None or args.ngram_bench:
        from exl3_core.bench.spec import run_ngram_bench, run_spec_bench

        res: dict[str, Any] = {}
        if args.draft is not None:
            res["draft"] = run_spec_bench(
                shape, parse_shape(args.draft), alphas=_floats(args.draft_alphas, "--draft-alphas"),
                ks=_ints(args.draft_k, "--draft-k"), batch=args.draft_batch, ctx=min(_ints(args.contexts, "--contexts")),
                new_tokens=args.new_tokens, bpw=args.bpw, head_bits=args.head_bits or None, codebook=args.codebook,
                device=args.device)
        if args.ngram_bench:
            res["ngram"] = run_ngram_bench(device=args.device, new_tokens=args.new_tokens)
        if args.json is not None:
            args.json.write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
        return 0
    contexts = _ints(args.contexts, "--contexts")
    if not contexts:
        raise ValueError("--contexts needs at least one context length")
    res = run_bench(shape, bpw=args.bpw, head_bits=args.head_bits or None, codebook=args.codebook,
                    device=args.device, contexts=contexts, batches=_ints(args.batches, "--batches"),
                    prefill_tokens=_ints(args.prefill, "--prefill"), prefill_past=args.prefill_past,
                    new_tokens=args.new_tokens, profile=args.profile,
                    vs_transformers=args.vs_transformers, ceiling_lib=args.ceiling_lib)
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
    return 0
