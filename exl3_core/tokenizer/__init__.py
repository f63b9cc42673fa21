"""Tokenization: :class:`Tokenizer` (HF tokenizer.json + configs), chat templates, streaming decode."""
from __future__ import annotations

from exl3_core.tokenizer.chat import ChatTemplateError
from exl3_core.tokenizer.stream import StreamDecoder
from exl3_core.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatTemplateError", "StreamDecoder", "Tokenizer"]
