"""The conversion family's command lines: ``exl3 import-gguf`` (:func:`exl3_core.convert.gguf_import.import_gguf`),
``exl3 convert`` (:func:`exl3_core.convert.pipeline.convert`) and ``exl3 optimize``
(:func:`exl3_core.convert.optimize.optimize`). Torch-free until a handler runs, so parsing and usage errors are
quick."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from exl3_core.cli import bounded_float, positive_int

#: ``exl3 import-gguf --dtype`` choices (the importer checks its own table of these names)
GGUF_DTYPES = ("bf16", "fp16", "fp32")


def _run(args: argparse.Namespace) -> int:
    from exl3_core.cli import UsageError, resolve_device
    from exl3_core.convert.pipeline import convert
    from exl3_core.progress import write

    if args.refit_propagate > 0 and not args.refit_scales:
        raise UsageError("--refit-propagate only applies with --refit-scales")
    device = resolve_device(args.device)
    source = args.input
    if args.lora:  # EXL3 weights cannot absorb an adapter later: quantize base and adapter merged
        from exl3_core.lora.merge import merged_source

        source = merged_source(args.input, args.lora, args.output)
    res = convert(source, args.output, args.bits, head_bits=args.head_bits, codebook=args.codebook,
                  out_scales=args.out_scales, cal_rows=args.cal_rows, cal_cols=args.cal_cols, device=device,
                  shard_mib=args.shard_size, work_dir=args.work_dir, resume=args.resume, seed=args.seed,
                  text=args.cal_text, cal_random=args.cal_random, propagate=args.propagate,
                  refit_scales=args.refit_scales, refit_propagate=args.refit_propagate, tf32=args.tf32,
                  sequential=args.sequential, refit_final=args.refit_final,
                  progress=not args.no_progress, report=write)
    if res.completed and source != args.input:
        import shutil

        shutil.rmtree(source, ignore_errors=True)
    return 0 if res.completed else 1


def _import_gguf(args: argparse.Namespace) -> int:
    from exl3_core.convert.gguf_import import import_gguf
    from exl3_core.progress import Progress
    from exl3_core.progress import write as progress_write

    try:
        with Progress(0, f"importing {Path(args.file).name}", unit="tensor") as bar:
            out = import_gguf(args.file, args.output, dtype=args.dtype, progress=bar, overwrite=args.overwrite)
    except (ValueError, LookupError, OSError) as e:
        progress_write(f"exl3 import-gguf: error: {e}")
        return 1
    print(out)
    return 0


def _optimize(args: argparse.Namespace) -> int:
    from exl3_core.convert.optimize import optimize

    cands = None if args.candidates is None else tuple(int(c) for c in args.candidates.split(","))
    optimize(args.input, args.output, args.bits, work_dir=args.work_dir, candidates=cands,
             target_bytes=args.target_bytes, head_bits=args.head_bits, seed=args.seed, device=args.device,
             measure_rows=args.measure_rows, measure_cols=args.measure_cols, measurement=args.measurement,
             shard_mib=args.shard_size, resume=args.resume, cal_rows=args.cal_rows, cal_cols=args.cal_cols,
             assemble=args.assemble, progress=not args.no_progress)
    return 0


def add_cli(subparsers: Any) -> None:
    """Register ``import-gguf``, ``convert`` and ``optimize``, in that order."""
    _add_import_gguf(subparsers)
    _add_convert(subparsers)
    _add_optimize(subparsers)


def _add_import_gguf(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "import-gguf", help="import a llama.cpp GGUF file into an HF-style model folder",
        description="Dequantize a GGUF file and write config.json, tokenizer files and safetensors.")
    p.add_argument("file", type=Path, help="the .gguf file")
    p.add_argument("-o", "--output", type=Path, required=True, help="output directory")
    p.add_argument("--dtype", choices=GGUF_DTYPES, default="bf16", help="weight dtype (default bf16)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.set_defaults(func=_import_gguf)


def _add_convert(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "convert", help="quantize a Hugging Face model directory to EXL3",
        description="Quantize an HF safetensors model to EXL3, module by module. Checkpoints to the work "
                    "directory after every module; rerun with --resume after an interruption.")
    p.add_argument("-i", "--input", required=True, help="source model directory (HF safetensors)")
    p.add_argument("-o", "--output", required=True, help="output directory")
    p.add_argument("-b", "--bits", type=bounded_float(1.0, 8.0), required=True, help="target bits per weight (1..8, fractional ok)")
    p.add_argument("--head-bits", type=int, default=6, choices=(*range(1, 9), 16), metavar="{1..8,16}",
                   help="bits of the output head (16 = unquantized; default 6)")
    p.add_argument("--codebook", choices=("mul1", "mcg", "3inst"), default="mul1", help="trellis codebook "
                                                                                       "(default: mul1)")
    p.add_argument("--out-scales", choices=("always", "never", "auto"), default="always",
                   help="output-channel scales (default always)")
    p.add_argument("-w", "--work-dir", default=None, help="checkpoint directory (default OUTPUT.work, removed "
                                                          "after success)")
    p.add_argument("-r", "--resume", action="store_true", help="continue the interrupted job in the work directory")
    p.add_argument("--cal-rows", type=positive_int, default=None, help="calibration rows (default: 64 tokens per "
                   "input channel of the widest linear, 32k..512k tokens)")
    p.add_argument("--cal-cols", type=positive_int, default=None, help="tokens per calibration row (default 64)")
    p.add_argument("--cal-text", default=None, help="calibration text file (default: the built-in corpus)")
    p.add_argument("--cal-random", type=bounded_float(0.0, 1.0), default=20 / 135,
                   help="share of the calibration rows that are uniform-random tokens instead of text, 0..1 "
                        "(default: 0.148, i.e. 20 of every 135 rows; 1 = no text)")
    p.add_argument("--propagate", type=bounded_float(0.0, 1.0), default=None,
                   help="error-propagation strength 0..1: aim each layer partly at the unquantized model's "
                        "output (default: 0.5 below 2.5 bpw, where it measured better, else 0)")
    p.add_argument("--refit-scales", action=argparse.BooleanOptionalAction, default=False,
                   help="after LDLQ, refit the stored fp16 scales in closed form for the final codes (format "
                        "unchanged; default off)")
    p.add_argument("--refit-propagate", type=bounded_float(0.0, 1.0), default=0.0,
                   help="with --refit-scales: aim the refit at the error-propagated target of this strength "
                        "0..1 (the output error including the quantized inputs; default 0)")
    p.add_argument("--sequential", action=argparse.BooleanOptionalAction, default=False,
                   help="quantize a block's input groups in forward order, each from a Hessian captured with "
                        "the earlier groups already quantized (one extra calibration pass per group)")
    p.add_argument("--refit-final", type=bounded_float(0.0, 1.0), default=None, metavar="BETA",
                   help="after quantizing, refit every stored fp16 scale for the final codes from the finished "
                        "model's inputs, aiming at the error-propagated target of strength BETA 0..1 (three extra "
                        "calibration passes; format unchanged; 0 = off; default 0.5)")
    p.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True,
                   help="on CUDA, TF32 tensor cores for the fp32 calibration matmuls (default on; --no-tf32 for "
                        "exact fp32)")
    p.add_argument("--device", default="cpu", help="device that quantizes and runs the calibration passes, e.g. "
                                                   "cpu or cuda:0 (default: cpu)")
    p.add_argument("--shard-size", type=positive_int, default=8192, help="maximum shard size in MiB (default 8192)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed: random calibration rows and the quantizer sign patterns (default 0)")
    p.add_argument("--lora", action="append", default=[], metavar="DIR[:WEIGHT]",
                   help="merge this PEFT LoRA adapter (times WEIGHT, default 1) into the unquantized model before "
                        "quantizing (repeatable); the merged copy of the model is written beside OUTPUT and removed "
                        "when the conversion completes")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the per-tensor log lines stay)")
    p.set_defaults(func=_run)


def _add_optimize(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "optimize", help="mixed-bitrate EXL3 conversion from a measurement of each tensor group's error",
        description="Convert once per candidate bitrate, measure each tensor group's contribution to the KL "
                    "divergence from the unquantized model, choose a bitrate per group for the target average "
                    "(and size), and convert once more with that allocation (or, with --assemble, take the "
                    "tensors from the candidates without quantizing again).")
    p.add_argument("-i", "--input", required=True, help="source model directory (HF safetensors)")
    p.add_argument("-o", "--output", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("-b", "--bits", type=float, required=True, help="target average bits per weight")
    p.add_argument("--target-bytes", type=int, default=None, help="also keep the output's tensors within this size")
    p.add_argument("--candidates", default=None,
                   help="comma-separated bitrates to choose from (default: floor-1 .. ceil+1 of the target)")
    p.add_argument("-w", "--work-dir", default=None, help="work directory (default OUTPUT.optimize; kept)")
    p.add_argument("-r", "--resume", action="store_true", help="continue (or re-target) the job in the work directory")
    p.add_argument("--measurement", default=None, help="reuse this measurement.json (same model and candidates)")
    p.add_argument("--measure-rows", type=int, default=16, help="measurement rows (default 16)")
    p.add_argument("--measure-cols", type=int, default=256, help="tokens per measurement row (default 256)")
    p.add_argument("--head-bits", type=int, default=6, help="bits of the output head (default 6)")
    p.add_argument("--cal-rows", type=int, default=None, help="candidates' calibration rows (default: exl3 convert's)")
    p.add_argument("--cal-cols", type=int, default=None, help="candidates' tokens per calibration row")
    p.add_argument("--seed", type=int, default=0, help="seed of the candidate conversions (default 0)")
    p.add_argument("--device", default="cpu", help="device, e.g. cpu or cuda:0")
    p.add_argument("--shard-size", type=int, default=8192, help="maximum shard size in MiB (default 8192)")
    p.add_argument("--assemble", action="store_true",
                   help="take the chosen tensors from the candidates (seconds, but a higher KL divergence) instead "
                        "of converting once more with the allocation")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_optimize)
