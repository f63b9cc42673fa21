"""Log probabilities of generated tokens in OpenAI's two shapes.

A request asking for them (``logprobs``, and ``top_logprobs`` in chat) runs its job with the raw logits of
each generated token returned (:attr:`Job.return_logits`); each token's log probability and its ``top`` most
likely alternatives come from the log-softmax of those logits: the model's own distribution, before
temperature, truncation, penalties or a response format shape the draw (as vLLM reports them by default).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from exl3_core.server.schemas import CompletionLogprobs, TokenLogprob, TopLogprob


class TokenTexts:
    """Each token id's bytes (from the tokenizer's vocabulary) and its text, bytes that are not whole UTF-8
    characters shown as ``\\xNN`` escapes; ids past the vocabulary are empty."""

    def __init__(self, vocab: Sequence[bytes]) -> None:
        self.vocab = list(vocab)

    def bytes_of(self, token: int) -> bytes:
        return self.vocab[token] if 0 <= token < len(self.vocab) else b""

    def text_of(self, token: int) -> str:
        return self.bytes_of(token).decode("utf-8", errors="backslashreplace")


def token_logprobs(tokens: Sequence[int], logits: torch.Tensor, top: int, texts: TokenTexts) -> list[TokenLogprob]:
    """Chat ``logprobs.content`` entries of ``tokens``, whose raw logits are the rows of ``logits [n, V]``."""
    if len(tokens) != logits.shape[0]:
        raise ValueError(f"token_logprobs: {len(tokens)} tokens but {logits.shape[0]} rows of logits")
    if not tokens:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(tokens), dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
    alts: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if top > 0:
        values, indices = lp.topk(min(top, lp.shape[1]), dim=-1)
        alts = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]

    def fields(token: int, logprob: float) -> dict[str, Any]:
        return {"token": texts.text_of(token), "logprob": logprob, "bytes": list(texts.bytes_of(token))}

    return [TokenLogprob(**fields(t, c), top_logprobs=[TopLogprob(**fields(i, v)) for i, v in alt])
            for t, c, alt in zip(tokens, chosen, alts)]


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int,
                        top: int) -> tuple[CompletionLogprobs, int]:
    """The completions endpoint's shape of ``entries``, whose first token's text starts at character ``offset``
    of the completion, and the offset after their last token (where a stream's next entries start). Offsets
    count the tokens' texts, so they run past a completion cut at a stop string."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return CompletionLogprobs(tokens=[e.token for e in entries], token_logprobs=[e.logprob for e in entries],
                              top_logprobs=[{a.token: a.logprob for a in e.top_logprobs} for e in entries] if top
                              else None, text_offset=offsets), offset
