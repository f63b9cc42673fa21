"""``FormatronFilter``: JSON schema / regex / custom ``FormatterBuilder`` formats through Formatron.

Uses Formatron's core (``FormatterBuilder`` -> ``Formatter`` over a kbnf ``Engine``), not its
framework integrations: the engine vocabulary is built straight from the exl3 tokenizer's token
bytes. kbnf cannot undo tokens, so rewinds replay the journal (the base class does it when
:meth:`FormatronFilter.rollback_tokens` returns False).

Formatron finishes a generation when its grammar admits no further byte (a JSON value's closing
brace, the end of a bounded regex); an open-ended pattern such as ``[0-9]+`` never completes by
itself, so prefer ``LLGuidanceFilter`` for those (it allows EOS once the pattern is satisfied).
"""

from __future__ import annotations

import sys
import threading
import typing as _std_typing
from collections.abc import Mapping
from typing import Any

import torch

from exl3_core.filters.base import Filter
from exl3_filters._util import cached_per_tokenizer, eos_ids, one_constraint, tokenizer_vocab_size

# Formatron 0.5.0 does ``from pydantic import typing`` and uses it as the standard ``typing``
# module: older pydantic exposed the stdlib module under that name, pydantic >= 2.12 resolves it
# to its own v1-migration stub (formatron issue #35). During formatron's first import only, the
# name points at the stdlib module, as it used to.
_import_lock = threading.Lock()


def _import_formatron() -> tuple[Any, Any, Any]:
    """``(FormatterBuilder, create_schema, kbnf)``."""
    with _import_lock:
        if "formatron.formatter" not in sys.modules:
            try:
                import pydantic
            except ImportError as e:
                raise ImportError("FormatronFilter needs formatron: pip install formatron==0.5.0") from e
            missing = object()
            saved = pydantic.__dict__.get("typing", missing)
            pydantic.typing = _std_typing  # type: ignore[attr-defined]
            try:
                import formatron.formatter
                import formatron.schemas.json_schema  # noqa: F401
            except ImportError as e:
                raise ImportError(
                    "FormatronFilter needs formatron: pip install formatron==0.5.0 kbnf==0.4.2"
                ) from e
            finally:
                if saved is missing:
                    del pydantic.typing  # type: ignore[attr-defined]
                else:
                    pydantic.typing = saved  # type: ignore[attr-defined]
    import kbnf
    from formatron.formatter import FormatterBuilder
    from formatron.schemas.json_schema import create_schema

    return FormatterBuilder, create_schema, kbnf


def engine_vocabulary(tokenizer: Any) -> Any:
    """The (cached) ``kbnf.Vocabulary`` of an exl3 tokenizer: every ordinary token as its raw bytes.

    Special tokens (chat markers, EOS, ...) are left out, so a format never allows them; an
    empty-bytes token could never advance a grammar and is left out too.
    """
    _, _, kbnf = _import_formatron()

    def build() -> Any:
        vocab_bytes = tokenizer.get_vocab_bytes()
        special = set(getattr(tokenizer, "special_token_ids", None) or ()) | set(eos_ids(tokenizer))
        piece = getattr(tokenizer, "id_to_piece", None)
        tokens = {i: kbnf.Token(b) for i, b in enumerate(vocab_bytes) if b and i not in special}
        # the id -> string table is only used for kbnf's debug output
        strings = {
            i: (piece(i) if piece is not None else None) or b.decode("utf-8", "replace")
            for i, b in enumerate(vocab_bytes)
        }
        return kbnf.Vocabulary(tokens, strings)

    return cached_per_tokenizer(tokenizer, ("kbnf",), build)


_DEFAULT_ID = "https://exl3.invalid/filters/schema.json"
_DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _reject_numeric_bounds(node: Any, where: str) -> None:
    """Formatron 0.5.0 turns numeric bounds into a wrong pattern (only a bound of 0 is looked at,
    the others are dropped, and ``minimum: 0`` loses its whitespace grouping): refuse them rather
    than generate JSON that fails the schema."""
    if isinstance(node, Mapping):
        bad = [k for k in _BOUNDS if k in node]
        if bad:
            raise ValueError(
                f"numeric bound(s) {', '.join(bad)} at {where} are not enforced correctly by formatron "
                f"0.5.0; remove them or use LLGuidanceFilter, which supports them"
            )
        for k, v in node.items():
            if k not in ("enum", "const", "default", "examples"):  # literal values, not subschemas
                _reject_numeric_bounds(v, f"{where}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _reject_numeric_bounds(v, f"{where}/{i}")


def _schema_dict(value: Any) -> dict[str, Any]:
    import json

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from e
    if not isinstance(value, Mapping):
        raise TypeError(f"json_schema must be a JSON object (dict), not {type(value).__name__}")
    schema = dict(value)
    _reject_numeric_bounds(schema, "#")
    # formatron resolves $ref against $id and insists on both keys; give anonymous schemas some
    schema.setdefault("$id", _DEFAULT_ID)
    schema.setdefault("$schema", _DRAFT_2020_12)
    return schema


class FormatronFilter(Filter):
    """Constrain generation with Formatron.

    :param tokenizer: an exl3_core ``Tokenizer`` (anything with ``get_vocab_bytes()``, ``decode``
        and ``eos_token_ids``).
    :param json_schema: a JSON schema (dict or JSON text) whose root type is object or array.
        Formatron supports a subset of JSON Schema (see its ``create_schema``); additional
        properties are never generated.
    :param regex: a regular expression the output must match.
    :param formatter_builder: a ``formatron.formatter.FormatterBuilder`` describing the format
        (text, captures, several extractors); it is built against this tokenizer.
    :param n_vocab: model vocabulary size when it exceeds the tokenizer's (padded embedding); the
        extra ids are never allowed.

    Exactly one of the three. An invalid one raises ``ValueError`` here with Formatron's message.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        json_schema: Mapping[str, Any] | str | None = None,
        regex: str | None = None,
        formatter_builder: Any = None,
        n_vocab: int | None = None,
    ) -> None:
        super().__init__(tokenizer)
        FormatterBuilder, create_schema, _ = _import_formatron()
        kind, value = one_constraint(
            "FormatronFilter", json_schema=json_schema, regex=regex, formatter_builder=formatter_builder
        )
        self.kind = kind
        try:
            if kind == "formatter_builder":
                if not isinstance(value, FormatterBuilder):
                    raise TypeError(
                        f"formatter_builder must be a formatron FormatterBuilder, not {type(value).__name__}"
                    )
                builder = value
            else:
                builder = FormatterBuilder()
                if kind == "json_schema":
                    extractor = builder.json(create_schema(_schema_dict(value)), capture_name="json")
                else:
                    extractor = builder.regex(str(value), capture_name="regex")
                builder.append_str(f"{extractor}")
            # building compiles the grammar: kbnf rejects bad regexes / grammars here
            self._formatter = builder.build(engine_vocabulary(tokenizer), self._decode)
        except Exception as e:
            raise ValueError(f"FormatronFilter: invalid {kind}: {type(e).__name__}: {e}") from e
        self.vocab_size = tokenizer_vocab_size(tokenizer)
        if n_vocab is not None:
            if n_vocab < self.vocab_size:
                raise ValueError(
                    f"FormatronFilter: n_vocab={n_vocab} is smaller than the tokenizer's {self.vocab_size} tokens; "
                    f"pass the model's vocabulary size or None"
                )
            self.vocab_size = n_vocab
        self._words = (self.vocab_size + 31) // 32
        self._eos = [t for t in eos_ids(tokenizer) if 0 <= t < self.vocab_size]

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(list(ids)))

    @property
    def formatter(self) -> Any:
        """The underlying ``formatron.formatter.Formatter`` (captures, grammar_str)."""
        return self._formatter

    @property
    def captures(self) -> dict[str, Any] | None:
        """Formatron's extracted values once the format completed (``"json"`` / ``"regex"`` keys)."""
        return self._formatter.captures  # type: ignore[no-any-return]

    # -- Filter contract ------------------------------------------------------------------------
    def reset(self) -> None:
        self._formatter.reset()

    def accept_token(self, token: int) -> None:
        if self._formatter.is_completed():
            raise ValueError(
                f"FormatronFilter: token {int(token)} fed after the {self.kind} completed; stop generating "
                f"when is_completed() is True"
            )
        kbnf = sys.modules["kbnf"]
        try:
            result = self._formatter.accept_token(int(token))
        except Exception as e:
            # kbnf claims a refused token leaves the engine untouched, but a multi-byte token refused
            # part-way (e.g. a string outgrowing maxLength) does advance it: rebuild the state
            self._rebuild(list(self.journal))
            raise ValueError(
                f"FormatronFilter: token {int(token)} is not allowed here by the {self.kind} ({e}); "
                f"sample from the filter's mask"
            ) from e
        if result not in (kbnf.AcceptTokenResult.Ongoing, kbnf.AcceptTokenResult.Finished):
            raise ValueError(f"FormatronFilter: token {int(token)} refused by the {self.kind}: {result}")

    def get_next_logit_mask(self) -> torch.Tensor:
        if self._formatter.is_completed():
            # nothing more to generate: allow only EOS so a caller that does not check is_completed stops
            allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
            allowed[self._eos] = True
            return allowed
        self._formatter.compute_allowed_tokens()
        engine = self._formatter._engine  # Formatter exposes no public handle to its kbnf Engine
        if not hasattr(engine, "fill_torch_bitmask"):  # older kbnf: build the mask from the id list
            allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
            ids = [
                t for t in self._formatter.get_allowed_tokens_since_last_computation() if t < self.vocab_size
            ]
            allowed[ids] = True
            return allowed
        # kbnf writes the packed u32 layout of unpack_bitmask; its docs ask for a buffer of
        # vocab_size u32s, so allocate that much and hand back the ceil(V/32) words that matter
        buf = torch.zeros(max(self.vocab_size, self._words), dtype=torch.int32)
        engine.fill_torch_bitmask(buf.data_ptr())
        return buf[: self._words].clone()

    def is_completed(self) -> bool:
        return bool(self._formatter.is_completed())

    def rollback_tokens(self, n: int) -> bool:
        return False  # kbnf has no undo: the base class resets and replays the journal

    def use_background_worker(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"FormatronFilter({self.kind}, vocab={self.vocab_size}, tokens={len(self.journal)})"
