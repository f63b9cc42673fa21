"""Triton backend on CUDA: a fresh single-sequence prefill takes the dense SDPA path, and both paths
equal the torch reference on the 8B layer shape (32/8 heads x 128, 2048 tokens, paged fp16/bf16)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from exl3_attn_backends.dense import fresh_single_sequence  # noqa: E402
from exl3_attn_backends.triton_paged import TritonPagedAttention  # noqa: E402

from exl3_core.attention import AttnSpec  # noqa: E402
from exl3_core.attention.spec import device_cc  # noqa: E402
from exl3_core.testing.attention import Case, make_args, reference_attention, tolerance  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [2048, 333])
def test_dense_and_triton_prefill_equal_reference(dtype: torch.dtype, tokens: int) -> None:
    dev = torch.device("cuda")
    view = "kv/fp16" if dtype == torch.float16 else "kv/bf16"
    spec = AttnSpec(head_dim=128, num_q_heads=32, num_kv_heads=8, dtype=dtype, cache=view, page_size=256,
                    device_type="cuda", device_cc=device_cc(dev))
    args = make_args(Case(spec, (tokens,), (0,)), dev, seed=tokens)
    assert fresh_single_sequence(args)
    ref = reference_attention(args).float()
    b = TritonPagedAttention()
    dense = b.forward(args)
    b.dense_prefill = False
    tri = b.forward(args)
    for out in (dense, tri):
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < tolerance(dtype), err
