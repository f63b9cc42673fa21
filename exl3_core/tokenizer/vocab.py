"""Token pieces -> raw bytes, for the two spellings tokenizers use.

Byte-level BPE (GPT-2 style) writes every byte as one printable character: bytes that are already
printable Latin-1 stand for themselves, the remaining 68 bytes are shifted to U+0100 and up in
byte order. SentencePiece-style vocabularies write a space as U+2581 and spell bytes that have no
token of their own as ``<0xNN>`` byte-fallback tokens.
"""
from __future__ import annotations

import functools
import re

#: SentencePiece's stand-in for a space.
SPM_SPACE = "\u2581"

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.cache
def byte_to_char() -> dict[int, str]:
    """The byte-level alphabet: byte value -> the character that spells it."""
    # Printable ranges keep their code point: '!'..'~', '¡'..'¬', '®'..'ÿ'.
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + shifted)
            shifted += 1
    return out


@functools.cache
def char_to_byte() -> dict[str, int]:
    """Inverse of :func:`byte_to_char`."""
    return {c: b for b, c in byte_to_char().items()}


def is_byte_level_spelling(piece: str) -> bool:
    """True when every character of ``piece`` belongs to the byte-level alphabet."""
    table = char_to_byte()
    return all(c in table for c in piece)


def byte_level_spell(text: str) -> str:
    """Spell the UTF-8 bytes of ``text`` in the byte-level alphabet."""
    table = byte_to_char()
    return "".join(table[b] for b in text.encode("utf-8"))


def byte_level_piece_bytes(piece: str) -> bytes:
    """Raw bytes of a byte-level piece; characters outside the alphabet pass through as UTF-8."""
    table = char_to_byte()
    out = bytearray()
    for c in piece:
        b = table.get(c)
        if b is None:
            out += c.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def spm_piece_bytes(piece: str) -> bytes:
    """Raw bytes of a SentencePiece piece: ``<0xNN>`` is one byte, U+2581 is a space."""
    m = _BYTE_TOKEN.match(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace(SPM_SPACE, " ").encode("utf-8")
