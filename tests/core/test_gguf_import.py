"""GGUF import: weights, config, tokenizer files and safety, against transformers' own GGUF loader.

Two kinds of model:
- tiny random GGUFs written here with ``gguf.GGUFWriter`` (F32/F16/Q8_0 tensors, GQA, Q/K stored in
  llama.cpp's permuted layout): compared bitwise in fp32 with the HF weights they were made from
  and with transformers' GGUF loader;
- the real default model, imported once per session in bf16 (smol_gguf.py): every tensor equals
  transformers' fp32 GGUF weights rounded to bf16, bit for bit, and the logits of the imported
  folder equal those of transformers' GGUF model with the same rounding applied.
"""
from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from smol_gguf import adapters, gguf_file, imported_model

from exl3_core.convert.cli import GGUF_DTYPES, add_cli
from exl3_core.convert.gguf_import import (
    IMPORT_MARKER,
    UnsupportedGGUFArchitecture,
    decoder_config,
    import_gguf,
    unpermute_qk,
)
from exl3_core.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")


def _load_dir(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _permute_like_llama_cpp(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp convert_hf_to_gguf: reshape(n_head, 2, d/2, ...) then swap axes 1 and 2.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# -- tiny GGUF writer --------------------------------------------------------------------------------

TINY = {"hidden": 64, "heads": 4, "kv": 2, "ff": 96, "layers": 2}


def _tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    from exl3_core.tokenizer.vocab import byte_to_char

    chars = [byte_to_char()[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r"]
    merged = ["Ġt", "he", "Ġthe", "in", "Ġa", "er"]
    tokens = ["<s>", "</s>", *chars, *merged]
    types = [3, 3] + [1] * (len(tokens) - 2)
    return tokens, types, merges


def write_tiny_gguf(path: Path, arch: str = "llama", *, permute: bool = True, bias: bool = False,
                    seed: int = 0) -> dict[str, torch.Tensor]:
    """Write a tiny random model as GGUF; return its HF-layout fp32 weights (before quantization)."""
    g = torch.Generator().manual_seed(seed)
    h, nh, nkv, ff, nl = TINY["hidden"], TINY["heads"], TINY["kv"], TINY["ff"], TINY["layers"]
    hd = h // nh
    tokens, types, merges = _tiny_vocab()
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(nl)
    w.add_context_length(128)
    w.add_embedding_length(h)
    w.add_feed_forward_length(ff)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}{{ bos_token }}{{ m['content'] }}{{ eos_token }}{% endfor %}")

    hf: dict[str, torch.Tensor] = {}

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    def put(gname: str, hfname: str, t: torch.Tensor, kind: str, n_head: int | None = None) -> None:
        hf[hfname] = t
        stored = _permute_like_llama_cpp(t, n_head) if (permute and n_head) else t
        a = stored.numpy().astype(np.float32)
        if kind == "q8":
            w.add_tensor(gname, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif kind == "f16":
            w.add_tensor(gname, a.astype(np.float16))
        else:
            w.add_tensor(gname, a)

    put("token_embd.weight", "model.embed_tokens.weight", rnd(vocab, h), "f16")
    put("output_norm.weight", "model.norm.weight", 1 + rnd(h), "f32")
    put("output.weight", "lm_head.weight", rnd(vocab, h), "q8")
    for i in range(nl):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        put(p + "attn_norm.weight", q + "input_layernorm.weight", 1 + rnd(h), "f32")
        put(p + "attn_q.weight", q + "self_attn.q_proj.weight", rnd(nh * hd, h), "f32", nh)
        put(p + "attn_k.weight", q + "self_attn.k_proj.weight", rnd(nkv * hd, h), "f32", nkv)
        put(p + "attn_v.weight", q + "self_attn.v_proj.weight", rnd(nkv * hd, h), "f16")
        if bias:
            put(p + "attn_q.bias", q + "self_attn.q_proj.bias", rnd(nh * hd), "f32", nh)
            put(p + "attn_k.bias", q + "self_attn.k_proj.bias", rnd(nkv * hd), "f32", nkv)
            put(p + "attn_v.bias", q + "self_attn.v_proj.bias", rnd(nkv * hd), "f32")
        put(p + "attn_output.weight", q + "self_attn.o_proj.weight", rnd(h, nh * hd), "f16")
        put(p + "ffn_norm.weight", q + "post_attention_layernorm.weight", 1 + rnd(h), "f32")
        put(p + "ffn_gate.weight", q + "mlp.gate_proj.weight", rnd(ff, h), "q8")
        put(p + "ffn_up.weight", q + "mlp.up_proj.weight", rnd(ff, h), "q8")
        put(p + "ffn_down.weight", q + "mlp.down_proj.weight", rnd(h, ff), "q8")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def _hf_gguf_model(path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to read GGUF
    # transformers rebuilds the same gguf TensorNameMap once per module (~400 times for 30 layers);
    # caching that pure function keeps its result and saves ~10 s of CPU.
    with mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                 dtype=torch.float32).eval()


def _hf_dir_model(path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


# -- tiny models -------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_import_matches_oracle_and_transformers(tmp_path: Path, arch: str) -> None:
    permuted = arch == "llama"
    src = tmp_path / f"tiny-{arch}.gguf"
    orig = write_tiny_gguf(src, arch, permute=permuted, bias=arch == "qwen2")
    out = import_gguf(src, tmp_path / "out", dtype="fp32", adapters=adapters())
    ours = _load_dir(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    assert cfg["tie_word_embeddings"] is False and cfg["num_key_value_heads"] == TINY["kv"]
    assert set(ours) == set(orig)

    # Un-permuted Q/K (and the biases) equal the HF weights the file was made from, bit for bit.
    for k, v in orig.items():
        if any(s in k for s in ("q_proj", "k_proj", "norm")):  # stored as F32: no quantization error
            assert torch.equal(ours[k], v), k

    ref = _hf_gguf_model(src)
    sd = ref.state_dict()
    assert set(sd) == set(ours)
    for k, v in ours.items():
        assert v.dtype == torch.float32
        assert torch.equal(v, sd[k]), k

    ids = torch.randint(0, cfg["vocab_size"], (2, 9))
    with torch.no_grad():
        assert torch.equal(_hf_dir_model(out)(ids).logits, ref(ids).logits)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    for n_head, rows, cols in ((4, 64, 8), (2, 32, 1), (8, 128, 3)):
        w = torch.randn(rows, cols)
        p = _permute_like_llama_cpp(w, n_head)
        assert not torch.equal(p, w)
        assert torch.equal(unpermute_qk(p, n_head), w)
        assert torch.equal(unpermute_qk(p[:, 0], n_head), w[:, 0])  # biases


def test_bf16_and_fp16_are_rounded_fp32(tmp_path: Path) -> None:
    src = tmp_path / "t.gguf"
    write_tiny_gguf(src)
    ref = _load_dir(import_gguf(src, tmp_path / "fp32", dtype="fp32", adapters=adapters()))
    for dtype, td in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        out = import_gguf(src, tmp_path / dtype, dtype=dtype, adapters=adapters())
        got = _load_dir(out)
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == str(td).split(".")[1]
        for k, v in got.items():
            assert v.dtype == td and torch.equal(v, ref[k].to(td)), k


def test_sharded_output_equals_single_file(tmp_path: Path) -> None:
    src = tmp_path / "t.gguf"
    write_tiny_gguf(src)
    single = _load_dir(import_gguf(src, tmp_path / "one", dtype="fp32", adapters=adapters()))
    out = import_gguf(src, tmp_path / "many", dtype="fp32", adapters=adapters(), max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in single.values())
    many = _load_dir(out)
    assert set(many) == set(index["weight_map"]) == set(single)
    assert all(torch.equal(many[k], single[k]) for k in single)
    _hf_dir_model(out)  # transformers reads the sharded folder


def test_tokenizer_files_from_tiny_gguf(tmp_path: Path) -> None:
    src = tmp_path / "t.gguf"
    write_tiny_gguf(src)
    out = import_gguf(src, tmp_path / "o", dtype="fp32", adapters=adapters())
    tok = Tokenizer.from_directory(out)
    assert (tok.bos_token, tok.eos_token, tok.add_bos_token) == ("<s>", "</s>", True)
    ids = tok.encode("the theater")[0].tolist()
    assert ids[0] == 0 and tok.decode(ids[1:]) == "the theater"
    assert tok.piece_to_id("Ġthe") in ids  # the merges were applied
    msgs = [{"role": "user", "content": "hi"}]
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.encode("the theater")[0].tolist() == ref("the theater")["input_ids"]


def test_sentencepiece_gguf_tokenizer(tmp_path: Path) -> None:
    """A SentencePiece ('llama' tokenizer model) vocabulary with byte fallback and scores only.

    Same ids as transformers' GGUF tokenizer on ordinary text. Where they differ, ours follows
    SentencePiece and llama.cpp: the dummy space prefix is added even when the text already starts
    with a space (transformers' Metaspace skips it), and after a special token.
    """
    transformers = pytest.importorskip("transformers")
    from exl3_core.convert.gguf_import import read_gguf
    from exl3_core.convert.gguf_tokenizer import build_tokenizer

    pieces = ["\u2581", "t", "h", "e", "a", "r", "o", "n", "d", "s", "\u2581t", "he", "\u2581the", "\u2581a", "an",
              "\u2581an", "nd", "\u2581and", "er", "\u00e9", "\u65e5"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = build_tokenizer(read_gguf(path)[1])
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["the and then", "th\u00e9\u00e2tre \u65e5\u672c xyz", "hello\nworld", "and  the   end"]:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == ref(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids) == text
        space = ours.token_to_id("\u2581")
        assert ours.encode(" " + text, add_special_tokens=False).ids == [space, *ids]
    assert ours.encode("<s>the", add_special_tokens=False).ids == [1, ours.token_to_id("\u2581the")]
    # bytes without a piece of their own fall back to <0xNN> tokens
    assert ours.encode("\u00fc", add_special_tokens=False).ids[1:] == [3 + 0xC3, 3 + 0xBC]
    # Raw bytes per token: U+2581 is a space, <0xNN> one byte (the dummy prefix space included).
    vb = Tokenizer(ours).get_vocab_bytes()
    for text in ["the and \u00fc\u65e5", "x\ny"]:
        assert b"".join(vb[i] for i in ours.encode(text, add_special_tokens=False).ids) == (" " + text).encode()


def test_interrupted_import_leaves_nothing(tmp_path: Path) -> None:
    src = tmp_path / "t.gguf"
    write_tiny_gguf(src)
    target = tmp_path / "models" / "m"

    def boom(done: int, total: int, name: str) -> None:
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        import_gguf(src, target, dtype="fp32", adapters=adapters(), progress=boom)
    assert not target.exists()
    assert list((tmp_path / "models").iterdir()) == []

    calls: list[tuple[int, int, str]] = []
    import_gguf(src, target, dtype="fp32", adapters=adapters(), progress=lambda *a: calls.append(a))
    assert calls[-1][0] == calls[-1][1] == len(calls)
    assert (target / IMPORT_MARKER).is_file()
    with pytest.raises(FileExistsError, match="overwrite"):
        import_gguf(src, target, dtype="fp32", adapters=adapters())
    import_gguf(src, target, dtype="bf16", adapters=adapters(), overwrite=True)
    assert json.loads((target / IMPORT_MARKER).read_text())["dtype"] == "bf16"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["m"]


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    src = tmp_path / "foo.gguf"
    w = gguf.GGUFWriter(str(src), "foo")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedGGUFArchitecture, match=r"'foo'.*llama, qwen2"):
        import_gguf(src, tmp_path / "o", adapters=adapters())
    assert not (tmp_path / "o").exists()
    # Through the plugin registry: the message names the file's architecture and what is installed.
    with pytest.raises(UnsupportedGGUFArchitecture, match=r"'foo'.*supported GGUF architectures"):
        import_gguf(src, tmp_path / "o")


def test_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from exl3_core.convert import gguf_import

    src = tmp_path / "t.gguf"
    write_tiny_gguf(src)
    real = gguf_import.import_gguf
    monkeypatch.setattr(gguf_import, "import_gguf", lambda *a, **k: real(*a, adapters=adapters(), **k))
    parser = argparse.ArgumentParser(prog="exl3")
    add_cli(parser.add_subparsers(dest="cmd"))
    for name, dtype in zip(GGUF_DTYPES, ("bfloat16", "float16", "float32"), strict=True):  # every choice imports
        args = parser.parse_args(["import-gguf", str(src), "-o", str(tmp_path / name), "--dtype", name])
        assert args.func(args) == 0
        assert json.loads((tmp_path / name / "config.json").read_text())["torch_dtype"] == dtype
    args = parser.parse_args(["import-gguf", str(src), "-o", str(tmp_path / "o"), "--dtype", "fp16"])
    assert args.func(args) == 0
    args = parser.parse_args(["import-gguf", str(src), "-o", str(tmp_path / "o")])
    assert args.func(args) == 1 and "overwrite" in capsys.readouterr().err


def test_decoder_config_reads_rope_scaling() -> None:
    md = {"general.architecture": "foo", "foo.embedding_length": 64, "foo.feed_forward_length": 96,
          "foo.block_count": 2, "foo.attention.head_count": 4, "foo.attention.key_length": 32,
          "foo.rope.scaling.type": "yarn", "foo.rope.scaling.factor": 4.0,
          "foo.rope.scaling.original_context_length": 4096, "foo.context_length": 16384}
    cfg = decoder_config(md)
    assert cfg["num_key_value_heads"] == 4 and cfg["head_dim"] == 32 and cfg["max_position_embeddings"] == 16384
    assert cfg["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    md["foo.rope.scaling.type"] = "none"
    assert "rope_scaling" not in decoder_config(md)


# -- the real default model --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_gguf_ref() -> Any:
    return _hf_gguf_model(gguf_file())


def test_default_model_weights_match_transformers(hf_gguf_ref: Any) -> None:
    """bf16 import == transformers' fp32 GGUF weights rounded to bf16, bit for bit."""
    out = imported_model()
    ours = _load_dir(out)
    sd = hf_gguf_ref.state_dict()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in ours
    assert set(sd) - set(ours) == {"lm_head.weight"} and set(ours) <= set(sd)
    for k, v in ours.items():
        assert v.dtype == torch.bfloat16
        assert torch.equal(v, sd[k].to(torch.bfloat16)), k


def test_default_model_logits_match_transformers(hf_gguf_ref: Any) -> None:
    mine = _hf_dir_model(imported_model())
    with torch.no_grad():
        for p in hf_gguf_ref.parameters():  # the reference with the same bf16 rounding of its weights
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
        ids = torch.randint(0, mine.config.vocab_size, (2, 12))
        assert torch.equal(mine(ids).logits, hf_gguf_ref(ids).logits)
