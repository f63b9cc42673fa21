"""EXL3Linear: loading every golden linear, forward vs the fp32 reconstruction, validation errors."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from exl3_core.quant.exl3 import (
    CB_3INST,
    CB_MCG,
    CB_MUL1,
    EXL3Linear,
    codebook_from_tensors,
    exl3_matmul,
    is_exl3_storage,
    marker_int32,
    pack_trellis,
    reconstruct,
)

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "exl3-golden"
MODEL_DIRS = sorted((GOLDEN / "exl3").glob("model_c_*"))
KEY = "model.layers.0.self_attn.q_proj"


def _linear_sizes(cfg: dict) -> dict[str, tuple[int, int]]:
    """True (in, out) features per projection name, from the HF config."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
        "lm_head": (h, v),
    }


def _load(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict


def _random_layer(
    in_f: int, out_f: int, K: int, cb: int, bias: bool = False, seed: int = 0
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k, n = -(-in_f // 128) * 128, -(-out_f // 128) * 128
    t = {
        "x.trellis": torch.randint(
            -32768, 32768, (k // 16, n // 16, 16 * K), generator=g, dtype=torch.int32
        ).to(torch.int16),
        "x.suh": (torch.randn(k, generator=g) * 0.05).half(),
        "x.svh": (torch.randn(n, generator=g) * 0.05).half(),
    }
    if bias:
        t["x.bias"] = torch.randn(out_f, generator=g).half()
    if cb != CB_3INST:
        t["x." + ("mcg" if cb == CB_MCG else "mul1")] = torch.tensor(
            marker_int32("mcg" if cb == CB_MCG else "mul1"), dtype=torch.int32
        )
    return t


# ---- golden checkpoints


@pytest.mark.parametrize("model_dir", MODEL_DIRS, ids=lambda p: p.name)
def test_every_golden_linear_loads_and_matches_reconstruct(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    qcfg = json.loads((model_dir / "quantization_config.json").read_text())["tensor_storage"]
    sizes = _linear_sizes(cfg)
    tensors = _load(model_dir)
    keys = sorted(
        {n.rsplit(".", 1)[0] for n in tensors if is_exl3_storage(n.rsplit(".", 1)[0], tensors.keys())}
    )
    assert len(keys) == 7 * cfg["num_hidden_layers"] + 1  # every projection plus the head
    g = torch.Generator().manual_seed(1)
    ks = set()
    for key in keys:
        in_f, out_f = sizes[key.rsplit(".", 1)[-1]]
        layer = EXL3Linear.from_tensors(key, tensors.get, in_f, out_f)
        # K and codebook agree with ExLlamaV3's own per-tensor metadata
        meta = qcfg[key]
        assert layer.K == meta["bits_per_weight"]
        expected_cb = (
            CB_MUL1 if "mul1_multiplier" in meta else CB_MCG if "mcg_multiplier" in meta else CB_3INST
        )
        assert layer.codebook == expected_cb
        ks.add(layer.K)
        x = torch.randn(2, 3, in_f, generator=g)
        w = reconstruct(
            tensors[f"{key}.trellis"], tensors[f"{key}.suh"], tensors[f"{key}.svh"], None, layer.codebook
        )
        ref = x @ w[:in_f, :out_f]
        y = layer(x)
        assert y.shape == (2, 3, out_f) and y.dtype == torch.float32
        assert torch.allclose(y, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())
        assert torch.equal(layer.dequantize(), w[:in_f, :out_f])
    if model_dir.name == "model_c_exl3_2.5bpw":
        assert len(ks) >= 2, "2.5 bpw mixes K per tensor"


def test_codebook_detection_on_golden_names() -> None:
    for model_dir, cb in (
        ("model_c_exl3_3.0bpw_3inst", CB_3INST),
        ("model_c_exl3_3.0bpw_mcg", CB_MCG),
        ("model_c_exl3_3.0bpw_mul1", CB_MUL1),
    ):
        tensors = _load(GOLDEN / "exl3" / model_dir)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # locked marker values: no warning
            assert codebook_from_tensors(tensors, KEY) == cb
            assert codebook_from_tensors(tensors.get, KEY) == cb
        assert codebook_from_tensors(set(tensors), KEY) == cb


# ---- forward on synthetic layers


@pytest.mark.parametrize(
    ("in_f", "out_f", "K", "cb", "bias"),
    [
        (200, 72, 2, CB_MUL1, True),
        (256, 384, 5, CB_MCG, False),
        (130, 128, 1, CB_3INST, True),
        (128, 300, 8, CB_MUL1, False),
    ],
)
def test_forward_matches_x_at_reconstruct(in_f: int, out_f: int, K: int, cb: int, bias: bool) -> None:
    t = _random_layer(in_f, out_f, K, cb, bias=bias, seed=K)
    layer = EXL3Linear.from_tensors("x", t.get, in_f, out_f)
    w = reconstruct(t["x.trellis"], t["x.suh"], t["x.svh"], K, cb).double()
    x = torch.randn(4, 5, in_f, generator=torch.Generator().manual_seed(9))
    ref = x.double() @ w[:in_f, :out_f]
    if bias:
        ref = ref + t["x.bias"].double()
    y = layer(x)
    assert y.shape == (4, 5, out_f)
    assert torch.allclose(y.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    # the padded width is accepted too and zero-extension is what it means
    x_pad = torch.nn.functional.pad(x, (0, layer.padded_in_features - in_f))
    assert torch.allclose(layer(x_pad), y, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_forward_keeps_input_dtype(dtype: torch.dtype) -> None:
    t = _random_layer(192, 100, 3, CB_MUL1, bias=True)
    layer = EXL3Linear.from_tensors("x", t.get, 192, 100)
    x = torch.randn(3, 192).to(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (3, 100)
    ref = (x.float() @ layer.dequantize() + t["x.bias"].float()).to(dtype)
    assert torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


def test_decoded_cache_follows_trellis() -> None:
    t = _random_layer(128, 128, 4, CB_MUL1)
    layer = EXL3Linear.from_tensors("x", t.get, 128, 128)
    x = torch.randn(2, 128)
    y0 = layer(x)
    assert layer._inner is not None
    # trellis is the source of truth: rewriting it and dropping the cache changes the output
    layer.trellis.copy_(pack_trellis(torch.zeros(8, 8, 256, dtype=torch.int64), 4))
    layer.clear_cache()
    assert not torch.allclose(layer(x), y0)
    layer.to(torch.device("cpu"))
    assert layer._inner is None
    layer.cache_decoded = False
    layer(x)
    assert layer._inner is None


def test_dispatch_uses_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from exl3_core import ext

    called: list[str] = []
    monkeypatch.setattr(ext, "has_op", lambda name: called.append(name) or True)
    t = _random_layer(128, 128, 2, CB_MUL1)
    layer = EXL3Linear.from_tensors("x", t.get, 128, 128)
    x = torch.randn(2, 128)
    # CPU input never goes to the compiled GEMM even when it exists
    assert torch.allclose(
        exl3_matmul(x, layer), x @ reconstruct(t["x.trellis"], t["x.suh"], t["x.svh"], 2, CB_MUL1), atol=1e-4
    )


def test_legacy_packed_signs() -> None:
    t = _random_layer(256, 128, 3, CB_MUL1, seed=4)
    g = torch.Generator().manual_seed(5)
    signs = {"su": torch.randint(0, 2, (256,), generator=g), "sv": torch.randint(0, 2, (128,), generator=g)}
    legacy = {k: v for k, v in t.items() if not k.endswith(("suh", "svh"))}
    for side, bits in signs.items():
        # pack: bit i of word w is element 16w+i, set bit = -1
        words = (bits.view(-1, 16) << torch.arange(16)).sum(-1)
        legacy[f"x.{side}"] = torch.where(words >= 32768, words - 65536, words).to(torch.int16)
    assert is_exl3_storage("x", legacy.keys())
    layer = EXL3Linear.from_tensors("x", legacy.get, 256, 128)
    assert torch.equal(layer.suh.float(), 1 - 2 * signs["su"].float())
    assert torch.equal(layer.svh.float(), 1 - 2 * signs["sv"].float())


def test_is_exl3_storage() -> None:
    assert is_exl3_storage("a", {"a.trellis", "a.suh", "a.svh"})
    assert is_exl3_storage("a", {"a.trellis", "a.su", "a.svh", "a.mul1"})
    assert not is_exl3_storage("a", {"a.trellis", "a.suh"})
    assert not is_exl3_storage("a", {"a.weight", "a.suh", "a.svh"})
    assert not is_exl3_storage("a", {"ab.trellis", "a.suh", "a.svh"})


# ---- bad input


@pytest.fixture(scope="module")
def golden_mul1() -> dict[str, torch.Tensor]:
    return _load(GOLDEN / "exl3" / "model_c_exl3_3.0bpw_mul1")


def test_truncated_trellis_names_tensor_and_shape(golden_mul1: dict[str, torch.Tensor]) -> None:
    t = dict(golden_mul1)
    t[f"{KEY}.trellis"] = t[f"{KEY}.trellis"][:23]
    with pytest.raises(ValueError, match=rf"{KEY}\.trellis: shape \[23, 24, 48\], expected \[24, 24, 48\]"):
        EXL3Linear.from_tensors(KEY, t.get, 320, 320)


def test_wrong_features_for_trellis(golden_mul1: dict[str, torch.Tensor]) -> None:
    with pytest.raises(ValueError, match=rf"{KEY}\.trellis: .*expected \[24, 32, 48\]"):
        EXL3Linear.from_tensors(KEY, golden_mul1.get, 320, 480)


@pytest.mark.parametrize("words", [144, 40, 8])
def test_impossible_k(words: int) -> None:
    t = {
        "x.trellis": torch.zeros(8, 8, words, dtype=torch.int16),
        "x.suh": torch.ones(128).half(),
        "x.svh": torch.ones(128).half(),
    }
    with pytest.raises(ValueError, match=rf"x\.trellis: last dim {words} gives an impossible K"):
        EXL3Linear.from_tensors("x", t.get, 128, 128)


def test_bad_dtype_rank_and_scales() -> None:
    base = _random_layer(128, 128, 2, CB_3INST)
    t = dict(base, **{"x.trellis": base["x.trellis"].to(torch.int32)})
    with pytest.raises(ValueError, match=r"x\.trellis: dtype torch\.int32, expected int16"):
        EXL3Linear.from_tensors("x", t.get, 128, 128)
    t = dict(base, **{"x.trellis": base["x.trellis"].reshape(64, 32)})
    with pytest.raises(ValueError, match=r"x\.trellis: shape \(64, 32\), expected 3-D"):
        EXL3Linear.from_tensors("x", t.get, 128, 128)
    t = dict(base, **{"x.suh": base["x.suh"][:100]})
    with pytest.raises(ValueError, match=r"x\.suh: .*expected a float vector \[128\]"):
        EXL3Linear.from_tensors("x", t.get, 128, 128)
    t = {k: v for k, v in base.items() if k != "x.svh"}
    with pytest.raises(KeyError, match=r"x\.svh: missing"):
        EXL3Linear.from_tensors("x", t.get, 128, 128)
    with pytest.raises(KeyError, match=r"x\.trellis: missing"):
        EXL3Linear.from_tensors("x", {}.get, 128, 128)


def test_both_markers_is_an_error(golden_mul1: dict[str, torch.Tensor]) -> None:
    t = dict(golden_mul1)
    t[f"{KEY}.mcg"] = torch.tensor(marker_int32("mcg"), dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"both {KEY}\.mcg and {KEY}\.mul1 are present"):
        EXL3Linear.from_tensors(KEY, t.get, 320, 320)
    with pytest.raises(ValueError, match="both"):
        codebook_from_tensors(set(t), KEY)


def test_unexpected_marker_value_warns(golden_mul1: dict[str, torch.Tensor]) -> None:
    t = dict(golden_mul1)
    t[f"{KEY}.mul1"] = torch.tensor(12345, dtype=torch.int32)
    with pytest.warns(UserWarning, match=rf"{KEY}\.mul1: marker value 0x00003039 differs"):
        layer = EXL3Linear.from_tensors(KEY, t.get, 320, 320)
    assert layer.codebook == CB_MUL1


def test_forward_rejects_wrong_width() -> None:
    t = _random_layer(200, 64, 2, CB_MUL1)
    layer = EXL3Linear.from_tensors("x", t.get, 200, 64)
    with pytest.raises(ValueError, match=r"x: input last dim 100, expected 200 \(or padded 256\)"):
        layer(torch.randn(2, 100))
