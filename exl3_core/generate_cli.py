"""``exl3 generate`` and ``exl3 chat``: streaming generation with the paged Generator.

Without ``--model`` both use the embedded default model (imported once into the cache folder).
Both sample by default: with the model's ``generation_config.json`` when it has sampling settings,
else with llama.cpp's defaults; ``--greedy`` (or ``--temperature 0``) decodes greedily.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from exl3_core.cache_bits import add_cache_bits_arg, cache_kwargs
from exl3_core.cli import UsageError, bounded_float, nonneg_float, nonneg_int, positive_float, positive_int
from exl3_core.parallel.cli import add_parallel_args, parallel_load_kwargs

#: sampling when neither the user nor the model says otherwise (llama.cpp's CLI uses these too)
DEFAULT_SAMPLING: dict[str, float] = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
#: generation_config.json keys that are sampling settings, with their value when a model sets others only
_GEN_KEYS: dict[str, float] = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class Sampling:
    """The sampling a run uses and where it came from (shown with ``--stats``)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    source: str

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sampler(self) -> Any:
        from exl3_core.sampling import Sampler

        if self.greedy:
            # a near-zero temperature keeps the repetition penalty while picking the top token
            return Sampler.greedy() if self.repetition_penalty == 1.0 else Sampler.build(
                temperature=1e-4, repetition_penalty=self.repetition_penalty)
        return Sampler.build(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                             repetition_penalty=self.repetition_penalty)

    def describe(self) -> str:
        rp = f", repetition penalty {self.repetition_penalty:g}" if self.repetition_penalty != 1.0 else ""
        if self.greedy:
            return f"greedy{rp} ({self.source})"
        return (f"temperature {self.temperature:g}, top-k {self.top_k}, top-p {self.top_p:g}, "
                f"min-p {self.min_p:g}{rp} ({self.source})")


def model_sampling(model_dir: Path) -> Sampling | None:
    """The sampling settings of ``model_dir/generation_config.json``; None when it has none.

    A config with ``do_sample: false`` asks for greedy decoding. Settings it leaves out are neutral
    (no top-k, top-p 1, ...), as the model's authors chose only the ones they give."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable JSON ({e}); fix or delete the file") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(cfg).__name__}; fix or delete the file")
    given = {k: cfg[k] for k in _GEN_KEYS if cfg.get(k) is not None}
    for k, v in given.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{path}: {k} = {v!r} is not a number; fix or delete the file")
    if cfg.get("do_sample") is False:
        return Sampling(0.0, 0, 1.0, 0.0, float(given.get("repetition_penalty", 1.0)),
                        f"{path.name}: do_sample false")
    if not any(k in given for k in ("temperature", "top_k", "top_p", "min_p")):
        return None
    v = {**_GEN_KEYS, **given}
    return Sampling(float(v["temperature"]), int(v["top_k"]), float(v["top_p"]), float(v["min_p"]),
                    float(v["repetition_penalty"]), path.name)


def choose_sampling(args: argparse.Namespace, model_dir: Path) -> Sampling:
    """Command-line options over the model's ``generation_config.json`` over :data:`DEFAULT_SAMPLING`."""
    explicit = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "min_p")
                if getattr(args, k) is not None}
    if args.greedy:
        clash = [k for k, v in explicit.items() if k != "temperature" or v != 0.0]
        if clash:
            raise UsageError(f"--greedy contradicts --{clash[0].replace('_', '-')}; give one or the other")
        return Sampling(0.0, 0, 1.0, 0.0, args.repetition_penalty or 1.0, "--greedy")
    base = model_sampling(model_dir) or Sampling(
        DEFAULT_SAMPLING["temperature"], int(DEFAULT_SAMPLING["top_k"]), DEFAULT_SAMPLING["top_p"],
        DEFAULT_SAMPLING["min_p"], 1.0, "llama.cpp defaults")
    if base.greedy and explicit and "temperature" not in explicit:
        base = replace(base, temperature=DEFAULT_SAMPLING["temperature"])  # sampling options ask for sampling
    out = replace(base, **{k: (int(v) if k == "top_k" else float(v)) for k, v in explicit.items()})
    if args.repetition_penalty is not None:
        out = replace(out, repetition_penalty=args.repetition_penalty)
    if explicit or args.repetition_penalty is not None:
        out = replace(out, source=f"options over {base.source}")
    return out


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", type=Path, default=None,
                   help="model folder (HF-style, unquantized or EXL3) (default: the embedded default model)")
    p.add_argument("--device", default=None, help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda:0 when "
                                                  "CUDA is available, else cpu)")
    p.add_argument("--cache-tokens", type=positive_int, default=8192, help="KV-cache size in tokens")
    add_cache_bits_arg(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="most tokens generated per reply")
    s = p.add_argument_group(
        "sampling", "Default: the model's generation_config.json when it has sampling settings, else temperature "
                    "0.8, top-k 40, top-p 0.95, min-p 0.05 (llama.cpp's defaults). An option given here replaces "
                    "that one setting.")
    s.add_argument("--greedy", action="store_true", help="always pick the most likely token (same as "
                                                         "--temperature 0)")
    s.add_argument("--temperature", type=nonneg_float, default=None, help="0 = greedy (default: see above)")
    s.add_argument("--top-k", type=nonneg_int, default=None, help="keep the k most likely tokens, 0 = all "
                                                                  "(default: see above)")
    s.add_argument("--top-p", type=bounded_float(0.0, 1.0, low_open=True), default=None,
                   help="nucleus sampling mass in (0, 1] (default: see above)")
    s.add_argument("--min-p", type=bounded_float(0.0, 1.0), default=None,
                   help="drop tokens below this fraction of the top probability, 0..1 (default: see above)")
    s.add_argument("--repetition-penalty", type=positive_float, default=None,
                   help="> 1 discourages repeats (default: the model's generation_config.json, else 1 = off)")
    s.add_argument("--seed", type=int, default=None, help="sampling seed (default: a random one)")
    p.add_argument("--system", default=None, help="system prompt (chat template) (default: none)")
    p.add_argument("--attention", default=None, help="comma-separated attention backends to try, in order "
                                                     "(default: by priority; `exl3 plugins` lists them)")
    add_parallel_args(p)
    from exl3_core.lora.cli import add_argument

    add_argument(p)  # --lora DIR[:WEIGHT]
    add_draft_args(p)


def add_draft_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding options (``generate``, ``chat``, ``serve``)."""
    p.add_argument("--draft-model", type=Path, default=None, metavar="DIR",
                   help="speculative decoding with this draft model (same tokenizer; its cache is --cache-tokens)")
    p.add_argument("--draft-tokens", type=int, default=4, metavar="K",
                   help="most tokens the draft model proposes per step (default 4)")
    p.add_argument("--ngram-draft", type=int, default=0, metavar="K",
                   help="speculative decoding without a draft model: up to K tokens continuing an earlier occurrence "
                        "of the last few tokens in the context (default 0: off)")


@dataclass(frozen=True)
class DraftArgs:
    """The speculative decoding options of a parsed command line."""

    model: Path | None = None
    tokens: int = 4
    ngram: int = 0

    @classmethod
    def parse(cls, args: argparse.Namespace) -> DraftArgs:
        """From ``args`` (options a caller's namespace lacks keep their defaults); raises ``ValueError``
        naming the option before anything loads."""
        d = cls(getattr(args, "draft_model", None), getattr(args, "draft_tokens", 4), getattr(args, "ngram_draft", 0))
        if d.tokens < 1:
            raise ValueError(f"--draft-tokens {d.tokens} must be at least 1")
        if d.ngram < 0:
            raise ValueError(f"--ngram-draft {d.ngram} must be >= 0 (0: off)")
        if d.model is not None and d.ngram:
            raise ValueError("give --draft-model or --ngram-draft, not both")
        if d.model is not None and not Path(d.model).is_dir():
            raise ValueError(f"--draft-model {d.model}: no such folder")
        return d


def add_cli(sub: Any) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)",
                       description="Generate a reply to PROMPT with the chat template applied (--raw: continue "
                                   "PROMPT as plain text), streaming it to stdout. Without PROMPT the prompt is read "
                                   "from stdin.")
    g.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read from stdin)")
    g.add_argument("--raw", action="store_true", help="don't apply the chat template")
    g.add_argument("--stats", action="store_true", help="print the sampling used and timing statistics to stderr")
    _add_model_args(g)
    g.set_defaults(func=_generate_cmd)
    c = sub.add_parser("chat", help="interactive chat with streaming replies",
                       description="Chat with a model: one message per line, replies stream as they are generated. "
                                   "/reset clears the conversation, /exit (or Ctrl-D) ends it. Ctrl-C stops the "
                                   "reply being written; a second Ctrl-C at the prompt exits.")
    _add_model_args(c)
    c.set_defaults(func=_chat_cmd)


#: what :class:`Session` streams with until a command chooses (``exl3 serve`` samples per request)
LIBRARY_GREEDY = Sampling(0.0, 0, 1.0, 0.0, 1.0, "library default")


class Session:
    """Model, cache, tokenizer and generator for one CLI run (``generate``, ``chat``, ``serve``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from exl3_core import Cache, Config, Generator, Model, Tokenizer
        from exl3_core.cli import resolve_device
        from exl3_core.lora.cli import check_folders, load_all

        device = resolve_device(args.device)  # before any loading: a bad device fails at once
        lora_specs = getattr(args, "lora", None) or []  # a hand-built Namespace may lack it
        check_folders(lora_specs)
        draft = DraftArgs.parse(args)
        model_dir = args.model
        if model_dir is None:
            from exl3_core.convert.default_model import default_model_dir

            model_dir = default_model_dir(progress=True)
        self.config = Config.from_directory(model_dir)
        self.sampling = LIBRARY_GREEDY
        # before the weights load: a folder without its tokenizer fails in a second, not after minutes
        self.tokenizer = Tokenizer.from_config(self.config)
        self.model = Model.from_config(self.config)
        attention = [a.strip() for a in args.attention.split(",")] if args.attention else None
        self.cache = Cache(self.model, max_num_tokens=args.cache_tokens, **cache_kwargs(args))
        # the cache counts in the load's memory check and is allocated with the weights
        self.model.load(device=device, progressbar=True, attention=attention, caches=[self.cache],
                        **parallel_load_kwargs(args))
        #: the adapters every reply uses ({} without --lora)
        self.loras = load_all(self.model, lora_specs)
        #: Generator keyword arguments of the speculative decoding options (empty without them)
        self.speculation: dict[str, Any] = {}
        if draft.model is not None:
            dcfg = Config.from_directory(draft.model)
            dmodel = Model.from_config(dcfg)
            dcache = Cache(dmodel, max_num_tokens=args.cache_tokens)
            dmodel.load(device=device, progressbar=True, attention=attention, caches=[dcache])
            self.speculation = {"draft_model": dmodel, "draft_cache": dcache, "num_draft_tokens": draft.tokens,
                                "draft_tokenizer": Tokenizer.from_config(dcfg)}
        elif draft.ngram:
            self.speculation = {"ngram_draft_tokens": draft.ngram}
        self.generator = Generator(model=self.model, cache=self.cache, tokenizer=self.tokenizer, **self.speculation)
        self.args = args

    def prompt_ids(self, messages: list[dict[str, str]] | None, raw: str | None) -> Any:
        if messages is not None and self.tokenizer.chat_template:
            return self.tokenizer.encode_chat(messages, add_generation_prompt=True)  # typed <|...|> stays text
        if messages is not None:  # no template: plain concatenation
            raw = "\n".join(m["content"] for m in messages) + "\n"
        return self.tokenizer.encode(raw or "")

    def stream(self, ids: Any, out: TextIO) -> tuple[str, dict[str, Any], bool]:
        """Generate and write the reply as it comes: (text, last result, whether Ctrl-C stopped it).

        Ctrl-C is caught between generator steps (never inside one, so the cache stays consistent)
        and cancels the job; a second Ctrl-C before that step ends interrupts at once."""
        from exl3_core.generator import Job

        job = Job(ids, max_new_tokens=self.args.max_new_tokens, sampler=self.sampling.sampler(), seed=self.args.seed,
                  loras=self.loras or None)
        self.generator.enqueue(job)
        text: list[str] = []
        last: dict[str, Any] = {}
        stop = threading.Event()

        def on_sigint(signum: int, frame: FrameType | None) -> None:
            if stop.is_set():
                raise KeyboardInterrupt
            stop.set()

        previous = signal.signal(signal.SIGINT, on_sigint) if _main_thread() else None
        try:
            while self.generator.num_remaining() and not stop.is_set():
                for r in self.generator.iterate():
                    if r.get("error") is not None:
                        raise RuntimeError(f"generation failed: {r['error']}") from r["error"]
                    if r["text"]:
                        out.write(r["text"])
                        out.flush()
                        text.append(r["text"])
                    if r["eos"]:
                        last = r
            if stop.is_set():
                self.generator.cancel(job)  # frees its cache pages; the session stays usable
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        return "".join(text), last, stop.is_set()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        if not args.prompt.strip():
            raise UsageError("the prompt is empty")
        return str(args.prompt)
    if sys.stdin is None:
        raise UsageError("no prompt: pass PROMPT as an argument or pipe it on stdin")
    if sys.stdin.isatty():
        print("exl3 generate: reading the prompt from stdin, end it with Ctrl-D (or pass PROMPT as an argument)",
              file=sys.stderr, flush=True)
    prompt = sys.stdin.read()
    if not prompt.strip():
        raise UsageError("no prompt: stdin was empty; pass PROMPT as an argument or pipe text on stdin")
    return prompt


def _generate_cmd(args: argparse.Namespace) -> int:
    prompt = _read_prompt(args)  # before loading anything: a missing prompt fails at once
    t0 = time.perf_counter()
    s = Session(args)
    s.sampling = choose_sampling(args, Path(s.config.directory))
    t_load = time.perf_counter() - t0
    messages = None if args.raw else ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": prompt}]
    _, last, stopped = s.stream(s.prompt_ids(messages, prompt), sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if stopped:
        raise KeyboardInterrupt
    if args.stats:
        import torch

        skip = ("job", "text", "token_ids", "full_completion")
        print(f"sampling: {s.sampling.describe()}", file=sys.stderr)
        print(f"load {t_load:.2f} s; threads {torch.get_num_threads()}; "
              + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in last.items() if k not in skip), file=sys.stderr)
    return 0


def _chat_cmd(args: argparse.Namespace) -> int:
    s = Session(args)
    s.sampling = choose_sampling(args, Path(s.config.directory))
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"exl3 chat: {s.config.directory.name}, {s.sampling.describe()}. /reset clears, /exit or Ctrl-D "
              f"ends; Ctrl-C stops a reply.", file=sys.stderr)
    while True:
        if interactive:
            sys.stdout.write("\n> ")
            sys.stdout.flush()
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:  # Ctrl-C at the prompt ends the chat (a reply in progress is stopped instead)
            sys.stdout.write("\n")
            break
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
        reply, _, stopped = s.stream(s.prompt_ids(history, None), sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
        if stopped:
            print("[reply stopped; Ctrl-C again at the prompt or Ctrl-D exits]", file=sys.stderr, flush=True)
        history.append({"role": "assistant", "content": reply})
    return 0
