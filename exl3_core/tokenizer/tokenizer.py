"""The tokenizer: a ``tokenizers.Tokenizer`` plus what the HF config files say about it.

Reads ``tokenizer.json`` and, where present, ``tokenizer_config.json``, ``special_tokens_map.json``,
``chat_template.jinja``, ``generation_config.json`` and ``config.json``. Special tokens resolve the
way transformers resolves them: the token strings in tokenizer_config / special_tokens_map first,
ids from generation_config / config.json when no string is given. Every EOS id any of the files
names ends up in :attr:`Tokenizer.eos_token_ids` (generation stops on all of them).
"""
from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from exl3_core.tokenizer import chat as _chat
from exl3_core.tokenizer.vocab import byte_level_piece_bytes, spm_piece_bytes

_SPECIAL_NAMES = ("bos", "eos", "pad", "unk", "sep", "cls", "mask")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must contain a JSON object")  # noqa: TRY004 - file content
    return data


def _token_str(value: Any) -> str | None:
    """A special-token entry may be a string or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def _strings(value: Any) -> list[str]:
    """Every string inside a message field (content may be a string or a list of parts)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


class Tokenizer:
    """Encode/decode text, render chat templates and describe the vocabulary.

    :param tokenizer: the ``tokenizers.Tokenizer``.
    :param tokenizer_config: tokenizer_config.json contents.
    :param special_tokens_map: special_tokens_map.json contents.
    :param generation_config: generation_config.json contents.
    :param model_config: config.json contents.
    :param chat_template: overrides tokenizer_config's ``chat_template`` (e.g. chat_template.jinja).
    """

    def __init__(self, tokenizer: Any, *, tokenizer_config: Mapping[str, Any] | None = None,
                 special_tokens_map: Mapping[str, Any] | None = None,
                 generation_config: Mapping[str, Any] | None = None, model_config: Mapping[str, Any] | None = None,
                 chat_template: str | Mapping[str, str] | None = None, directory: Path | None = None) -> None:
        self.tk = tokenizer
        self.directory = directory
        tc = dict(tokenizer_config or {})
        stm = dict(special_tokens_map or {})
        gen = dict(generation_config or {})
        mc = dict(model_config or {})
        self.tokenizer_config = tc

        # -- special tokens --
        self._special: dict[str, tuple[str | None, int | None]] = {}
        for name in _SPECIAL_NAMES:
            s = _token_str(tc.get(f"{name}_token")) or _token_str(stm.get(f"{name}_token"))
            tid = self.tk.token_to_id(s) if s is not None else None
            if tid is None and s is None:
                fallback = _ids(gen.get(f"{name}_token_id")) or _ids(mc.get(f"{name}_token_id"))
                if fallback:
                    tid = fallback[0]
                    s = self.tk.id_to_token(tid)
            self._special[name] = (s, tid)
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids: list[int] = list(dict.fromkeys(
            eos + _ids(gen.get("eos_token_id")) + _ids(mc.get("eos_token_id"))))

        # -- BOS policy: explicit flag wins, else whatever tokenizer.json's post-processor does --
        flag = tc.get("add_bos_token")
        if isinstance(flag, bool):
            self.add_bos_token = flag
        else:
            self.add_bos_token = self._post_processor_adds_bos()

        # -- chat template --
        if chat_template is None:
            chat_template = tc.get("chat_template")
            if isinstance(chat_template, list):  # [{"name": ..., "template": ...}, ...] as HF saves several
                chat_template = {t["name"]: t["template"] for t in chat_template}
        self.chat_template: str | Mapping[str, str] | None = chat_template

        self._split_specials: Any = None
        self._continuation: Any = None
        self._vocab_bytes: list[bytes] | None = None
        self._decoder_kind: str | None = None

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_directory(cls, path: str | Path) -> Tokenizer:
        """Load from a model folder holding ``tokenizer.json`` (and optional config files)."""
        from tokenizers import Tokenizer as _TK

        d = Path(path)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            if (d / "tokenizer.model").is_file():
                fix = ("it has only tokenizer.model (SentencePiece); write tokenizer.json next to it with "
                       "transformers: "
                       f"AutoTokenizer.from_pretrained('{d}').save_pretrained('{d}')")
            else:
                fix = ("copy tokenizer.json (and tokenizer_config.json) from the original model's folder or Hugging "
                       "Face repository into it, or save one there with transformers: "
                       f"AutoTokenizer.from_pretrained('<original model>').save_pretrained('{d}')")
            raise FileNotFoundError(f"no tokenizer.json in {d}: {fix}")
        tmpl: str | Mapping[str, str] | None = None
        jinja = d / "chat_template.jinja"
        if jinja.is_file():
            tmpl = jinja.read_text(encoding="utf-8")
        elif (ct := _read_json(d / "chat_template.json").get("chat_template")) is not None:
            tmpl = ct
        return cls(_TK.from_file(str(tj)), tokenizer_config=_read_json(d / "tokenizer_config.json"),
                   special_tokens_map=_read_json(d / "special_tokens_map.json"),
                   generation_config=_read_json(d / "generation_config.json"),
                   model_config=_read_json(d / "config.json"), chat_template=tmpl, directory=d)

    @classmethod
    def from_config(cls, config: Any) -> Tokenizer:
        """Load from the folder of a model config object (anything with a ``directory`` attribute)."""
        directory = getattr(config, "directory", None)
        if directory is None:
            raise TypeError(f"{type(config).__name__} has no 'directory' attribute to load a tokenizer from")
        return cls.from_directory(directory)

    # -- special tokens ----------------------------------------------------------------------
    def _tok(self, name: str) -> str | None:
        return self._special[name][0]

    def _id(self, name: str) -> int | None:
        return self._special[name][1]

    bos_token = property(lambda self: self._tok("bos"))
    eos_token = property(lambda self: self._tok("eos"))
    pad_token = property(lambda self: self._tok("pad"))
    unk_token = property(lambda self: self._tok("unk"))
    bos_token_id = property(lambda self: self._id("bos"))
    eos_token_id = property(lambda self: self._id("eos"))
    pad_token_id = property(lambda self: self._id("pad"))
    unk_token_id = property(lambda self: self._id("unk"))

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """``{"bos_token": "<s>", ...}`` for the special tokens that are set (chat-template variables)."""
        return {f"{n}_token": s for n, (s, _) in self._special.items() if s is not None}

    @property
    def special_token_ids(self) -> set[int]:
        """Ids of every added token marked special."""
        return {i for i, t in self.tk.get_added_tokens_decoder().items() if t.special}

    def _post_processor_adds_bos(self) -> bool:
        bos = self.bos_token_id
        if bos is None or self.tk.post_processor is None:
            return False
        with_special = self.tk.encode("a", add_special_tokens=True).ids
        plain = self.tk.encode("a", add_special_tokens=False).ids
        return len(with_special) > len(plain) and with_special[0] == bos

    # -- vocabulary --------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may be larger)."""
        return int(self.tk.get_vocab_size(with_added_tokens=True))

    def id_to_piece(self, token_id: int) -> str | None:
        """The vocabulary entry for ``token_id`` as stored (byte-level spelling, ``▁`` etc.)."""
        return self.tk.id_to_token(int(token_id))

    def piece_to_id(self, piece: str) -> int | None:
        """Id of a vocabulary entry, or None."""
        return self.tk.token_to_id(piece)

    def single_id(self, text: str) -> int:
        """The id of ``text`` if it encodes to exactly one token (special tokens allowed)."""
        tid = self.tk.token_to_id(text)
        if tid is not None:
            return int(tid)
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if len(ids) != 1:
            raise ValueError(f"{text!r} encodes to {len(ids)} tokens {ids}, not a single token")
        return int(ids[0])

    def _decoder_type(self) -> str:
        if self._decoder_kind is None:
            dec = json.loads(self.tk.to_str()).get("decoder") or {}
            parts = dec.get("decoders", [dec]) if dec.get("type") == "Sequence" else [dec]
            types = {p.get("type") for p in parts}
            if "ByteLevel" in types:
                self._decoder_kind = "bytelevel"
            elif types & {"ByteFallback", "Metaspace"} or any(
                    p.get("type") == "Replace" and p.get("pattern", {}).get("String") == "\u2581" for p in parts):
                self._decoder_kind = "spm"
            else:
                self._decoder_kind = "other"
        return self._decoder_kind

    def get_vocab_bytes(self) -> list[bytes]:
        """The raw bytes each token id stands for (index = id), for constrained-generation filters.

        Byte-level pieces are mapped back through the byte alphabet, SentencePiece pieces turn ``▁``
        into a space and ``<0xNN>`` into one byte; added tokens are their literal text.
        """
        if self._vocab_bytes is None:
            kind = self._decoder_type()
            added = self.tk.get_added_tokens_decoder()
            out: list[bytes] = []
            for i in range(self.vocab_size):
                if i in added:
                    out.append(added[i].content.encode("utf-8"))
                    continue
                piece = self.tk.id_to_token(i)
                if piece is None:
                    out.append(b"")
                elif kind == "bytelevel":
                    out.append(byte_level_piece_bytes(piece))
                elif kind == "spm":
                    out.append(spm_piece_bytes(piece))
                else:
                    out.append(self.tk.decode([i], skip_special_tokens=False).encode("utf-8"))
            self._vocab_bytes = out
        return self._vocab_bytes

    # -- encode / decode ---------------------------------------------------------------------
    def _encoder(self, encode_special_tokens: bool) -> Any:
        if encode_special_tokens:
            return self.tk
        if self._split_specials is None:
            from tokenizers import Tokenizer as _TK

            # tokenizers' flag means the opposite of ours: True = treat special tokens as text.
            self._split_specials = _TK.from_str(self.tk.to_str())
            self._split_specials.encode_special_tokens = True
        return self._split_specials

    def _continuation_encoder(self) -> Any:
        """The special-tokens-as-text encoder for text that does not start the input: a
        SentencePiece ``Metaspace`` pre-tokenizer that prepends "▁" only to the first section
        (``prepend_scheme: first``) must not prepend it here."""
        if self._continuation is None:
            from tokenizers import Tokenizer as _TK

            spec = json.loads(self.tk.to_str())

            def never_first(node: Any) -> None:
                if isinstance(node, dict):
                    if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                        node["prepend_scheme"] = "never"
                    for v in node.values():
                        never_first(v)
                elif isinstance(node, list):
                    for v in node:
                        never_first(v)

            never_first(spec.get("pre_tokenizer"))
            never_first(spec.get("normalizer"))
            self._continuation = _TK.from_str(json.dumps(spec))
            self._continuation.encode_special_tokens = True
        return self._continuation

    def _encode(self, encoder: Any, text: str) -> Any:
        try:
            return encoder.encode(text, add_special_tokens=False)
        except TypeError:
            bad = next((i for i, ch in enumerate(text) if 0xD800 <= ord(ch) <= 0xDFFF), None)
            if bad is None:
                raise
            raise ValueError(f"text holds a lone UTF-16 surrogate (U+{ord(text[bad]):04X} at character {bad}), "
                             f"which is not valid Unicode; send well-formed text") from None

    def encode_ids(self, text: str, add_bos: bool | None = None, encode_special_tokens: bool = True) -> list[int]:
        """Token ids of one string as a list (``ValueError`` for text that is not valid Unicode)."""
        ids = list(self._encode(self._encoder(encode_special_tokens), text).ids)
        if (self.add_bos_token if add_bos is None else add_bos):
            if self.bos_token_id is None:
                raise ValueError("add_bos=True but the tokenizer defines no BOS token")
            ids.insert(0, int(self.bos_token_id))
        return ids

    def encode(self, text: str | Sequence[str], add_bos: bool | None = None,
               encode_special_tokens: bool = True) -> torch.Tensor:
        """Encode text to a ``LongTensor [batch, seq]``.

        :param add_bos: prepend BOS; None follows the checkpoint (``add_bos_token`` or tokenizer.json).
        :param encode_special_tokens: special-token text like ``<|im_end|>`` becomes its id; False
            tokenizes it as ordinary text (for untrusted input).

        A batch is left-padded with the pad id (EOS, then 0, if there is none) to its longest row,
        so every row's last token sits in the last column.
        """
        if isinstance(text, str):
            return torch.tensor([self.encode_ids(text, add_bos, encode_special_tokens)], dtype=torch.long)
        rows = [self.encode_ids(t, add_bos, encode_special_tokens) for t in text]
        width = max((len(r) for r in rows), default=0)
        pad = next((p for p in (self.pad_token_id, self.eos_token_id) if p is not None), 0)
        out = torch.full((len(rows), width), int(pad), dtype=torch.long)
        for i, r in enumerate(rows):
            if r:
                out[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        return out

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str | list[str]:
        """Decode ids: an int or 1-D sequence/tensor gives a str, a 2-D one a list of str."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        if ids and isinstance(ids[0], (list, tuple)):
            return [self.tk.decode([int(i) for i in row], skip_special_tokens=skip_special_tokens) for row in ids]
        return str(self.tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens))

    # -- chat --------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[Any], add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: Sequence[Mapping[str, Any]] | None = None,
                            chat_template: str | None = None, **kwargs: Any) -> str | torch.Tensor:
        """Render ``messages`` with the checkpoint's chat template, as transformers does.

        :param tokenize: return ``encode(text, add_bos=False)`` instead of the text (templates
            write BOS themselves when they want it).
        :param chat_template: a template name (when the checkpoint has several) or template text.
        :param kwargs: extra template variables (``documents``, ``enable_thinking``, ...).
        """
        template = _chat.select_template(self.chat_template, chat_template, tools)
        text = _chat.render(template, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                            special_tokens=self.special_tokens_map, **kwargs)
        if tokenize:
            return self.encode(text, add_bos=False)
        return text

    def chat_roles(self, chat_template: str | None = None) -> frozenset[str]:
        """The message roles the chat template knows (see :func:`~exl3_core.tokenizer.chat.template_roles`)."""
        return _chat.template_roles(_chat.select_template(self.chat_template, chat_template))

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
                    special_in_content: bool = False, **kwargs: Any) -> list[int]:
        """Render ``messages`` with the chat template and tokenize the result (no BOS added: templates
        write it), keeping text that spells a special token *inside a message's content* as plain text,
        so a user cannot open a turn by typing ``<|im_start|>system``. The template's own special
        tokens stay special, and a conversation without such text tokenizes exactly as
        ``encode(text, add_bos=False)``.

        :param special_in_content: encode special-token text in content as the special tokens (for
            trusted callers that write control tokens on purpose).
        :param kwargs: as :meth:`apply_chat_template`.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        assert isinstance(text, str)
        enc = self._encode(self.tk, text)
        ids = [int(i) for i in enc.ids]
        if special_in_content:
            return ids
        special = self.special_token_ids
        marks = self._special_text_re()
        if marks is None or not any(marks.search(s) for m in messages for s in _strings(m.get("content"))):
            return ids
        spans = self._content_spans(messages, text, add_generation_prompt, kwargs)
        offsets = enc.offsets
        inside = {k for k, t in enumerate(ids) if t in special
                  and any(a <= offsets[k][0] and offsets[k][1] <= b for a, b in spans)}
        if not inside:
            return ids
        # split the text at the special tokens that stay special; a section holding special-token
        # text from a message is tokenized again with special tokens as text, the others keep their ids
        out: list[int] = []
        start_tok = start_char = 0
        for k in [k for k, t in enumerate(ids) if t in special and k not in inside] + [len(ids)]:
            end_char = offsets[k][0] if k < len(ids) else len(text)
            if any(start_tok <= j < k for j in inside):
                enc_ = self._encoder(False) if start_char == 0 else self._continuation_encoder()
                out += [int(i) for i in self._encode(enc_, text[start_char:end_char]).ids]
            else:
                out += ids[start_tok:k]
            if k < len(ids):
                out.append(ids[k])
                start_tok, start_char = k + 1, offsets[k][1]
        return out

    def _special_text_re(self) -> re.Pattern[str] | None:
        texts = sorted({t.content for t in self.tk.get_added_tokens_decoder().values() if t.special and t.content},
                       key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts))) if texts else None

    def _content_spans(self, messages: Sequence[Mapping[str, Any]], text: str, add_generation_prompt: bool,
                       kwargs: dict[str, Any]) -> list[tuple[int, int]]:
        """Character spans of ``text`` (the rendered conversation) that are message content: found by
        rendering once more with a unique marker in place of each content string."""
        nonce = secrets.token_hex(8)
        marked: list[Mapping[str, Any]] = []
        contents: dict[str, str] = {}
        for i, m in enumerate(messages):
            c = m.get("content")
            if isinstance(c, str) and c:
                mark = f"\ue000{nonce}.{i}\ue001"
                contents[mark] = c
                m = {**m, "content": mark}
            elif _strings(c) and self._special_text_re().search("".join(_strings(c))):  # type: ignore[union-attr]
                raise ValueError(f"message {i}: special-token text in non-string content cannot be kept as text; "
                                 f"send the content as a string")
            marked.append(m)
        skeleton = self.apply_chat_template(marked, add_generation_prompt, **kwargs)
        assert isinstance(skeleton, str)
        parts = re.split("(" + "|".join(map(re.escape, contents)) + ")", skeleton)
        for strip in (False, True):  # templates that trim content (``| trim``) render it stripped
            spans: list[tuple[int, int]] = []
            pos = 0
            rebuilt = []
            for j, p in enumerate(parts):
                piece = (contents[p].strip() if strip else contents[p]) if j % 2 else p
                if j % 2:
                    spans.append((pos, pos + len(piece)))
                rebuilt.append(piece)
                pos += len(piece)
            if "".join(rebuilt) == text:
                return spans
        raise ValueError("the chat template rewrites message content, so the special-token text in it cannot be "
                         "kept as plain text; remove special-token text such as '<|...|>' from the messages")

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
                f"directory={str(self.directory) if self.directory else None!r})")
