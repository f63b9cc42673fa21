"""The ``Filter`` contract for constrained generation (grammars, JSON schemas, ...).

The generator drives a filter through the *final* methods :meth:`Filter.feed`,
:meth:`Filter.rewind` and :meth:`Filter.mask` (do not override them). They keep a journal of the
accepted tokens so the generator can roll a filter back (banned strings, stop-string holds):
a filter that implements :meth:`Filter.rollback_tokens` rewinds natively, any other one is rebuilt
by ``reset()`` and replaying the journal.

Masks: :meth:`Filter.get_next_logit_mask` returns either a bool tensor ``[V]`` (True = allowed)
or a packed bitmask ``int32 [ceil(V/32)]`` where bit ``j`` of word ``i`` allows token
``32*i + j`` (the layout grammar engines use). None means "no constraint at this position".
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``int32 [ceil(V/32)]`` little-endian bitmask -> bool ``[vocab_size]``."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    bits = (w[:, None] >> torch.arange(32, device=w.device)[None, :]) & 1
    flat = bits.reshape(-1).bool()
    if flat.numel() < vocab_size:
        flat = torch.cat([flat, flat.new_zeros(vocab_size - flat.numel())])
    return flat[:vocab_size]


class Filter(ABC):
    """Base class of every filter; plugins subclass it and register through ``exl3_filters``."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._journal: list[int] = []

    # -- required -------------------------------------------------------------------------------
    @abstractmethod
    def reset(self) -> None:
        """Return to the start state (no tokens accepted). Called before a job's first token."""

    @abstractmethod
    def accept_token(self, token: int) -> None:
        """Advance the state by one sampled token (always one the last mask allowed)."""

    @abstractmethod
    def get_next_logit_mask(self) -> torch.Tensor | None:
        """Allowed next tokens (bool ``[V]`` or packed ``int32`` bitmask), None = unconstrained.

        May run on a worker thread while the model's forward pass runs (see
        :meth:`use_background_worker`); it must not touch the GPU's current stream state.
        """

    @abstractmethod
    def is_completed(self) -> bool:
        """True when the constraint is fully satisfied and generation must stop."""

    # -- optional -------------------------------------------------------------------------------
    def rollback_tokens(self, n: int) -> bool:
        """Undo the last ``n`` accepted tokens natively; return False to request a replay."""
        return False

    def use_background_worker(self) -> bool:
        """True if :meth:`get_next_logit_mask` is slow enough to overlap with the forward pass."""
        return False

    # -- final (the generator's entry points; do not override) ----------------------------------
    @property
    def journal(self) -> tuple[int, ...]:
        return tuple(self._journal)

    def attach(self) -> None:
        """Start a job: reset state and journal."""
        self._journal = []
        self.reset()

    def feed(self, token: int) -> None:
        self.accept_token(token)
        self._journal.append(token)

    def rewind(self, n: int) -> None:
        """Forget the last ``n`` accepted tokens."""
        if n <= 0:
            return
        if n > len(self._journal):
            raise ValueError(f"{type(self).__name__}.rewind({n}): only {len(self._journal)} tokens were accepted")
        keep = self._journal[:-n]
        if not self.rollback_tokens(n):
            self._rebuild(keep)
        self._journal = keep

    def _rebuild(self, tokens: list[int]) -> None:
        self.reset()
        for t in tokens:
            self.accept_token(t)

    def mask(self, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """:meth:`get_next_logit_mask` normalised to bool ``[vocab_size]`` on ``device`` (or None)."""
        m = self.get_next_logit_mask()
        if m is None:
            return None
        if m.dtype == torch.bool:
            if m.numel() < vocab_size:  # tokenizer vocab smaller than the model's padded vocab
                m = torch.cat([m, m.new_zeros(vocab_size - m.numel())])
            m = m[:vocab_size]
        elif m.dtype in (torch.int32, torch.int64, torch.uint32):
            # a bitmask over the tokenizer's vocab may be shorter than the model's padded vocab:
            # unpack_bitmask disallows the missing tail, as for bool masks
            m = unpack_bitmask(m, vocab_size)
        else:
            raise TypeError(f"{type(self).__name__}.get_next_logit_mask returned {m.dtype} [{m.numel()}]; expected bool "
                            f"[{vocab_size}] or an int32 bitmask of {(vocab_size + 31) // 32} words")
        return m.to(device, non_blocking=True)
