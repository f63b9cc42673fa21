"""RoPE: every normalised type against transformers' own rotary embedding, layouts against oracles."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from exl3_core.archkit.config import RopeSettings, normalise_rope
from exl3_core.nn.rope import RotaryEmbedding, apply_rotary

transformers = pytest.importorskip("transformers")

HEAD_DIM = 32
MAX_POS = 64

ROPES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn_mscale_notrunc": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
                            "original_max_position_embeddings": 8, "beta_fast": 16.0, "beta_slow": 2.0,
                            "mscale": 1.0, "mscale_all_dim": 0.7, "truncate": False},
    "yarn_attention_factor": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                              "original_max_position_embeddings": 32, "attention_factor": 1.3},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
}


def hf_config(rope: dict[str, Any]) -> Any:
    return transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=HEAD_DIM,
                                    max_position_embeddings=MAX_POS, rope_parameters=dict(rope))


def ours(cfg: Any) -> RotaryEmbedding:
    return RotaryEmbedding(normalise_rope(cfg.to_dict()), HEAD_DIM)


def hf_cos_sin(cfg: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rot = LlamaRotaryEmbedding(cfg)  # fresh: transformers' dynamic RoPE keeps state between calls
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rot(x, positions[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("name", sorted(ROPES))
@pytest.mark.parametrize("length", [40, 200])  # within and beyond max_position_embeddings
def test_cos_sin_match_transformers(name: str, length: int) -> None:
    cfg = hf_config(ROPES[name])
    positions = torch.arange(length)
    if name == "dynamic":  # transformers generating token by token (each position its own call)
        cos_ref, sin_ref = (torch.cat(t) for t in zip(*(hf_cos_sin(cfg, positions[i:i + 1]) for i in range(length))))
    else:
        cos_ref, sin_ref = hf_cos_sin(cfg, positions)
    cos, sin = ours(cfg).cos_sin(positions)
    # transformers lays out cat(freqs, freqs); our tables hold one half
    torch.testing.assert_close(torch.cat([cos, cos], -1), cos_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([sin, sin], -1), sin_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["linear", "yarn", "llama3", "dynamic"])
def test_scaled_types_differ_from_default(name: str) -> None:
    """Guard against a test that passes because scaling was silently ignored on both sides."""
    positions = torch.arange(200)
    cos, _ = ours(hf_config(ROPES[name])).cos_sin(positions)
    cos0, _ = ours(hf_config(ROPES["default"])).cos_sin(positions)
    assert (cos - cos0).abs().max() > 1e-2


def test_inv_freq_matches_rope_init_functions() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for name, rope in ROPES.items():
        if rope["rope_type"] in ("default", "dynamic"):
            continue
        cfg = hf_config(rope)
        inv_ref, factor_ref = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
        r = ours(cfg)
        torch.testing.assert_close(r.inv_freq, inv_ref.float(), rtol=1e-6, atol=0, msg=name)
        assert math.isclose(r.attention_factor, factor_ref, rel_tol=1e-9), name


def test_dynamic_rotates_each_token_for_its_own_length() -> None:
    """Dynamic NTK: a token at position p uses the base for length p + 1, as transformers computes when it
    generates token by token, whatever else is in the call."""
    cfg = hf_config(ROPES["dynamic"])
    r = ours(cfg)
    g = torch.Generator().manual_seed(4)
    positions = torch.randint(0, 4 * MAX_POS, (12,), generator=g)  # a packed batch: short and long rows
    positions[0] = 5  # below max_position_embeddings: the static base
    cos, sin = r.cos_sin(positions)
    for i, p in enumerate(positions.tolist()):
        cos_ref, sin_ref = hf_cos_sin(cfg, torch.tensor([p]))  # transformers alone at this position
        torch.testing.assert_close(torch.cat([cos[i:i + 1]] * 2, -1), cos_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.cat([sin[i:i + 1]] * 2, -1), sin_ref, rtol=1e-5, atol=1e-5)
        alone, _ = r.cos_sin(torch.tensor([p]))
        assert torch.equal(alone[0], cos[i]), "a token's table depends on the other tokens of the call"
    static, _ = ours(hf_config(ROPES["default"])).cos_sin(positions[:1])
    torch.testing.assert_close(cos[:1], static, rtol=1e-6, atol=1e-6)


def rotate_oracle(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rotary_dim: int,
                  interleaved: bool) -> torch.Tensor:
    """Complex-number rotation of channel pairs: the definition of RoPE, pair by pair."""
    out = x.clone().double()
    half = rotary_dim // 2
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        z = torch.complex(out[..., a], out[..., b])
        angle = positions.double()[:, None] * inv_freq.double()[i]
        z = z * torch.polar(torch.ones_like(angle), angle)
        out[..., a], out[..., b] = z.real, z.imag
    return out.to(x.dtype)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("factor", [1.0, 0.5, 0.25])
def test_layouts_and_partial_rotary_match_oracle(interleaved: bool, factor: float) -> None:
    s = RopeSettings(theta=10000.0, partial_rotary_factor=factor, interleaved=interleaved)
    r = RotaryEmbedding(s, HEAD_DIM)
    assert r.rotary_dim == int(HEAD_DIM * factor)
    positions = torch.randint(0, 500, (23,))
    x = torch.randn(23, 3, HEAD_DIM)
    cos, sin = r.cos_sin(positions)
    got = r.rotate(x, cos, sin)
    want = rotate_oracle(x, positions, r.inv_freq, r.rotary_dim, interleaved)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[..., r.rotary_dim:], x[..., r.rotary_dim:], rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_partial_rotary_matches_transformers_apply(interleaved: bool) -> None:
    """Partial rotary in both pair layouts against the transformers functions that implement them."""
    if interleaved:
        from transformers.models.glm.modeling_glm import apply_rotary_pos_emb
    else:
        from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb
    s = RopeSettings(theta=10000.0, partial_rotary_factor=0.5, interleaved=interleaved)
    r = RotaryEmbedding(s, HEAD_DIM)
    positions = torch.arange(17)
    q, k = torch.randn(17, 4, HEAD_DIM), torch.randn(17, 2, HEAD_DIM)
    cos, sin = r.cos_sin(positions)
    # transformers' tables: [B, S, rotary_dim] as cat(freqs, freqs); q/k as [B, H, S, D]
    cos_hf, sin_hf = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_hf, sin_hf)
    torch.testing.assert_close(r.rotate(q, cos, sin), q_ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r.rotate(k, cos, sin), k_ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_low_precision_inputs_rotate_in_fp32() -> None:
    r = RotaryEmbedding(RopeSettings(theta=10000.0), HEAD_DIM)
    positions = torch.arange(9)
    x = torch.randn(9, 2, HEAD_DIM).to(torch.bfloat16)
    cos, sin = r.cos_sin(positions)
    got = apply_rotary(x, cos, sin, HEAD_DIM, False)
    want = rotate_oracle(x.float(), positions, r.inv_freq, HEAD_DIM, False).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    # rounded once from fp32: within one bf16 ulp of the exact rotation
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-8, atol=1e-6)


def test_unsupported_type_names_option() -> None:
    s = RopeSettings(type="longrope", theta=10000.0)
    with pytest.raises(NotImplementedError, match="longrope"):
        RotaryEmbedding(s, HEAD_DIM)
