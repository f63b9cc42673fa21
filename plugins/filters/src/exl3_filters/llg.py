"""``LLGuidanceFilter``: JSON schema / regex / Lark / raw llguidance grammars through llguidance.

llguidance's matcher is an incremental Earley parser over the token trie. It rolls back natively
(so stop-string holds and banned strings cost no replay) and writes the packed ``int32`` bitmask
layout that :func:`exl3_core.filters.base.unpack_bitmask` reads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from exl3_core.filters.base import Filter
from exl3_filters._util import (
    cached_per_tokenizer,
    eos_ids,
    hf_tokenizer,
    one_constraint,
    tokenizer_vocab_size,
)


def _import_llguidance() -> Any:
    try:
        import llguidance
        import llguidance.numpy
    except ImportError as e:
        raise ImportError("LLGuidanceFilter needs llguidance: pip install 'llguidance>=1.9,<2'") from e
    return llguidance


class _BytesVocab:
    """What ``llguidance.TokenizerWrapper`` reads, for tokenizers without a ``tokenizers`` object
    (e.g. the generator's toy byte tokenizer): the token bytes plus an encode callback."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.tokens = list(tokenizer.get_vocab_bytes())
        eos = eos_ids(tokenizer)
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = sorted(getattr(tokenizer, "special_token_ids", None) or [])

    def __call__(self, text: str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        enc = getattr(self._tok, "encode_ids", None)
        if enc is not None:
            return [int(t) for t in enc(text, add_bos=False)]
        return [int(t) for t in torch.as_tensor(self._tok.encode(text)).reshape(-1).tolist()]


def ll_tokenizer(tokenizer: Any, n_vocab: int | None = None) -> Any:
    """The (cached) ``llguidance.LLTokenizer`` of an exl3 Tokenizer.

    :param n_vocab: mask width when the model's vocabulary is larger than the tokenizer's
        (padded embeddings); the extra ids are never allowed.
    """
    llg = _import_llguidance()

    def build() -> Any:
        eos = eos_ids(tokenizer) or None
        hf = hf_tokenizer(tokenizer)
        if hf is not None:
            # the serialized tokenizer.json: llguidance rebuilds the byte trie with the same Rust
            # ``tokenizers`` library, so byte-level / SentencePiece spellings resolve exactly
            return llg.LLTokenizer(hf.to_str(), n_vocab=n_vocab, eos_token=eos)
        if not hasattr(tokenizer, "get_vocab_bytes"):
            raise TypeError(
                f"LLGuidanceFilter: tokenizer {type(tokenizer).__name__} has neither a tokenizers object "
                f"(.tk) nor get_vocab_bytes(); pass an exl3_core Tokenizer"
            )
        return llg.LLTokenizer(llg.TokenizerWrapper(_BytesVocab(tokenizer)), n_vocab=n_vocab, eos_token=eos)

    return cached_per_tokenizer(tokenizer, ("llguidance", n_vocab), build)


def _grammar(llg: Any, kind: str, value: Any) -> str:
    """The llguidance grammar (a JSON string) for one constraint argument."""
    M = llg.LLMatcher
    try:
        if kind == "json_schema":
            if not isinstance(value, (str, Mapping)):
                raise TypeError(f"json_schema must be a dict or a JSON string, not {type(value).__name__}")
            return str(M.grammar_from_json_schema(dict(value) if isinstance(value, Mapping) else value))
        if kind == "regex":
            return str(M.grammar_from_regex(str(value)))
        if kind == "lark":
            return str(M.grammar_from_lark(str(value)))
        # raw llguidance grammar: {"grammars": [...]} as a dict or its JSON text
        return json.dumps(value) if isinstance(value, Mapping) else str(value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"LLGuidanceFilter: invalid {kind}: {e}") from e


class LLGuidanceFilter(Filter):
    """Constrain generation with llguidance.

    :param tokenizer: an exl3_core ``Tokenizer`` (or anything with ``get_vocab_bytes()`` and
        ``eos_token_ids``).
    :param json_schema: a JSON schema (dict or JSON text).
    :param regex: a regular expression the whole output must match (Rust ``regex`` syntax).
    :param lark: a grammar in llguidance's Lark dialect (``start:`` rule first).
    :param grammar: a raw llguidance grammar, e.g. ``{"grammars": [{"lark_grammar": "..."}]}``.
    :param n_vocab: model vocabulary size when it exceeds the tokenizer's (padded embedding).
    :param log_level: llguidance's own verbosity (0 silent, 1 warnings, 2 verbose).

    Exactly one of ``json_schema``, ``regex``, ``lark``, ``grammar``. An invalid one raises
    ``ValueError`` here, with llguidance's message.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        json_schema: Mapping[str, Any] | str | None = None,
        regex: str | None = None,
        lark: str | None = None,
        grammar: Mapping[str, Any] | str | None = None,
        n_vocab: int | None = None,
        log_level: int = 0,
    ) -> None:
        super().__init__(tokenizer)
        llg = _import_llguidance()
        self._np = llg.numpy
        kind, value = one_constraint(
            "LLGuidanceFilter", json_schema=json_schema, regex=regex, lark=lark, grammar=grammar
        )
        if n_vocab is not None and n_vocab < tokenizer_vocab_size(tokenizer):
            raise ValueError(
                f"LLGuidanceFilter: n_vocab={n_vocab} is smaller than the tokenizer's "
                f"{tokenizer_vocab_size(tokenizer)} tokens; pass the model's vocabulary size or None"
            )
        self.kind = kind
        self.ll_tokenizer = ll_tokenizer(tokenizer, n_vocab)
        self.grammar = _grammar(llg, kind, value)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(self.grammar, self.ll_tokenizer)
        if is_error:
            raise ValueError(
                f"LLGuidanceFilter: invalid {kind}: {messages[0] if messages else 'rejected by llguidance'}"
            )
        self._matcher = llg.LLMatcher(self.ll_tokenizer, self.grammar, log_level=log_level)
        if self._matcher.is_error():  # validation passed but construction did not (resource limits, ...)
            raise ValueError(f"LLGuidanceFilter: invalid {kind}: {self._matcher.get_error()}")
        self.vocab_size = int(self.ll_tokenizer.vocab_size)

    # -- Filter contract ------------------------------------------------------------------------
    def reset(self) -> None:
        self._matcher.reset()

    def accept_token(self, token: int) -> None:
        # check first: a refused consume_token leaves the matcher in a permanent error state
        if self._matcher.validate_tokens([int(token)]) != 1:
            raise ValueError(
                f"LLGuidanceFilter: token {int(token)} is not allowed here by the {self.kind} "
                f"({self._matcher.get_error() or 'outside the mask'}); sample from the filter's mask"
            )
        if not self._matcher.consume_token(int(token)):
            raise RuntimeError(
                f"LLGuidanceFilter: llguidance failed on token {int(token)}: {self._matcher.get_error()}"
            )

    def get_next_logit_mask(self) -> torch.Tensor:
        bits = self._np.allocate_token_bitmask(1, self.vocab_size)
        self._np.fill_next_token_bitmask(self._matcher, bits)
        if self._matcher.is_error():
            raise RuntimeError(
                f"LLGuidanceFilter: llguidance error while computing the mask: {self._matcher.get_error()}"
            )
        return torch.from_numpy(bits[0])

    def is_completed(self) -> bool:
        # stopped = nothing but EOS can follow (the constraint is fully generated)
        return bool(self._matcher.is_stopped())

    def rollback_tokens(self, n: int) -> bool:
        return bool(self._matcher.rollback(int(n)))

    def use_background_worker(self) -> bool:
        return True

    # -- extras ---------------------------------------------------------------------------------
    def is_accepting(self) -> bool:
        """True when the output so far already satisfies the constraint (EOS would be allowed)."""
        return bool(self._matcher.is_accepting())

    def __repr__(self) -> str:
        return f"LLGuidanceFilter({self.kind}, vocab={self.vocab_size}, tokens={len(self.journal)})"
