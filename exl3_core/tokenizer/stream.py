"""Incremental detokenization for streaming generation.

Decoding one token at a time is wrong for two reasons: a multi-byte character may be split over
several byte-level tokens (each alone decodes to U+FFFD), and some decoders depend on context
(SentencePiece drops the space of the *first* token only). Re-decoding the whole sequence each
step is right but quadratic. Instead the decoder keeps two offsets into the token list:

    ids[prefix:read]   tokens already emitted, kept as left context
    ids[read:]         tokens not emitted yet

Each step decodes ``ids[prefix:read]`` and ``ids[prefix:]``; the new text is the second minus the
first. It is emitted only when it does not end in U+FFFD (a character still incomplete); then
``prefix`` moves to ``read`` and ``read`` to the end, so the window stays a few tokens long.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

_REPLACEMENT = "\ufffd"

#: Tokens one UTF-8 character can be spread over (4 bytes), plus slack for empty-decoding tokens.
#: A window still ending in U+FFFD past this length holds genuinely invalid bytes: emit them.
_MAX_PENDING = 8


class StreamDecoder:
    """Turns a stream of token ids into text chunks that are always complete characters.

    :param tokenizer: an :class:`exl3_core.tokenizer.Tokenizer` (or anything with a compatible
        ``decode(ids, skip_special_tokens)``).
    :param skip_special_tokens: drop special tokens from the text.

    The concatenation of every ``push`` result and the final ``flush`` equals
    ``tokenizer.decode(all_ids)``.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        out = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return out if isinstance(out, str) else "".join(out)

    def _step(self, final: bool) -> str:
        if self.read >= len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        pending = len(self.ids) - self.read
        if after.endswith(_REPLACEMENT) and not final and pending < _MAX_PENDING:
            return ""
        # The window's text normally extends the old one; if a decoder rewrote it, still only emit
        # the part past what was already emitted.
        new = after[len(before):]
        if not new:
            # Nothing visible yet (e.g. a skipped special token): keep the same left context.
            self.read = len(self.ids)
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        # Tokens left of the context window are never decoded again; drop them.
        del self.ids[:self.prefix]
        self.read -= self.prefix
        self.prefix = 0
        return new

    def push(self, token_ids: int | Iterable[int] | torch.Tensor) -> str:
        """Add tokens; return the text they complete (possibly ``""``)."""
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.flatten().tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        chunks = []
        for t in token_ids:
            self.ids.append(int(t))
            chunks.append(self._step(final=False))
        return "".join(chunks)

    def flush(self) -> str:
        """Return whatever is held back (an incomplete character decodes to U+FFFD here)."""
        return self._step(final=True)

    def reset(self) -> None:
        """Forget all tokens (start a new sequence)."""
        self.ids.clear()
        self.prefix = self.read = 0
