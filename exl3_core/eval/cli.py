"""``exl3 eval ppl | kld | plot``: perplexity, KL divergence against a reference, bpw plots."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch


def load_model(path: str, device: str) -> Any:
    from exl3_core.archkit import Model

    return Model.from_pretrained(path, device=device)


def eval_ids(model_dir: str, text_file: str | None, ids_file: str | None, vocab_size: int | None = None) -> torch.Tensor:
    """Token ids to evaluate on: an ids file, a text file, or the built-in held-out documentation text."""
    if ids_file is not None:
        from safetensors.torch import load_file

        t = load_file(ids_file)
        if "input_ids" not in t:
            raise ValueError(f"{ids_file} has no tensor named input_ids (found {sorted(t)})")
        return t["input_ids"].to(torch.int64)
    from exl3_core.convert.calibration import builtin_text, load_tokenizer, tokenize_text

    tok = load_tokenizer(model_dir)
    if tok is None:
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json to tokenize the evaluation text; pass token ids "
                                f"with --ids FILE.safetensors (tensor input_ids)")
    text = Path(text_file).read_text(encoding="utf-8") if text_file else builtin_text("eval")
    return tokenize_text(tok, text, vocab_size, text_file or "built-in evaluation text")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", default=None, help="text file (default: built-in held-out Python docs text)")
    p.add_argument("--ids", default=None, help="safetensors file with token ids (input_ids, 1-D or [rows, ctx])")
    p.add_argument("--ctx", type=int, default=512, help="window length in tokens (default 512)")
    p.add_argument("--rows", type=int, default=None, help="at most this many windows")
    p.add_argument("--device", default="cpu", help="e.g. cpu or cuda:0")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _windows(args: argparse.Namespace, model_dir: str, vocab: int | None) -> torch.Tensor:
    from exl3_core.eval.ppl import make_windows

    ids = eval_ids(model_dir, args.text, args.ids, vocab)
    if ids.dim() == 2:
        return ids[: args.rows] if args.rows else ids
    return make_windows(ids, args.ctx, args.rows)


def _ppl(args: argparse.Namespace) -> int:
    from exl3_core.eval.ppl import perplexity

    model = load_model(args.model, args.device)
    w = _windows(args, args.model, model.config.hf.vocab_size)
    r = perplexity(model, w.reshape(-1), ctx=w.shape[1])
    out = {"model": args.model, "ppl": r.ppl, "nll": r.nll, "tokens": r.tokens, "windows": r.windows}
    print(json.dumps(out) if args.json else f"perplexity {r.ppl:.4f} (mean NLL {r.nll:.5f} over {r.tokens} tokens, "
                                            f"{r.windows} windows of {w.shape[1]})")
    return 0


def _kld(args: argparse.Namespace) -> int:
    from exl3_core.eval.kld import kl_divergence

    ref = load_model(args.ref, args.device)
    model = load_model(args.model, args.device)
    w = _windows(args, args.ref, ref.config.hf.vocab_size)
    r = kl_divergence(model, ref, w)
    out = {"model": args.model, "ref": args.ref, "kld": r.kld, "top1": r.top1, "tokens": r.tokens}
    print(json.dumps(out) if args.json else f"KL divergence {r.kld:.6f} nats/token, top-1 agreement "
                                            f"{100 * r.top1:.2f}% over {r.tokens} tokens")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from exl3_core.eval.kld import kl_divergence
    from exl3_core.eval.plot import Point, model_bpw, render
    from exl3_core.eval.ppl import perplexity

    ref = load_model(args.ref, args.device) if args.ref else None
    points, ref_ppl = [], None
    for d in args.models:
        model = load_model(d, args.device)
        w = _windows(args, args.ref or d, model.config.hf.vocab_size)
        r = perplexity(model, w.reshape(-1), ctx=w.shape[1])
        kld = kl_divergence(model, ref, w).kld if ref is not None else None
        points.append(Point(Path(d).name, model_bpw(d), r.ppl, kld))
        print(f"{d}: {points[-1].bpw:.3f} bpw, ppl {r.ppl:.4f}" + (f", KLD {kld:.6f}" if kld is not None else ""),
              file=sys.stderr)
        del model
    if ref is not None:
        w = _windows(args, args.ref, ref.config.hf.vocab_size)
        ref_ppl = perplexity(ref, w.reshape(-1), ctx=w.shape[1]).ppl
    path = render(points, args.output, title=args.title or "", reference_ppl=ref_ppl)
    if args.json:
        print(json.dumps({"plot": str(path), "reference_ppl": ref_ppl,
                          "points": [p.__dict__ for p in points]}))
    else:
        print(f"wrote {path}")
    return 0


def add_cli(subparsers: Any) -> None:
    p = subparsers.add_parser("eval", help="evaluate models: perplexity, KL divergence, bpw plots")
    sub = p.add_subparsers(dest="eval_command", metavar="WHAT", required=True)
    pp = sub.add_parser("ppl", help="perplexity over fixed windows")
    pp.add_argument("-m", "--model", required=True, help="model directory")
    _common(pp)
    pp.set_defaults(func=_ppl)
    pk = sub.add_parser("kld", help="mean KL(ref || model) per token and top-1 agreement")
    pk.add_argument("-m", "--model", required=True, help="model directory")
    pk.add_argument("--ref", required=True, help="reference model directory (e.g. the unquantized original)")
    _common(pk)
    pk.set_defaults(func=_kld)
    pl = sub.add_parser("plot", help="PNG of perplexity (and KLD with --ref) against bits per weight")
    pl.add_argument("--models", nargs="+", required=True, help="model directories")
    pl.add_argument("-o", "--output", required=True, help="PNG file to write")
    pl.add_argument("--ref", default=None, help="reference model: adds a KLD panel and its perplexity line")
    pl.add_argument("--title", default=None)
    _common(pl)
    pl.set_defaults(func=_plot)
