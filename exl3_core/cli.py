"""The ``exl3`` command. Each job lives in its own module exposing ``add_cli(subparsers)``;
this file only wires them together, so a job whose module is absent simply isn't offered.

Conventions every job follows (tests/core/test_cli.py checks them):

* ``--help`` shows every option's default (:class:`HelpFormatter`) and every job has a description;
* exit status 2 for usage errors (argparse's own, and :class:`UsageError` raised by a job for a bad
  option value or combination), 1 for runtime errors (missing files, no CUDA, ...), 130 for Ctrl-C;
* a runtime error is one line on stderr, ``exl3: error: ...``, without a traceback
  (``EXL3_LOG_LEVEL=DEBUG`` shows it).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable
from typing import Any

from exl3_core import __version__, settings

#: modules providing sub-commands through ``add_cli(subparsers)``, in help order
SUBCOMMAND_MODULES = (
    "exl3_core.generate_cli",
    "exl3_core.convert.cli",
    "exl3_core.eval.cli",
    "exl3_core.bench.cli",
    "exl3_core.server.cli",
    "exl3_core.plan.cli",
    "exl3_core.plugins.listing",
)


class UsageError(Exception):
    """A bad option value or combination found after parsing: reported like argparse's errors (exit 2)."""


# -- argparse plumbing --------------------------------------------------------------------------------

class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to every option whose help does not already state its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower():
            return text
        if isinstance(action, argparse.BooleanOptionalAction) and isinstance(action.default, bool):
            return f"{text} (default: {'on' if action.default else 'off'})"
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return text  # identity: a default of 0 is shown, only False (a flag) is not
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text  # a required positional has no default
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class _SubParsers(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Gives every sub-command a description (its help as a sentence when it sets none)."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        if kwargs.get("description") is None and kwargs.get("help"):
            h = str(kwargs["help"])
            kwargs["description"] = h[:1].upper() + h[1:] + ("" if h.endswith(".") else ".")
        return super().add_parser(name, **kwargs)  # type: ignore[no-any-return]


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with :class:`HelpFormatter`; its sub-parsers are Parsers too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _SubParsers)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return v


def nonneg_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return v


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return v


def nonneg_float(text: str) -> float:
    """argparse type: a number >= 0."""
    v = float(text)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return v


def bounded_float(lo: float, hi: float, *, low_open: bool = False) -> Callable[[str], float]:
    """argparse type: a number in ``[lo, hi]`` (``(lo, hi]`` with ``low_open``)."""

    def parse(text: str) -> float:
        v = float(text)
        if not ((lo < v if low_open else lo <= v) and v <= hi):
            raise argparse.ArgumentTypeError(f"{text} is outside {'(' if low_open else '['}{lo:g}, {hi:g}]")
        return v

    parse.__name__ = "number"  # argparse names the type in its "invalid ... value" message
    return parse


for _f in (positive_int, nonneg_int):
    _f.__name__ = "integer"
for _f in (positive_float, nonneg_float):
    _f.__name__ = "number"


def resolve_device(device: str | None, option: str = "--device") -> str:
    """The torch device a job runs on: ``device`` checked against this machine, or cuda:0 when CUDA is
    available, else cpu. A CUDA device without CUDA is a runtime error saying what to do instead."""
    import torch

    if device is None:
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    try:
        d = torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(f"{option} {device!r} is not a torch device; use e.g. cpu, cuda or cuda:1") from None
    if d.type == "cuda":
        if not torch.backends.cuda.is_built():
            raise RuntimeError(f"{option} {device}: this torch ({torch.__version__}) is a CPU-only build; use "
                               f"--device cpu, or install a CUDA build of torch (https://pytorch.org/get-started)")
        if not torch.cuda.is_available():
            raise RuntimeError(f"{option} {device}: no CUDA device is visible (no NVIDIA driver, or "
                               f"CUDA_VISIBLE_DEVICES hides them); use --device cpu")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise RuntimeError(f"{option} {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                               f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    elif d.type != "cpu":
        raise UsageError(f"{option} {device!r}: exl3 runs on cpu or cuda devices")
    return str(d)


def build_parser() -> Parser:
    p = Parser(prog="exl3", description="Fast EXL3 LLM inference: generate, chat, serve, convert, evaluate, "
                                        "benchmark.")
    p.add_argument("--version", action="version", version=f"exl3 {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for mod_name in SUBCOMMAND_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name and mod_name.startswith(e.name):
                continue  # that job is not part of this build
            raise
        add = getattr(mod, "add_cli", None)
        if add is not None:
            add(sub)
    return p


def _one_line(e: BaseException) -> str:
    """The error as one line: its message's lines joined; the type named where the message alone
    would not say what went wrong (exceptions other than the usual runtime errors)."""
    msg = "; ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
    if not isinstance(e, (ValueError, LookupError, RuntimeError, OSError, ImportError)):
        msg = f"{type(e).__name__}: {msg}"
    return msg


def _subparser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub-)parser of the job that ran, for its usage line in error messages."""
    names = [getattr(args, "command", None), getattr(args, "eval_command", None)]
    for name in names:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if name is None or not actions or name not in actions[0].choices:
            break
        parser = actions[0].choices[name]
    return parser


def main(argv: list[str] | None = None) -> int:
    from exl3_core import threads

    threads.prepare_env()  # before anything loads torch: OpenMP reads it then
    from exl3_core.progress import AboveBars

    handler = AboveBars()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, settings.get().log_level, logging.WARNING), handlers=[handler])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    debug = settings.get().log_level == "DEBUG"
    try:
        threads.configure()
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("exl3: interrupted", file=sys.stderr)
        return 130
    except UsageError as e:
        sub = _subparser(parser, args)
        sub.print_usage(sys.stderr)
        print(f"{sub.prog}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the command line reports every failure as one line
        if debug:
            raise
        print(f"exl3: error: {_one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
