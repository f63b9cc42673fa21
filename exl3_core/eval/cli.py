"""``exl3 eval ppl | kld | plot``: perplexity, KL divergence against a reference, bpw plots."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from exl3_core.tokenizer import Tokenizer


def load_model(path: str, device: str) -> Any:
    from exl3_core.archkit import Model

    return Model.from_pretrained(path, device=device, progressbar=True)


def _device(args: argparse.Namespace) -> str:
    from exl3_core.cli import resolve_device

    return resolve_device(args.device)


def _bar(label: str) -> Any:
    from exl3_core.progress import Progress

    return Progress(0, label, unit="window", heartbeat_s=1.0)


def eval_ids(model_dir: str, text_file: str | None, ids_file: str | None, vocab_size: int | None = None) -> torch.Tensor:
    """Token ids to evaluate on: an ids file, a text file, or the built-in held-out documentation text."""
    if ids_file is not None:
        import torch
        from safetensors.torch import load_file

        t = load_file(ids_file)
        if "input_ids" not in t:
            raise ValueError(f"{ids_file} has no tensor named input_ids (found {sorted(t)})")
        return t["input_ids"].to(torch.int64)
    return _eval_text(model_dir, text_file, vocab_size)[0]


def _eval_text(model_dir: str, text_file: str | None, vocab_size: int | None) -> tuple[torch.Tensor, Tokenizer]:
    """The token ids of a text file or the built-in held-out text, and the tokenizer that made them."""
    from exl3_core.convert.calibration import builtin_text, load_tokenizer, tokenize_text

    tok = load_tokenizer(model_dir)
    if tok is None:
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json to tokenize the evaluation text; pass token ids "
                                f"with --ids FILE.safetensors (tensor input_ids)")
    text = Path(text_file).read_text(encoding="utf-8") if text_file else builtin_text("eval")
    return tokenize_text(tok, text, vocab_size, text_file or "built-in evaluation text"), tok


def _common(p: argparse.ArgumentParser) -> None:
    from exl3_core.cli import positive_int

    p.add_argument("--text", default=None, help="text file (default: built-in held-out Python docs text)")
    p.add_argument("--ids", default=None, help="safetensors file with token ids (input_ids, 1-D or [rows, ctx]) "
                                               "(default: tokenize --text)")
    p.add_argument("--ctx", type=positive_int, default=512, help="window length in tokens")
    p.add_argument("--rows", type=positive_int, default=None, help="at most this many windows (default: all)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _windows(args: argparse.Namespace, model_dir: str, vocab: int | None) -> torch.Tensor:
    """The windows to evaluate: token ids given as rows are taken as they are; text is cut into windows that
    each begin as the tokenizer begins an input (with BOS where it adds one, as llama.cpp's perplexity does)."""
    from exl3_core.convert.calibration import begin_like_inputs
    from exl3_core.eval.ppl import make_windows

    if args.ids is None:
        ids, tok = _eval_text(model_dir, args.text, vocab)
        return begin_like_inputs(make_windows(ids, args.ctx, args.rows).clone(), tok)
    ids = eval_ids(model_dir, None, args.ids, vocab)
    if ids.dim() == 2:
        return ids[: args.rows] if args.rows else ids
    return make_windows(ids, args.ctx, args.rows)


def _ppl(args: argparse.Namespace) -> int:
    from exl3_core.eval.ppl import perplexity

    model = load_model(args.model, _device(args))
    w = _windows(args, args.model, model.config.hf.vocab_size)
    with _bar("perplexity") as bar:
        r = perplexity(model, w.reshape(-1), ctx=w.shape[1], progress=bar)
    out = {"model": args.model, "ppl": r.ppl, "nll": r.nll, "tokens": r.tokens, "windows": r.windows}
    print(json.dumps(out) if args.json else f"perplexity {r.ppl:.4f} (mean NLL {r.nll:.5f} over {r.tokens} tokens, "
                                            f"{r.windows} windows of {w.shape[1]})")
    return 0


def _kld(args: argparse.Namespace) -> int:
    from exl3_core.eval.kld import kl_divergence

    device = _device(args)
    ref = load_model(args.ref, device)
    model = load_model(args.model, device)
    w = _windows(args, args.ref, ref.config.hf.vocab_size)
    with _bar("KL divergence") as bar:
        r = kl_divergence(model, ref, w, progress=bar)
    out = {"model": args.model, "ref": args.ref, "kld": r.kld, "top1": r.top1, "tokens": r.tokens}
    print(json.dumps(out) if args.json else f"KL divergence {r.kld:.6f} nats/token, top-1 agreement "
                                            f"{100 * r.top1:.2f}% over {r.tokens} tokens")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from exl3_core.eval.kld import kl_divergence
    from exl3_core.eval.plot import Point, model_bpw, pyplot, render
    from exl3_core.eval.ppl import perplexity
    from exl3_core.progress import write

    pyplot()  # without matplotlib, say so before minutes of evaluation
    device = _device(args)
    ref = load_model(args.ref, device) if args.ref else None
    points, ref_ppl = [], None
    for d in args.models:
        model = load_model(d, device)
        w = _windows(args, args.ref or d, model.config.hf.vocab_size)
        with _bar(f"perplexity {Path(d).name}") as bar:
            r = perplexity(model, w.reshape(-1), ctx=w.shape[1], progress=bar)
        kld = None
        if ref is not None:
            with _bar(f"KL divergence {Path(d).name}") as bar:
                kld = kl_divergence(model, ref, w, progress=bar).kld
        points.append(Point(Path(d).name, model_bpw(d), r.ppl, kld))
        write(f"{d}: {points[-1].bpw:.3f} bpw, ppl {r.ppl:.4f}" + (f", KLD {kld:.6f}" if kld is not None else ""))
        del model
    if ref is not None:
        w = _windows(args, args.ref, ref.config.hf.vocab_size)
        with _bar(f"perplexity {Path(args.ref).name}") as bar:
            ref_ppl = perplexity(ref, w.reshape(-1), ctx=w.shape[1], progress=bar).ppl
    path = render(points, args.output, title=args.title or "", reference_ppl=ref_ppl)
    if args.json:
        print(json.dumps({"plot": str(path), "reference_ppl": ref_ppl,
                          "points": [p.__dict__ for p in points]}))
    else:
        print(f"wrote {path}")
    return 0


def add_cli(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "eval", help="evaluate models: perplexity, KL divergence, bpw plots",
        description="Evaluate model quality on fixed windows of a text: perplexity, KL divergence against a "
                    "reference model, and a plot of both against bits per weight.")
    sub = p.add_subparsers(dest="eval_command", metavar="WHAT", required=True)
    pp = sub.add_parser("ppl", help="perplexity over fixed windows",
                        description="Perplexity of a model over non-overlapping windows of --ctx tokens (each "
                                    "window run alone, no cache; windows of text begin with BOS where the "
                                    "tokenizer adds one).")
    pp.add_argument("-m", "--model", required=True, help="model directory")
    _common(pp)
    pp.set_defaults(func=_ppl)
    pk = sub.add_parser("kld", help="mean KL(ref || model) per token and top-1 agreement",
                        description="Mean KL divergence of a model's next-token distributions from a reference "
                                    "model's (e.g. the unquantized original) on the same windows, and how often "
                                    "their most likely tokens agree.")
    pk.add_argument("-m", "--model", required=True, help="model directory")
    pk.add_argument("--ref", required=True, help="reference model directory (e.g. the unquantized original)")
    _common(pk)
    pk.set_defaults(func=_kld)
    pl = sub.add_parser("plot", help="PNG of perplexity (and KLD with --ref) against bits per weight",
                        description="Evaluate several models and plot perplexity (and, with --ref, KL divergence) "
                                    "against their bits per weight, as a PNG. Needs matplotlib: "
                                    "pip install 'exl3-core[plot]'.")
    pl.add_argument("--models", nargs="+", required=True, help="model directories")
    pl.add_argument("-o", "--output", required=True, help="PNG file to write")
    pl.add_argument("--ref", default=None, help="reference model: adds a KLD panel and its perplexity line "
                                                "(default: none)")
    pl.add_argument("--title", default=None, help="chart title (default: none)")
    _common(pl)
    pl.set_defaults(func=_plot)
