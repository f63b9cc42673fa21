"""``exl3 generate`` and ``exl3 chat``: streaming generation with the paged Generator.

Without ``--model`` both use the embedded default model (imported once into the cache folder).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from exl3_core.cache_bits import add_cache_bits_arg, cache_kwargs


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", type=Path, default=None,
                   help="model folder (HF-style, unquantized or EXL3); default: the embedded default model")
    p.add_argument("--device", default=None, help="torch device (default: cuda:0 if available, else cpu)")
    p.add_argument("--cache-tokens", type=int, default=8192, help="KV-cache size in tokens (default 8192)")
    add_cache_bits_arg(p)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None, help="0 or unset with no other option = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--system", default=None, help="system prompt (chat template)")
    p.add_argument("--attention", default=None, help="comma-separated attention backends to try, in order")


def add_cli(sub: Any) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    g.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read stdin)")
    g.add_argument("--raw", action="store_true", help="don't apply the chat template")
    g.add_argument("--stats", action="store_true", help="print timing statistics to stderr")
    _add_model_args(g)
    g.set_defaults(func=_generate_cmd)
    c = sub.add_parser("chat", help="interactive chat with streaming replies (/exit or EOF ends, /reset clears)")
    _add_model_args(c)
    c.set_defaults(func=_chat_cmd)


def _sampler(args: argparse.Namespace) -> Any:
    from exl3_core.sampling import Sampler

    t = args.temperature
    if (t is None or t == 0.0) and args.top_k == 0 and args.top_p == 1.0 and args.min_p == 0.0:
        return Sampler.greedy() if args.repetition_penalty == 1.0 else Sampler.build(
            temperature=1e-4, repetition_penalty=args.repetition_penalty)
    return Sampler.build(temperature=1.0 if t is None else t, top_k=args.top_k, top_p=args.top_p,
                         min_p=args.min_p, repetition_penalty=args.repetition_penalty)


class Session:
    """Model, cache, tokenizer and generator for one CLI run."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from exl3_core import Cache, Config, Generator, Model, Tokenizer

        model_dir = args.model
        if model_dir is None:
            from exl3_core.convert.default_model import default_model_dir

            model_dir = default_model_dir(progress=True)
        device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
        if device == "cpu":
            torch.set_num_threads(max(1, torch.get_num_threads()))
        self.config = Config.from_directory(model_dir)
        self.model = Model.from_config(self.config)
        attention = [a.strip() for a in args.attention.split(",")] if args.attention else None
        self.cache = Cache(self.model, max_num_tokens=args.cache_tokens, **cache_kwargs(args))
        # the cache counts in the load's memory check and is allocated with the weights
        self.model.load(device=device, progressbar=True, attention=attention, caches=[self.cache])
        self.tokenizer = Tokenizer.from_config(self.config)
        self.generator = Generator(model=self.model, cache=self.cache, tokenizer=self.tokenizer)
        self.args = args

    def prompt_ids(self, messages: list[dict[str, str]] | None, raw: str | None) -> Any:
        if messages is not None and self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_bos=False)
        if messages is not None:  # no template: plain concatenation
            raw = "\n".join(m["content"] for m in messages) + "\n"
        return self.tokenizer.encode(raw or "")

    def stream(self, ids: Any, out: TextIO) -> tuple[str, dict[str, Any]]:
        from exl3_core.generator import Job

        job = Job(ids, max_new_tokens=self.args.max_new_tokens, sampler=_sampler(self.args), seed=self.args.seed)
        self.generator.enqueue(job)
        text, last = [], {}
        while self.generator.num_remaining():
            for r in self.generator.iterate():
                if r.get("error") is not None:
                    raise RuntimeError(f"generation failed: {r['error']}") from r["error"]
                if r["text"]:
                    out.write(r["text"])
                    out.flush()
                    text.append(r["text"])
                if r["eos"]:
                    last = r
        return "".join(text), last


def _generate_cmd(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    t0 = time.perf_counter()
    s = Session(args)
    t_load = time.perf_counter() - t0
    messages = None if args.raw else ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": prompt}]
    _, last = s.stream(s.prompt_ids(messages, prompt), sys.stdout)
    sys.stdout.write("\n")
    if args.stats:
        print(f"load {t_load:.2f} s; " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in last.items() if k not in ("job", "text", "token_ids",
                                                                                       "full_completion")),
              file=sys.stderr)
    return 0


def _chat_cmd(args: argparse.Namespace) -> int:
    s = Session(args)
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("\n> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply, _ = s.stream(s.prompt_ids(history, None), sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": reply})
    return 0
