"""Attention of one fresh sequence on CUDA: the attention module hands it to the backends without the cache,
and the dispatcher gives that call to the dense SDPA backend (torch_sdpa) ahead of Triton, while the same
tokens' paged call goes to Triton; both equal the torch reference on the 8B layer shape (32/8 heads x 128,
2048 tokens, paged fp16/bf16)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from exl3_attn_backends.dense import fresh_single_sequence
from exl3_attn_backends.triton_paged import TritonPagedAttention

from exl3_core.attention import AttnSpec
from exl3_core.attention.dispatch import get_dispatcher
from exl3_core.attention.spec import device_cc, pow2_bucket, sm_count
from exl3_core.plugins import load_plugins
from exl3_core.testing.attention import Case, make_args, reference_attention, tolerance


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [2048, 333])
def test_dense_and_triton_prefill_equal_reference(dtype: torch.dtype, tokens: int) -> None:
    dev = torch.device("cuda")
    view = "kv/fp16" if dtype == torch.float16 else "kv/bf16"
    # the static spec of a fresh prompt's call, as the attention module states it (no cache), and of the
    # same tokens read back through the paged cache
    fresh = AttnSpec(head_dim=128, num_q_heads=32, num_kv_heads=8, dtype=dtype, phase="prefill", device_type="cuda",
                     device_cc=device_cc(dev), max_keys=pow2_bucket(tokens), num_seqs=1, sm_count=sm_count(dev))
    paged = fresh._replace(cache=view, page_size=256)
    dispatcher = get_dispatcher(load_plugins())
    sdpa, triton = dispatcher.backends()["torch_sdpa"], dispatcher.backends()["triton_paged"]
    assert sdpa.unsupported_reasons(fresh) == [] and sdpa.priority(fresh) > triton.priority(fresh)
    chosen = dispatcher.select(fresh)
    # an installed flash-attn outranks both; otherwise the fresh call is the dense backend's
    assert chosen is sdpa or chosen.priority(fresh) > sdpa.priority(fresh), chosen.name
    assert sdpa.unsupported_reasons(paged), "the dense backend must decline a paged call"
    assert isinstance(triton, TritonPagedAttention) and triton.unsupported_reasons(paged) == []
    args = make_args(Case(paged, (tokens,), (0,)), dev, seed=tokens)
    assert fresh_single_sequence(args)
    # the module's cache-less call: the same new rows, no page table
    dense_args = args._replace(spec=fresh, k_cache=None, v_cache=None, page_table=None)
    ref = reference_attention(args).float()
    dense = sdpa.forward(dense_args)
    tri = triton.forward(args)
    for out in (dense, tri):
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < tolerance(dtype), err
