"""Calibration rows for the quantizer and the built-in evaluation text.

The reference quantizer calibrates on ``rows x cols`` token ids: mostly text windows and about
one row in seven of uniformly random token ids (format spec 5.1: text weights 115, random 20).
Our text is the corpus vendored in ``exl3_core/data/calibration`` (Python documentation and
standard-library source, the Debian Reference in seven languages; licences in its README): every
fifth unit of each collection is held out as *evaluation* text, so perplexity and KL divergence are
never measured on what the model was calibrated on. Every row begins as the tokenizer begins an input:
with BOS where it adds one (``add_bos_token``), so the first position of each row, which every later
position attends to, is calibrated as it is met at inference. Everything here is seeded: the same arguments
give the same rows on every run, which resumable conversion relies on.
"""
from __future__ import annotations

import functools
import json
import lzma
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from exl3_core.tokenizer import Tokenizer

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "calibration"
CORPUS_FILE = DATA_DIR / "corpus.json.xz"
#: fraction of rows that are uniform-random token ids (the reference mix: 20 of 135 weight units)
RANDOM_FRACTION = 20 / 135
#: default calibration size (``exl3 convert`` without --cal-rows/--cal-cols): TOKENS_PER_INPUT tokens
#: per input channel of the widest quantized linear (the Hessian's size), within [MIN_TOKENS,
#: MAX_TOKENS] (the upper end is the reference quantizer's 250 x 2048), in rows of DEFAULT_COLS
#: tokens: short rows weigh the first positions of a context, which every context has, and measured
#: lower KL than 128- and 256-token rows on both golden metrics (docs/dev/quality-history.md)
DEFAULT_COLS = 64
TOKENS_PER_INPUT = 64
MIN_TOKENS = 32768
MAX_TOKENS = 250 * 2048
#: rows the post-pass scale refit (convert/postpass.py) runs on: it fits two scale vectors per linear
#: for fixed codes, which needs far fewer tokens than the Hessians LDLQ rounds against, and its three
#: passes over every stage were most of a default conversion's time
POSTPASS_TOKENS_PER_INPUT = 8
POSTPASS_MIN_TOKENS = 16384
EVAL_EVERY = 5  # unit i of a collection (sorted) is evaluation text iff i % EVAL_EVERY == EVAL_EVERY - 1

Split = Literal["calibration", "eval", "all"]


@dataclass(frozen=True)
class Document:
    """One document of the built-in corpus; ``unit`` is what the split assigns (a chapter's
    translations share one, so no translation of an evaluation chapter is calibrated on)."""

    id: str
    unit: str
    collection: str
    lang: str
    text: str


@functools.cache
def corpus() -> tuple[Document, ...]:
    """Every document of the built-in corpus (``exl3_core/data/calibration/README.md``)."""
    if not CORPUS_FILE.is_file():
        raise FileNotFoundError(f"built-in text {CORPUS_FILE} is missing; reinstall exl3 (the package data "
                                f"exl3_core/data/calibration/* was not installed) or pass a text file")
    data = json.loads(lzma.decompress(CORPUS_FILE.read_bytes()).decode("utf-8"))
    return tuple(Document(d["id"], d["unit"], d["collection"], d["lang"], d["text"]) for d in data["documents"])


def documents(split: Split = "calibration", collections: tuple[str, ...] | None = None) -> list[Document]:
    """The corpus documents of ``split``, optionally only those of ``collections``, in corpus order."""
    docs = corpus()
    known = {d.collection for d in docs}
    if collections is not None and (unknown := set(collections) - known):
        raise ValueError(f"unknown text collection(s) {sorted(unknown)}; the built-in corpus has {sorted(known)}")
    held: set[str] = set()
    for coll in known:
        units = sorted({d.unit for d in docs if d.collection == coll})
        held |= {u for i, u in enumerate(units) if i % EVAL_EVERY == EVAL_EVERY - 1}
    return [d for d in docs if (collections is None or d.collection in collections)
            and (split == "all" or (d.unit in held) == (split == "eval"))]


def builtin_text(split: Split = "calibration", collections: tuple[str, ...] | None = None) -> str:
    """The built-in corpus text of ``split`` (calibration, held-out eval, or all), documents joined
    by blank lines. ``collections`` restricts it (e.g. ``("python-reference",)``, the Python
    language reference topics that were the only built-in text before the corpus)."""
    return "\n\n".join(d.text for d in documents(split, collections))


def default_size(widest_input: int, rows: int | None = None, cols: int | None = None) -> tuple[int, int]:
    """``(rows, cols)`` of the default calibration for a model whose widest quantized linear reads
    ``widest_input`` channels; a given ``rows`` or ``cols`` is kept."""
    cols = DEFAULT_COLS if cols is None else cols
    if rows is None:
        tokens = min(MAX_TOKENS, max(MIN_TOKENS, TOKENS_PER_INPUT * widest_input))
        rows = max(1, -(-tokens // cols))
    return rows, cols


def postpass_rows(ids: torch.Tensor, widest_input: int) -> torch.Tensor:
    """The calibration rows the post-pass refit uses: ``POSTPASS_TOKENS_PER_INPUT`` tokens per input
    channel of the widest quantized linear, at least ``POSTPASS_MIN_TOKENS`` (all rows when there are
    fewer), spread evenly over ``ids [rows, cols]`` so text and random rows keep their shares."""
    rows, cols = ids.shape
    want = -(-max(POSTPASS_MIN_TOKENS, POSTPASS_TOKENS_PER_INPUT * widest_input) // cols)
    if want >= rows:
        return ids
    return ids[[(i * rows) // want for i in range(want)]]


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The model's tokenizer, or None when the directory has no ``tokenizer.json``."""
    d = Path(model_dir)
    if not (d / "tokenizer.json").is_file():
        return None
    from exl3_core.tokenizer import Tokenizer

    return Tokenizer.from_directory(d)


def tokenize_text(tokenizer: object, text: str, vocab_size: int | None = None, what: str = "text") -> torch.Tensor:
    """int64 token ids of ``text`` (no BOS), checked against the model's vocabulary size."""
    ids = torch.tensor(tokenizer.encode_ids(text, add_bos=False), dtype=torch.int64)  # type: ignore[attr-defined]
    if vocab_size is not None and ids.numel() and int(ids.max()) >= vocab_size:
        raise ValueError(f"{what}: the tokenizer produced id {int(ids.max())} but the model's vocab_size is "
                         f"{vocab_size}; the tokenizer does not belong to this model")
    return ids


def text_windows(ids: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``rows`` windows of ``cols`` tokens spread evenly over ``ids`` (repeated when it is too short)."""
    if rows == 0:
        return torch.empty(0, cols, dtype=torch.int64)
    if ids.numel() == 0:
        raise ValueError("calibration text tokenized to nothing")
    if ids.numel() < cols + 1:
        ids = ids.repeat(-(-(cols + 1) // ids.numel()))
    span = ids.numel() - cols
    starts = [(i * span) // max(rows - 1, 1) for i in range(rows)]
    return torch.stack([ids[s: s + cols] for s in starts])


def random_rows(rows: int, cols: int, vocab_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (rows, cols), generator=g, dtype=torch.int64)


def calibration_ids(model_dir: str | Path, vocab_size: int, rows: int, cols: int, *, seed: int = 0,
                    text: str | None = None, random_fraction: float = RANDOM_FRACTION) -> torch.Tensor:
    """int64 ``[rows, cols]`` calibration token ids: text windows first, then random rows.

    :param model_dir: where the tokenizer lives; without a ``tokenizer.json`` every row is random
        (with a warning): a quantizer calibrated on noise only is still valid, just worse.
    :param text: calibration text (default: the built-in documentation text).
    :param random_fraction: share of uniform-random rows (1.0: no text at all, e.g. for random-weight
        test models, for which no text is more typical than another).
    """
    if rows <= 0 or cols <= 1:
        raise ValueError(f"calibration size {rows} rows x {cols} cols: need rows >= 1 and cols >= 2")
    if not 0.0 <= random_fraction <= 1.0:
        raise ValueError(f"random calibration fraction {random_fraction} must be in [0, 1]")
    tok = load_tokenizer(model_dir)
    if random_fraction == 1.0:
        return begin_like_inputs(random_rows(rows, cols, vocab_size, seed), tok)
    if tok is None:
        warnings.warn(f"{model_dir} has no tokenizer.json: calibrating on random token ids only", stacklevel=2)
        return random_rows(rows, cols, vocab_size, seed)
    n_random = round(rows * random_fraction) if rows > 1 else 0
    ids = tokenize_text(tok, text if text is not None else builtin_text("calibration"), vocab_size,
                        "calibration text")
    mixed = torch.cat([text_windows(ids, rows - n_random, cols), random_rows(n_random, cols, vocab_size, seed)])
    return begin_like_inputs(mixed, tok)


def begin_like_inputs(ids: torch.Tensor, tokenizer: Tokenizer | None) -> torch.Tensor:
    """``ids [rows, cols]`` with every row's first token replaced by BOS where ``tokenizer`` prepends BOS to
    what it encodes (in place; returned)."""
    if tokenizer is not None and tokenizer.add_bos_token and tokenizer.bos_token_id is not None:
        ids[:, 0] = int(tokenizer.bos_token_id)
    return ids
