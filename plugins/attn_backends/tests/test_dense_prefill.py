"""The dense (torch SDPA) fast paths for fresh sequences' prefill: when they apply, and that they
equal the torch reference (on the CPU here; through the Triton backend on a GPU)."""
from __future__ import annotations

import pytest
import torch
from exl3_attn_backends.dense import (
    DenseCausalAttention,
    DenseRowsAttention,
    dense_causal,
    fresh_single_sequence,
)

from exl3_core.attention import AttnSpec
from exl3_core.testing.attention import Case, make_args, reference_attention, tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _spec(dtype: torch.dtype = torch.float16, heads: tuple[int, int] = (8, 2), **kw: object) -> AttnSpec:
    return AttnSpec(head_dim=64, num_q_heads=heads[0], num_kv_heads=heads[1], dtype=dtype,
                    device_type=DEVICE, **kw)  # type: ignore[arg-type]


def test_applies_only_to_one_sequence_without_a_prefix() -> None:
    paged = dict(cache="kv/fp16", page_size=32)
    assert fresh_single_sequence(make_args(Case(_spec(**paged), (40,), (0,)), DEVICE))
    assert fresh_single_sequence(make_args(Case(_spec(), (40,)), DEVICE))  # no cache at all
    assert not fresh_single_sequence(make_args(Case(_spec(**paged), (40,), (5,)), DEVICE))  # cached prefix
    assert not fresh_single_sequence(make_args(Case(_spec(**paged), (40, 30), (0, 0)), DEVICE))  # two sequences
    assert not fresh_single_sequence(make_args(Case(_spec(torch.float32), (40,)), DEVICE))
    assert not fresh_single_sequence(make_args(Case(_spec(window=8), (40,)), DEVICE))
    assert not fresh_single_sequence(make_args(Case(_spec(softcap=30.0), (40,)), DEVICE))
    assert not fresh_single_sequence(make_args(Case(_spec(phase="decode", **paged), (1,), (0,)), DEVICE))
    args = make_args(Case(_spec(**paged), (40,), (0,)), DEVICE)
    assert not fresh_single_sequence(args._replace(k=None, v=None))  # a caller that passes the cache only


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("n", [2, 37, 300])
def test_dense_equals_reference(dtype: torch.dtype, heads: tuple[int, int], n: int) -> None:
    case = Case(_spec(dtype, heads, cache="kv/fp16" if dtype == torch.float16 else "kv/bf16", page_size=32),
                (n,), (0,))
    args = make_args(case, DEVICE, seed=n)
    assert fresh_single_sequence(args)
    ref = reference_attention(args).float()
    out = dense_causal(args)
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < tolerance(dtype), err


def test_backend_takes_exactly_one_fresh_sequence() -> None:
    b = DenseCausalAttention()
    ok = AttnSpec(head_dim=64, num_q_heads=8, num_kv_heads=2, dtype=torch.float16, phase="prefill", num_seqs=1,
                  device_type="cuda", device_cc=(9, 0))
    assert b.unsupported_reasons(ok) == []
    for kw, part in (({"cache": "kv/fp16"}, "no cache"), ({"num_seqs": 2}, "one sequence"),
                     ({"phase": "decode"}, "prefill only"), ({"dtype": torch.float32}, "fp16 or bf16"),
                     ({"window": 8}, "plain causal"), ({"head_dim_v": 32}, "as wide as keys"),
                     ({"device_type": "cpu", "device_cc": (0, 0)}, "CUDA device")):
        reasons = " | ".join(b.unsupported_reasons(ok._replace(**kw)))
        assert part in reasons, (kw, reasons)
    args = make_args(Case(_spec(), (12,)), DEVICE)
    torch.testing.assert_close(b.forward(args._replace(spec=ok._replace(device_type=DEVICE))).float(),
                               reference_attention(args).float(), atol=tolerance(torch.float16), rtol=0)
    with pytest.raises(ValueError, match="args.k"):
        b.forward(args._replace(k=None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lens", [(64,) * 6, (16, 16), (7, 0, 30, 1)], ids=["rows", "pair", "ragged"])
@pytest.mark.parametrize("heads", [(8, 2), (6, 6)])
def test_rows_backend_equals_the_reference(dtype: torch.dtype, q_lens: tuple[int, ...], heads: tuple[int, int]) -> None:
    """The CPU backend's batch of equal rows (the converter's calibration forward) and its per-sequence loop."""
    case = Case(AttnSpec(head_dim=64, num_q_heads=heads[0], num_kv_heads=heads[1], dtype=dtype, device_type="cpu",
                         num_seqs=len(q_lens)), q_lens, (0,) * len(q_lens))
    b = DenseRowsAttention()
    assert b.unsupported_reasons(case.spec) == []
    args = make_args(case, "cpu", seed=sum(q_lens) + heads[1])
    out, ref = b.forward(args), reference_attention(args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err < tolerance(dtype), err


def test_rows_backend_declines_what_it_cannot_do() -> None:
    b = DenseRowsAttention()
    ok = AttnSpec(head_dim=64, num_q_heads=8, num_kv_heads=2, dtype=torch.float32, phase="prefill", num_seqs=4,
                  device_type="cpu")
    assert b.unsupported_reasons(ok) == []
    for kw, part in (({"cache": "kv/fp16"}, "no cache"), ({"phase": "decode"}, "prefill only"),
                     ({"softcap": 20.0}, "plain causal"), ({"head_dim_v": 32}, "as wide as keys"),
                     ({"num_seqs": 1}, "batches of sequences only"),
                     ({"device_type": "cuda", "device_cc": (9, 0)}, "the CPU only")):
        reasons = " | ".join(b.unsupported_reasons(ok._replace(**kw)))
        assert part in reasons, (kw, reasons)
    with pytest.raises(ValueError, match="args.k"):
        b.forward(make_args(Case(ok, (5, 5), (0, 0)), "cpu")._replace(k=None))
