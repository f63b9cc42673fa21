"""Rebuild an HF ``tokenizer.json`` (plus its configs) from a GGUF file's ``tokenizer.*`` metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, the merges, token types and
special ids as metadata, and names the pre-tokenizer (``tokenizer.ggml.pre``) instead of storing
its regex. The recipes below rebuild the ``tokenizers`` pipeline those names stand for. Which
llama.cpp ``pre`` name maps to which recipe is model-family knowledge, so it comes from the GGUF
adapters in the architecture plugins (``GGUFAdapter.pretokenizers``); only the family-neutral
names live here.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from exl3_core.tokenizer.vocab import SPM_SPACE, byte_level_spell, is_byte_level_spelling

log = logging.getLogger("exl3.convert")

# llama.cpp token types (llama_token_type / gguf.TokenType)
TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = 1, 2, 3, 4, 5, 6


class PreTokenizerRecipe(NamedTuple):
    """How a byte-level BPE vocabulary splits text before merging.

    :param split: regex splitting the text (None: ByteLevel's built-in GPT-2 regex).
    :param digits: split every digit off on its own first (``Digits(individual_digits=True)``).
    :param nfc: NFC-normalize the text first.
    :param ignore_merges: a pre-token that is itself in the vocabulary is taken whole.
    """

    split: str | None = None
    digits: bool = False
    nfc: bool = False
    ignore_merges: bool = False


# Family-neutral split patterns (they describe the regex, not a model).
_SPLIT_DIGITS3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_DIGITS1 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: Recipes adapters may name in ``GGUFAdapter.pretokenizers`` (llama.cpp pre name -> recipe key).
RECIPES: dict[str, PreTokenizerRecipe] = {
    "bytelevel": PreTokenizerRecipe(),
    "bytelevel-digits": PreTokenizerRecipe(digits=True),
    "split-digits3": PreTokenizerRecipe(split=_SPLIT_DIGITS3, ignore_merges=True),
    "split-digits1": PreTokenizerRecipe(split=_SPLIT_DIGITS1),
    "split-digits1-nfc": PreTokenizerRecipe(split=_SPLIT_DIGITS1, nfc=True),
}

#: llama.cpp pre names that belong to no model family.
GENERIC_PRETOKENIZERS: dict[str, str] = {"default": "bytelevel", "gpt-2": "bytelevel", "gpt2": "bytelevel"}


def _special_ids(md: Mapping[str, Any]) -> dict[str, int | None]:
    g = md.get
    return {
        "bos": g("tokenizer.ggml.bos_token_id"),
        "eos": g("tokenizer.ggml.eos_token_id"),
        "unk": g("tokenizer.ggml.unknown_token_id"),
        "pad": g("tokenizer.ggml.padding_token_id"),
    }


def _byte_level_bpe(md: Mapping[str, Any], recipe: PreTokenizerRecipe) -> Tokenizer:
    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
    types: list[int] = list(md.get("tokenizer.ggml.token_type") or [TT_NORMAL] * len(tokens))
    merges_raw: list[str] = list(md.get("tokenizer.ggml.merges") or [])
    if not merges_raw:
        raise ValueError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges; cannot rebuild it")
    vocab: dict[str, int] = {}
    for i, (tok, tt) in enumerate(zip(tokens, types)):
        # Normal pieces must be spelled in the byte alphabet for BPE to find them; a few converters
        # store them raw. Control/user tokens are matched whole on raw text, so they stay as written.
        if tt in (TT_NORMAL, TT_UNUSED, TT_BYTE) and not is_byte_level_spelling(tok):
            tok = byte_level_spell(tok)
        vocab.setdefault(tok, i)
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=recipe.ignore_merges))  # type: ignore[arg-type]
    if recipe.nfc:
        tk.normalizer = normalizers.NFC()
    steps: list[Any] = []
    if recipe.digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if recipe.split is not None:
        steps.append(pre_tokenizers.Split(Regex(recipe.split), behavior="isolated", invert=False))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=recipe.split is None))
    tk.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    return tk


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a scored SentencePiece vocabulary: a token splits into two known pieces,
    and merges rank by the merged token's score (higher first), then by the pieces' ids."""
    ids = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, str, str]] = []
    for tok, score in zip(tokens, scores):
        for k in range(1, len(tok)):
            a, b = tok[:k], tok[k:]
            if a in ids and b in ids:
                found.append((-score, ids[a], ids[b], a, b))
    found.sort()
    return [(a, b) for _, _, _, a, b in found]


def _spm_bpe(md: Mapping[str, Any]) -> Tokenizer:
    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
    scores: list[float] = list(md.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges_raw = md.get("tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in merges_raw] if merges_raw else _spm_merges(tokens, scores)
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))  # type: ignore[arg-type]
    prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    norm: list[Any] = [normalizers.Prepend(SPM_SPACE)] if prefix else []
    norm.append(normalizers.Replace(" ", SPM_SPACE))
    tk.normalizer = normalizers.Sequence(norm)
    dec: list[Any] = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Sequence(dec)
    return tk


def build_tokenizer(md: Mapping[str, Any], pretokenizers: Mapping[str, str] | None = None) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` equivalent to the one the GGUF metadata describes.

    :param md: GGUF metadata (``tokenizer.ggml.*`` keys).
    :param pretokenizers: llama.cpp pre name -> key of :data:`RECIPES`, from the adapter.
    """
    kind = md.get("tokenizer.ggml.model")
    if kind == "gpt2":
        pre = str(md.get("tokenizer.ggml.pre", "default"))
        table = {**GENERIC_PRETOKENIZERS, **(pretokenizers or {})}
        key = table.get(pre)
        if key is None:
            log.warning("GGUF tokenizer.ggml.pre=%r is unknown to the architecture's adapter; splitting text "
                        "with the plain byte-level regex (token ids may differ on digits/whitespace)", pre)
            key = "bytelevel"
        if key not in RECIPES:
            raise ValueError(f"GGUF adapter maps pre-tokenizer {pre!r} to {key!r}, which is not a recipe; "
                             f"choose one of {', '.join(RECIPES)}")
        tk = _byte_level_bpe(md, RECIPES[key])
    elif kind == "llama":
        tk = _spm_bpe(md)
    else:
        raise ValueError(f"GGUF tokenizer.ggml.model={kind!r} is not supported; supported: 'gpt2' (byte-level BPE), "
                         f"'llama' (SentencePiece BPE)")

    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
    types: list[int] = list(md.get("tokenizer.ggml.token_type") or [TT_NORMAL] * len(tokens))
    special_ids = {v for v in _special_ids(md).values() if v is not None}
    specials, plain = [], []
    for i, (tok, tt) in enumerate(zip(tokens, types)):
        # Control tokens and the declared special ids are matched whole and skipped by
        # skip_special_tokens; user-defined ones are matched whole but decode as text.
        if tt == TT_CONTROL or (i in special_ids and tt != TT_BYTE):
            specials.append(AddedToken(tok, special=True, normalized=False))
        elif tt == TT_USER_DEFINED:
            plain.append(AddedToken(tok, special=False, normalized=False))
    if specials:
        tk.add_special_tokens(specials)
    if plain:
        tk.add_tokens(plain)
    _set_template_processor(tk, md, tokens)
    if tk.get_vocab_size(with_added_tokens=True) != len(tokens):
        log.warning("rebuilt tokenizer has %d tokens, the GGUF lists %d (duplicate pieces in the vocabulary)",
                    tk.get_vocab_size(with_added_tokens=True), len(tokens))
    return tk


def _set_template_processor(tk: Tokenizer, md: Mapping[str, Any], tokens: list[str]) -> None:
    """Make tokenizer.json itself add BOS/EOS when the GGUF says so: transformers' generic fast
    tokenizer ignores ``add_bos_token`` and does only what the post-processor does."""
    ids = _special_ids(md)
    default_bos = md.get("tokenizer.ggml.model") == "llama"  # llama.cpp's default for SentencePiece vocabs
    bos = ids["bos"] if md.get("tokenizer.ggml.add_bos_token", default_bos) else None
    eos = ids["eos"] if md.get("tokenizer.ggml.add_eos_token", False) else None
    if bos is None and eos is None:
        return
    pre = [f"{tokens[bos]}:0"] if bos is not None else []
    post = [f"{tokens[eos]}:0"] if eos is not None else []
    single = " ".join([*pre, "$A:0", *post])
    pair = " ".join([*pre, "$A:0", *post, *(p.replace(":0", ":1") for p in pre), "$B:1", *(p.replace(":0", ":1") for p in post)])
    specials = [(tokens[i], i) for i in dict.fromkeys(x for x in (bos, eos) if x is not None)]
    template = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    tk.post_processor = template if tk.post_processor is None else processors.Sequence([tk.post_processor, template])


def tokenizer_files(md: Mapping[str, Any], tk: Tokenizer, context_length: int | None) -> dict[str, dict[str, Any]]:
    """``tokenizer_config.json`` and ``special_tokens_map.json`` contents for the rebuilt tokenizer."""
    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
    names = {k: (tokens[v] if v is not None and 0 <= v < len(tokens) else None) for k, v in _special_ids(md).items()}
    added: dict[str, dict[str, Any]] = {}
    for tid, tok in sorted(tk.get_added_tokens_decoder().items()):
        added[str(tid)] = {"content": tok.content, "lstrip": tok.lstrip, "normalized": tok.normalized,
                           "rstrip": tok.rstrip, "single_word": tok.single_word, "special": tok.special}
    default_bos = md.get("tokenizer.ggml.model") == "llama"  # llama.cpp's default for SentencePiece vocabs
    cfg: dict[str, Any] = {
        "add_bos_token": bool(md.get("tokenizer.ggml.add_bos_token", default_bos)),
        "add_eos_token": bool(md.get("tokenizer.ggml.add_eos_token", False)),
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    smap: dict[str, Any] = {}
    for k in ("bos", "eos", "unk", "pad"):
        if names[k] is not None:
            cfg[f"{k}_token"] = names[k]
            smap[f"{k}_token"] = {"content": names[k], "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False}
    if context_length:
        cfg["model_max_length"] = int(context_length)
    tmpl = md.get("tokenizer.chat_template")
    if tmpl:
        cfg["chat_template"] = tmpl
    return {"tokenizer_config.json": cfg, "special_tokens_map.json": smap}


def write_tokenizer(md: Mapping[str, Any], out_dir: Path, pretokenizers: Mapping[str, str] | None = None,
                    context_length: int | None = None) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``out_dir``."""
    tk = build_tokenizer(md, pretokenizers)
    tk.save(str(out_dir / "tokenizer.json"))
    for name, content in tokenizer_files(md, tk, context_length).items():
        (out_dir / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
