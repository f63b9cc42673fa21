"""``exl3 bench``: engine speed of a random-weight EXL3 model of a given shape, beside its bounds."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from exl3_core.cache_bits import add_cache_bits_arg, cache_variants
from exl3_core.cli import UsageError, bounded_float, nonneg_int, positive_float, positive_int, resolve_device
from exl3_core.parallel.cli import add_parallel_args, parallel_load_kwargs


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
    p.add_argument("--bpw", type=bounded_float(1.0, 8.0), default=4.0, help="bits per weight of the decoder layers "
                                                                           "(1-8)")
    p.add_argument("--head-bits", type=nonneg_int, default=6, help="bits per weight of the output head (0 = dense "
                                                                   "fp16)")
    p.add_argument("--codebook", default="mcg", choices=["3inst", "mcg", "mul1"], help="trellis codebook")
    p.add_argument("--device", default=None,
                   help="torch device (default: cuda:0; without CUDA the bench refuses to run unless --device cpu "
                        "is given, as it measures GPU speed)")
    p.add_argument("--contexts", default="256,4096", help="b=1 decode contexts, comma-separated")
    p.add_argument("--batches", default="8,32", help="decode batch sizes at the smallest context")
    p.add_argument("--prefill", default="2048",
                   help="prefill lengths, comma-separated (0 or empty = skip); the longest is the headline figure")
    p.add_argument("--prefill-past", type=nonneg_int, default=0,
                   help="also time each prefill length as a chunk after this many cached tokens (a prefix-cache hit)")
    p.add_argument("--new-tokens", type=positive_int, default=128, help="decode tokens timed per run")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table of eager b=1 decode steps")
    p.add_argument("--vs-transformers", action="store_true", help="also time the shape in bf16 through transformers")
    p.add_argument("--ceiling-lib", type=Path, default=None, metavar="SO",
                   help="the bench extension with the decode-only ceiling kernel (python bench/ext/build.py writes "
                        "bench/ext/build/exl3_bench.so, the default in a source checkout); without it the ceiling "
                        "is left out")
    p.add_argument("--lora", action="store_true",
                   help="instead: decode with random LoRA adapters on all 7 projections against none (b=1 with one "
                        "adapter; b=--lora-batch with --lora-adapters different ones), see exl3_core/lora/bench.py")
    p.add_argument("--lora-rank", type=int, default=16, help="rank of the --lora adapters (default 16)")
    p.add_argument("--lora-adapters", type=int, default=8, help="different adapters in the --lora batch (default 8)")
    p.add_argument("--lora-batch", type=int, default=32, help="batch of the --lora mixed run (default 32)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT",
                   help="write every figure to this JSON file (default: none)")
    add_parallel_args(p)
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
    add_cache_bits_arg(p, repeat=True)
    p.add_argument("--cache-memory", type=positive_float, default=None, metavar="GIB",
                   help="cache memory of the capacity report (the 4096-token sequences it holds at once, per "
                        "--cache-bits); default: the device's memory less the weights (16 GiB on the CPU)")
    p.set_defaults(func=_bench_cmd)


def _ints(text: str, opt: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{opt} {text!r}: expected comma-separated integers") from None
    if any(v < 0 for v in vals):
        raise UsageError(f"{opt} {text!r}: lengths and batch sizes cannot be negative")
    return vals


def _floats(text: str, opt: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{opt} {text!r}: expected comma-separated numbers") from None


def _bench_cmd(args: argparse.Namespace) -> int:
    import torch

    from exl3_core.bench.models import parse_shape
    from exl3_core.bench.run import run_bench
    from exl3_core.progress import Progress

    contexts = _ints(args.contexts, "--contexts")
    if not contexts or 0 in contexts:
        raise UsageError("--contexts needs at least one context length, each > 0")
    batches, prefill = _ints(args.batches, "--batches"), _ints(args.prefill, "--prefill")
    if args.device is None and not torch.cuda.is_available():
        raise RuntimeError("exl3 bench measures GPU speed and no CUDA device is available here; pass --device cpu "
                           "to run it on the CPU anyway (minutes per figure at the default shapes)")
    device = resolve_device(args.device)
    shape = parse_shape(args.shape)
    if args.lora:
        from exl3_core.lora.bench import run_lora_bench

        res = run_lora_bench(shape, rank=args.lora_rank, adapters=args.lora_adapters, batch=args.lora_batch,
                             ctx=min(contexts), bpw=args.bpw, head_bits=args.head_bits or None, codebook=args.codebook,
                             device=device, new_tokens=args.new_tokens)
        if args.json is not None:
            args.json.write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
        return 0
    if args.draft is not None or args.ngram_bench:
        from exl3_core.bench.spec import run_ngram_bench, run_spec_bench

        out: dict[str, Any] = {}
        if args.draft is not None:
            out["draft"] = run_spec_bench(
                shape, parse_shape(args.draft), alphas=_floats(args.draft_alphas, "--draft-alphas"),
                ks=_ints(args.draft_k, "--draft-k"), batch=args.draft_batch, ctx=min(contexts),
                new_tokens=args.new_tokens, bpw=args.bpw, head_bits=args.head_bits or None, codebook=args.codebook,
                device=device)
        if args.ngram_bench:
            out["ngram"] = run_ngram_bench(device=device, new_tokens=args.new_tokens)
        if args.json is not None:
            args.json.write_text(json.dumps(out, indent=1, default=str), encoding="utf-8")
        return 0
    with Progress(0, "bench", unit="step", heartbeat_s=1.0) as bar:
        res = run_bench(shape, bpw=args.bpw, head_bits=args.head_bits or None, codebook=args.codebook,
                        device=device, contexts=contexts, batches=batches, prefill_tokens=prefill,
                        prefill_past=args.prefill_past, new_tokens=args.new_tokens, profile=args.profile,
                        vs_transformers=args.vs_transformers, ceiling_lib=args.ceiling_lib, log=bar.write,
                        progress=bar, parallel=parallel_load_kwargs(args),
                        cache_bits=cache_variants(args),
                        cache_memory=None if args.cache_memory is None else int(args.cache_memory * 2**30))
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
    return 0
