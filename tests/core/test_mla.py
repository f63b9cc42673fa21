"""Latent attention: absorbed form vs the textbook (expanded) form, paged latent cache vs a
cache-less pass, and the MLA cache layer's storage contract."""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.archkit.config import RopeSettings
from exl3_core.cache.mla import MLACacheLayer
from exl3_core.nn.linear import DenseLinear
from exl3_core.nn.mla import LatentAttention, dense_weight, latent_softmax_scale
from exl3_core.nn.module import ForwardState, LoadContext
from exl3_core.nn.rope import RotaryEmbedding
from exl3_core.reference.attention import gather_paged
from dict_source import DictSource

H, HEADS, L, NOPE, ROPE, V = 48, 4, 32, 16, 8, 12


YARN = RopeSettings(type="yarn", theta=10000.0, factor=4.0, original_max_position_embeddings=32, mscale=1.0,
                    mscale_all_dim=0.8, interleaved=True)
PLAIN = RopeSettings(type="default", theta=500.0, interleaved=False)


def make_attn(q_lora: int | None, rope: RopeSettings, dtype: torch.dtype = torch.float32) -> LatentAttention:
    p = "attn"

    def w(o: int, i: int) -> torch.Tensor:
        return torch.randn(o, i) / math.sqrt(i)

    t = {f"{p}.kv_a_proj_with_mqa.weight": w(L + ROPE, H), f"{p}.kv_a_layernorm.weight": 1 + 0.2 * torch.randn(L),
         f"{p}.kv_b_proj.weight": w(HEADS * (NOPE + V), L), f"{p}.o_proj.weight": w(H, HEADS * V)}
    if q_lora is None:
        t[f"{p}.q_proj.weight"] = w(HEADS * (NOPE + ROPE), H)
    else:
        t[f"{p}.q_a_proj.weight"] = w(q_lora, H)
        t[f"{p}.q_a_layernorm.weight"] = 1 + 0.2 * torch.randn(q_lora)
        t[f"{p}.q_b_proj.weight"] = w(HEADS * (NOPE + ROPE), q_lora)
    attn = LatentAttention(prefix=p, layer_idx=0, hidden_size=H, num_heads=HEADS, q_lora_rank=q_lora,
                           kv_lora_rank=L, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
                           rope=RotaryEmbedding(rope, ROPE), scale=latent_softmax_scale(NOPE + ROPE, rope))
    ctx = LoadContext(DictSource(t), torch.device("cpu"), dtype)
    for m in attn.exl3_modules():
        m.load_weights(ctx)
    return attn


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("q_lora", [None, 24])
@pytest.mark.parametrize("rope", [YARN, PLAIN], ids=["yarn_interleaved", "default_halfsplit"])
def test_absorbed_matches_expanded(q_lora: int | None, rope: RopeSettings, plugins: Any) -> None:
    attn = make_attn(q_lora, rope)
    x = torch.randn(2 * 19, H)
    meta = BatchMeta.full(torch.zeros(2, 19, dtype=torch.long))
    state = ForwardState(meta, plugins=plugins)
    out = attn(x, state)
    ref = attn.forward_expanded(x, ForwardState(meta, plugins=plugins))
    assert rel(out, ref) < 1e-5
    # a ragged batch (varlen layout) gives each sequence's rows of its own full pass
    ragged = BatchMeta.from_lists([[0] * 11, [0] * 6], [0, 0])
    xr = torch.randn(17, H)
    got = attn(xr, ForwardState(ragged, plugins=plugins))
    solo = attn(xr[11:], ForwardState(BatchMeta.full(torch.zeros(1, 6, dtype=torch.long)), plugins=plugins))
    assert rel(got[11:], solo) < 1e-5


def test_absorbed_bf16_close_to_fp32(plugins: Any) -> None:
    torch.manual_seed(3)
    a32 = make_attn(24, YARN)
    torch.manual_seed(3)
    a16 = make_attn(24, YARN, torch.bfloat16)
    x = torch.randn(30, H)
    meta = BatchMeta.full(torch.zeros(1, 30, dtype=torch.long))
    out16 = a16(x.bfloat16(), ForwardState(meta, plugins=plugins))
    assert out16.dtype == torch.bfloat16 and a16.w_uk is not None and a16.w_uk.dtype == torch.bfloat16
    assert rel(out16, a32(x, ForwardState(meta, plugins=plugins))) < 2e-2


def test_paged_latent_cache_matches_full_pass(plugins: Any) -> None:
    attn = make_attn(None, YARN)
    page_size, lens = 8, [21, 13]
    layer = MLACacheLayer(num_pages=10, page_size=page_size, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                          head_dim_v=attn.head_dim_v, dtype=torch.float32, device="cpu")
    attn.cache_index = 0
    cache = SimpleNamespace(layers=[layer])
    page_table = torch.tensor([[7, 2, 9], [0, 5, 3]], dtype=torch.int32)
    xs = [torch.randn(n, H) for n in lens]
    refs = [attn(x, ForwardState(BatchMeta.full(torch.zeros(1, len(x), dtype=torch.long)), plugins=plugins))
            for x in xs]
    done = [0, 0]
    for step in ([9, 5], [lens[0] - 11, lens[1] - 7], [1, 1], [1, 1]):
        new = [list(range(done[b], done[b] + step[b])) for b in range(2)]
        meta = BatchMeta.from_lists([[0] * len(n) for n in new], done, page_table=page_table, page_size=page_size)
        x = torch.cat([xs[b][new[b]] for b in range(2)])
        out = attn(x, ForwardState(meta, cache=cache, plugins=plugins))
        expect = torch.cat([refs[b][new[b]] for b in range(2)])
        assert rel(out, expect) < 1e-5
        done = [done[b] + step[b] for b in range(2)]
    # only the latent + rope key is stored: one row of head_dim per token
    assert layer.latent.shape == (10, page_size, 1, L + ROPE)


def test_mla_cache_layer_storage_contract() -> None:
    layer = MLACacheLayer(num_pages=4, page_size=4, num_kv_heads=1, head_dim=L + ROPE, head_dim_v=L,
                          dtype=torch.float16, device="cpu")
    assert layer.views() == ("mla/fp16",) and layer.kind == "mla" and layer.variant == "fp16"
    rows = torch.randn(6, 1, L + ROPE)
    slots = torch.tensor([13, 14, 15, 0, 1, 2])  # page 3 then page 0
    layer.write(rows, None, slots)
    k_cache, v_cache = layer.attn_tensors()
    assert v_cache is None and k_cache.shape == (4, 4, 1, L + ROPE)
    got = gather_paged(k_cache, torch.tensor([3, 0], dtype=torch.int32), 7)
    torch.testing.assert_close(got[1:4], rows[:3].half())
    torch.testing.assert_close(got[4:7], rows[3:].half())
    layer.copy_page(3, 1)
    torch.testing.assert_close(k_cache[1], k_cache[3])
    assert layer.storage_size() == 4 * 4 * (L + ROPE) * 2
    assert MLACacheLayer.bytes_per_token(1, L + ROPE, L, torch.bfloat16) == (L + ROPE) * 2
    with pytest.raises(ValueError, match="v must be None"):
        layer.write(rows, rows, slots)
    with pytest.raises(ValueError, match="num_kv_heads"):
        MLACacheLayer(num_pages=1, page_size=4, num_kv_heads=2, head_dim=8, head_dim_v=4, dtype=torch.float16,
                      device="cpu")


def test_mla_cache_kind_is_registered(plugins: Any) -> None:
    assert plugins.cache_layer("mla", "fp16") is MLACacheLayer


def test_softmax_scale_and_dense_weight() -> None:
    assert latent_softmax_scale(24, PLAIN) == 24 ** -0.5
    m = 0.1 * 0.8 * math.log(4.0) + 1.0
    assert math.isclose(latent_softmax_scale(24, YARN), 24 ** -0.5 * m * m)
    w = torch.randn(5, 7)
    lin = DenseLinear(w, torch.randn(5), 7, 5)
    torch.testing.assert_close(dense_weight(lin, 7, torch.float32, "cpu"), w.T)
