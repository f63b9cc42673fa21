"""Helpers shared by the filters: per-tokenizer caches and argument checks."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
# tokenizer object -> {key: built value}. Building an engine vocabulary takes ~1 s for a 50k-token
# vocabulary, so every filter of one tokenizer shares it; weak keys let an unloaded tokenizer go.
_weak: weakref.WeakKeyDictionary[Any, dict[Hashable, Any]] = weakref.WeakKeyDictionary()
_strong: dict[int, tuple[Any, dict[Hashable, Any]]] = {}  # tokenizers that refuse weak references


def cached_per_tokenizer(tokenizer: Any, key: Hashable, build: Callable[[], T]) -> T:
    """``build()`` once per ``(tokenizer, key)``; later calls return the same object."""
    with _lock:
        try:
            slot = _weak.setdefault(tokenizer, {})
        except TypeError:
            slot = _strong.setdefault(id(tokenizer), (tokenizer, {}))[1]
        if key in slot:
            return slot[key]  # type: ignore[no-any-return]
    value = build()  # outside the lock: slow, and two racing builds are harmless
    with _lock:
        return slot.setdefault(key, value)  # type: ignore[no-any-return]


def one_constraint(owner: str, **given: Any) -> tuple[str, Any]:
    """The single constraint argument that is not None, or a ValueError naming the choices."""
    chosen = [(k, v) for k, v in given.items() if v is not None]
    if len(chosen) != 1:
        names = ", ".join(f"{k}=" for k in given)
        got = ", ".join(k for k, _ in chosen) or "none"
        raise ValueError(f"{owner}: pass exactly one of {names} (got {got})")
    return chosen[0]


def hf_tokenizer(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` behind an exl3 Tokenizer (or the object itself), else None."""
    for cand in (getattr(tokenizer, "tk", None), tokenizer):
        if cand is not None and callable(getattr(cand, "to_str", None)) and hasattr(cand, "token_to_id"):
            return cand
    return None


def eos_ids(tokenizer: Any) -> list[int]:
    ids = list(getattr(tokenizer, "eos_token_ids", None) or [])
    single = getattr(tokenizer, "eos_token_id", None)
    if not ids and single is not None:
        ids = [int(single)]
    return [int(i) for i in ids]


def tokenizer_vocab_size(tokenizer: Any) -> int:
    v = getattr(tokenizer, "vocab_size", None)
    if isinstance(v, int):
        return v
    return len(tokenizer.get_vocab_bytes())
