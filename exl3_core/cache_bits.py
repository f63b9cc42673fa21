"""``--cache-bits K[,V]``: the command-line form of a cache's storage variant and its options.

``4`` is a 4-bit key and value cache, ``8,4`` 8-bit keys and 4-bit values, ``16`` (the default) the plain
cache in the model's 16-bit dtype. Each width is 2..8, or 16 for both sides. ``--cache-recent N`` sets how
many of each sequence's newest positions a quantized cache reads at 8 bits (the cache's default, or 0 for none:
a little faster, less exact). Parsing happens with the other options, before any model or cache is built;
:func:`cache_kwargs` gives ``Cache(...)``'s arguments.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads lazily: options are parsed before any model or cache is built
    import torch

OPTION = "--cache-bits"
RECENT_OPTION = "--cache-recent"
UNQUANTIZED = 16


@dataclass(frozen=True)
class CacheBits:
    """Key and value widths (16/16 is the unquantized cache) and the recent rows of a quantized one."""

    k_bits: int = UNQUANTIZED
    v_bits: int = UNQUANTIZED
    #: newest positions per sequence read at 8 bits (the cache layer's option ``recent``); None: its default
    recent: int | None = None

    @property
    def quantized(self) -> bool:
        return self.k_bits != UNQUANTIZED

    def label(self, dtype: torch.dtype) -> str:
        """``"k4v4"``-style, or for the unquantized cache the ``dtype`` it holds (``"fp16"``, ``"bf16"``,
        ``"fp32"``), for reports."""
        if self.quantized:
            return f"k{self.k_bits}v{self.v_bits}" + ("" if self.recent is None else f"r{self.recent}")
        from exl3_core.cache.layer import DTYPE_VIEWS

        return DTYPE_VIEWS.get(dtype, str(dtype).removeprefix("torch."))

    def cache_kwargs(self) -> dict[str, Any]:
        """``Cache(model, n, **cache_kwargs())``: the variant and its options."""
        if not self.quantized:
            return {"variant": "fp16"}
        out: dict[str, Any] = {"variant": "quant", "k_bits": self.k_bits, "v_bits": self.v_bits}
        if self.recent is not None:
            out["recent"] = self.recent
        return out


def parse_cache_bits(text: str, option: str = OPTION) -> CacheBits:
    """``"4"`` / ``"8,4"`` / ``"16"`` -> :class:`CacheBits`; ValueError naming ``option`` and the fix otherwise."""
    parts = [p.strip() for p in str(text).split(",")]
    fix = f"give K or K,V with each in 2..8 (e.g. {option} 4 or {option} 8,4), or 16 for the unquantized cache"
    if len(parts) not in (1, 2) or not all(p.isdigit() for p in parts):
        raise ValueError(f"{option} {text!r}: {fix}")
    k = int(parts[0])
    v = int(parts[1]) if len(parts) == 2 else k
    for name, b in (("key", k), ("value", v)):
        if b != UNQUANTIZED and not 2 <= b <= 8:
            raise ValueError(f"{option} {text!r}: {b} {name} bits is outside 2..8; {fix}")
    if (k == UNQUANTIZED) != (v == UNQUANTIZED):
        raise ValueError(f"{option} {text!r}: 16 (unquantized) applies to keys and values together; {fix}")
    return CacheBits(k, v)


def _arg_type(text: str) -> CacheBits:
    try:
        return parse_cache_bits(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _recent_type(text: str) -> int:
    n = int(text) if text.strip().isdigit() else -1
    if n < 0 or n & (n - 1):
        raise argparse.ArgumentTypeError(f"{RECENT_OPTION} {text!r}: give 0 (none) or a power of two, e.g. 64")
    return n


def add_cache_bits_arg(p: argparse.ArgumentParser, *, repeat: bool = False) -> None:
    """Add ``--cache-bits`` and ``--cache-recent`` to ``p`` (``repeat``: ``--cache-bits`` may be given several
    times, e.g. to compare caches)."""
    more = " Repeat it to measure several caches in one run." if repeat else ""
    p.add_argument(OPTION, type=_arg_type, metavar="K[,V]", action="append" if repeat else "store",
                   default=None if repeat else CacheBits(),
                   help=f"KV-cache bits per value: K for keys and values, or K,V (each 2..8, e.g. 4 or 8,4); 16 "
                        f"(default) keeps the unquantized cache.{more}")
    p.add_argument(RECENT_OPTION, type=_recent_type, metavar="N", default=None,
                   help="newest positions of each sequence a quantized cache (a side below 8 bits) reads at 8 bits: "
                        "a power of two, or 0 for none (a little faster, less exact); default 64")


def cache_variants(args: argparse.Namespace) -> tuple[CacheBits, ...]:
    """Every cache of parsed options holding ``--cache-bits`` (the unquantized one when none is given), with
    ``--cache-recent``; ValueError naming the option when it is given without a quantized cache."""
    given = getattr(args, "cache_bits", None)
    variants = tuple(given) if isinstance(given, list) else (given if isinstance(given, CacheBits) else CacheBits(),)
    variants = variants or (CacheBits(),)
    recent = getattr(args, "cache_recent", None)
    if recent is None:
        return variants
    if not any(v.quantized for v in variants):
        raise ValueError(f"{RECENT_OPTION} {recent}: only a quantized cache keeps recent rows; give {OPTION} below 16 "
                         f"(e.g. {OPTION} 4) or leave {RECENT_OPTION} out")
    return tuple(replace(v, recent=recent) if v.quantized else v for v in variants)


def cache_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``Cache(...)`` arguments of parsed options holding ``--cache-bits`` and ``--cache-recent`` (default: the
    unquantized cache)."""
    return cache_variants(args)[0].cache_kwargs()
