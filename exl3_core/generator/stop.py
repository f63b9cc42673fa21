"""Incremental detokenization and the held-back text used for stop strings and banned strings.

:class:`TextStream` turns token ids into text deltas that never split a UTF-8 character. It
snapshots its state per token so the generator can roll tokens back (banned strings).

:class:`HeldText` holds generated text back while its tail could still become a stop string or
a banned string, so a streamed delta never contains part of one.
"""
from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any


class TextStream:
    """Token ids -> text deltas (complete characters only), with per-token rollback.

    Uses the tokenizer's raw token bytes (``get_vocab_bytes()``) and an incremental UTF-8 decoder
    when available, else re-decodes the generated ids and emits what is new, holding back while
    the text ends in U+FFFD (an incomplete character).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        vb = getattr(tokenizer, "get_vocab_bytes", None)
        self.vocab_bytes: Sequence[bytes] | None = vb() if vb is not None else None
        self.ids: list[int] = []
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""  # fallback mode: text emitted so far
        self._snap: list[tuple[bytes, int, str]] = []  # per token: decoder state before it

    def push(self, token: int) -> str:
        buf, flag = self._dec.getstate()
        self._snap.append((buf, flag, self._text))
        self.ids.append(token)
        if self.vocab_bytes is not None:
            b = self.vocab_bytes[token] if 0 <= token < len(self.vocab_bytes) else b""
            return self._dec.decode(b or b"")
        full = self.tokenizer.decode(self.ids)
        if full.endswith("\ufffd"):
            return ""
        delta = full.removeprefix(self._text)
        self._text = full
        return delta

    def flush(self) -> str:
        """Whatever is pending at the end (an incomplete character becomes U+FFFD)."""
        if self.vocab_bytes is not None:
            return self._dec.decode(b"", final=True)
        full = self.tokenizer.decode(self.ids) if self.ids else ""
        delta = full[len(self._text):] if full.startswith(self._text) else ""
        self._text = full
        return delta

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` pushed tokens (their deltas must be discarded by the caller)."""
        if n <= 0:
            return
        buf, flag, text = self._snap[-n]
        del self._snap[-n:]
        del self.ids[-n:]
        self._dec.setstate((buf, flag))
        self._text = text


class HeldText:
    """Text not yet streamed, with the token boundaries inside it.

    :param stop_strings: end generation where one appears (the string itself is not emitted).
    :param banned: strings that must never appear; a match asks the generator to roll back.
    """

    def __init__(self, stop_strings: Sequence[str], banned: Sequence[str]) -> None:
        self.stop_strings = [s for s in stop_strings if s]
        self.banned = [s for s in banned if s]
        self.watch = self.stop_strings + self.banned
        self.text = ""
        self.tokens: list[tuple[int, int]] = []  # (token id, len(self.text) after it)
        self.extras: list[Any] = []  # per token: whatever the generator reports with it (probs, logits)

    def add(self, token: int, delta: str, extra: Any = None) -> None:
        self.text += delta
        self.tokens.append((token, len(self.text)))
        self.extras.append(extra)

    def find_banned(self) -> int | None:
        """Index into :attr:`tokens` of the first token to roll back, or None."""
        starts = [i for s in self.banned if (i := self.text.find(s)) >= 0]
        if not starts:
            return None
        m = min(starts)
        for k, (_, end) in enumerate(self.tokens):
            if end > m:
                return k
        return len(self.tokens) - 1

    def find_stop(self) -> int | None:
        """Offset where the earliest complete stop string starts, or None."""
        starts = [i for s in self.stop_strings if (i := self.text.find(s)) >= 0]
        return min(starts) if starts else None

    def safe_len(self) -> int:
        """Length of the prefix that cannot be part of any watched string."""
        n = len(self.text)
        hold = 0
        for s in self.watch:
            for k in range(min(len(s) - 1, n), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return n - hold

    def take(self, n: int) -> tuple[str, list[int], list[Any]]:
        """Release the first ``n`` characters and every token that ends within them."""
        out = self.text[:n]
        self.text = self.text[n:]
        k = 0
        while k < len(self.tokens) and self.tokens[k][1] <= n:
            k += 1
        released = [t for t, _ in self.tokens[:k]]
        extras = self.extras[:k]
        self.tokens = [(t, end - n) for t, end in self.tokens[k:]]
        self.extras = self.extras[k:]
        return out, released, extras

    def take_all(self) -> tuple[str, list[int], list[Any]]:
        out, toks, extras = self.take(len(self.text))
        toks += [t for t, _ in self.tokens]  # tokens with no text yet (incomplete character)
        extras += self.extras
        self.tokens, self.extras = [], []
        return out, toks, extras

    def drop_tokens(self, k: int) -> int:
        """Remove tokens ``k..`` and their text; returns how many were dropped."""
        dropped = len(self.tokens) - k
        cut = self.tokens[k - 1][1] if k > 0 else 0
        self.text = self.text[:cut]
        self.tokens = self.tokens[:k]
        self.extras = self.extras[:k]
        return dropped
