"""Command-line pieces shared by ``exl3 generate``, ``chat``, ``serve`` and ``convert``: ``--lora DIR[:WEIGHT]``."""
from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

LORA_HELP = ("a PEFT LoRA adapter folder to apply, optionally with a weight for its delta (DIR or DIR:WEIGHT, "
             "default weight 1.0); repeatable: the adapters' deltas add up")


def parse_spec(text: str) -> tuple[Path, float]:
    """``DIR`` or ``DIR:WEIGHT`` -> (folder, weight).

    :raises argparse.ArgumentTypeError: for an empty folder or a weight that is not a finite number."""
    folder, sep, tail = text.rpartition(":")
    if sep and folder:
        try:
            weight = float(tail)
        except ValueError:
            folder, weight = text, 1.0  # a ':' inside the path itself
        else:
            if not math.isfinite(weight):
                raise argparse.ArgumentTypeError(f"--lora {text}: the weight {tail!r} is not a finite number")
    else:
        folder, weight = text, 1.0
    if not folder:
        raise argparse.ArgumentTypeError(f"--lora {text!r}: name an adapter folder (DIR or DIR:WEIGHT)")
    return Path(folder).expanduser(), weight


def add_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", action="append", default=[], type=parse_spec, metavar="DIR[:WEIGHT]", help=LORA_HELP)


class LoraLoader(Protocol):
    def load_lora(self, path: str | Path, name: str | None = None) -> str: ...


def check_folders(specs: Sequence[tuple[Path, float]]) -> None:
    """Read each ``--lora`` folder's config before the (slow) model load, so a wrong path fails at once.

    :raises LoraError: naming the folder or file."""
    from exl3_core.lora.config import WEIGHTS_FILE, LoraError, read_config

    for folder, _ in specs:
        if not folder.is_dir():
            raise LoraError(f"--lora {folder}: no such adapter folder (expected a PEFT LoRA folder with "
                            f"adapter_config.json and {WEIGHTS_FILE})")
        read_config(folder)


def load_all(model: LoraLoader, specs: Sequence[tuple[Path, float]]) -> dict[str, float]:
    """Load every ``--lora`` adapter onto ``model``; returns the job choice ``{name: weight}`` (names from the
    folders, made unique)."""
    choice: dict[str, float] = {}
    for folder, weight in specs:
        base = folder.resolve().name or "lora"
        name, i = base, 2
        while name in choice:
            name, i = f"{base}-{i}", i + 1
        choice[model.load_lora(folder, name)] = weight
    return choice
