"""The CUDA quantized-cache split decode backend's static decisions, split count and input checks (its kernel runs in
tests/gpu/test_decode_qsplit_gpu.py)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from exl3_attn_backends.cuda_decode import CudaDecodeAttention
from exl3_attn_backends.cuda_qsplit import (
    MAX_SPLITS,
    CudaQuantSplitAttention,
    check_call,
    choose_splits,
    decode_attention_qsplit,
)
from exl3_attn_backends.triton_paged import TritonPagedAttention

from exl3_core.attention import AttnSpec
from exl3_core.attention.spec import QuantPages


def _spec(**kw: object) -> AttnSpec:
    base = {"head_dim": 128, "num_q_heads": 32, "num_kv_heads": 8, "dtype": torch.float16, "cache": "kv/quant",
            "phase": "decode", "page_size": 256, "device_type": "cuda", "device_cc": (9, 0), "max_keys": 32768,
            "num_seqs": 1, "q_per_seq": 1, "sm_count": 132, "kv_bits": (4, 4)}
    base.update(kw)
    return AttnSpec(**base)  # type: ignore[arg-type]


def test_ranks_between_the_short_bound_kernel_and_triton() -> None:
    q, short, triton = CudaQuantSplitAttention(), CudaDecodeAttention(), TritonPagedAttention()
    assert short.priority(_spec()) > q.priority(_spec()) > triton.priority(_spec())
    assert q.priority(_spec(cache="kv/fp16")) < 0
    assert q.priority(_spec(phase="prefill")) < 0
    assert q.priority(_spec(device_type="cpu")) < 0


@pytest.mark.parametrize("kw,part", [
    ({"device_type": "cpu", "device_cc": (0, 0)}, "CUDA device"),
    ({"device_cc": (8, 9)}, "compute capability >= 9.0"),
    ({"phase": "prefill"}, "decode steps only"),
    ({"cache": "kv/fp16"}, "reads the kv/quant view only"),
    ({"kv_bits": (4, 3)}, "4- or 8-bit keys and values only (got 4/3)"),
    ({"kv_bits": (2, 8)}, "4- or 8-bit keys and values only (got 2/8)"),
    ({"dtype": torch.bfloat16}, "float16 queries only"),
    ({"head_dim": 96}, "head dim must be 64 or 128"),
    ({"head_dim_v": 64}, "head dim must be 64 or 128"),
    ({"num_q_heads": 72}, "at most 8"),
    ({"num_q_heads": 30}, "divide evenly"),
    ({"page_size": 8}, "pages of a multiple of 16 tokens (got 8)"),
    ({"window": 128}, "sliding window"),
    ({"softcap": 30.0}, "softcap"),
    ({"has_sinks": True}, "sinks"),
    ({"non_causal_spans": True}, "non-causal"),
    ({"q_per_seq": 4}, "one query per sequence (a multi-token step has 4)"),
    ({"max_keys": 1024}, "key bound 1024 under 2048"),
    ({"max_keys": 0}, "key bound unknown under 2048"),
])
def test_declines_with_reasons(kw: dict, part: str) -> None:
    reasons = " | ".join(CudaQuantSplitAttention().unsupported_reasons(_spec(**kw)))
    assert part in reasons, reasons


@pytest.mark.parametrize("kw", [{}, {"kv_bits": (8, 8)}, {"kv_bits": (8, 4)}, {"head_dim": 64, "num_q_heads": 8},
                                {"num_seqs": 64, "max_keys": 4096}, {"page_size": 16}])
def test_accepts_what_it_reads(kw: dict) -> None:
    """4/8-bit keys and values at head dim 64 or 128, any batch: here it only lacks the compiled op (a CPU build)."""
    reasons = CudaQuantSplitAttention().unsupported_reasons(_spec(**kw))
    assert all("decode_attention_qsplit" in r for r in reasons), reasons


def test_dispatcher_sends_other_widths_to_triton() -> None:
    """A width without an unpacking path here is the next backend's (Triton's split kernel) on the same spec."""
    from exl3_core.attention.dispatch import NoAttentionBackend, get_dispatcher
    from exl3_core.plugins import load_plugins

    d = get_dispatcher(load_plugins())
    spec = _spec(kv_bits=(4, 3))
    try:
        chosen = d.select(spec).name
    except NoAttentionBackend as e:  # a CPU machine: every CUDA backend declines; the reasons say why
        chosen = ""
        assert "4- or 8-bit keys and values only" in " ".join(e.rejected["cuda_qsplit"])
    assert chosen != "cuda_qsplit"


@pytest.mark.parametrize("batch,heads,bound,sms", [(1, 8, 32768, 132), (1, 8, 512, 132), (32, 8, 4096, 132),
                                                   (1, 1, 1 << 20, 132), (3, 2, 1, 16)])
def test_split_count(batch: int, heads: int, bound: int, sms: int) -> None:
    """Two blocks an SM over (sequences x kv heads x splits), no split without a tile for each warp, at most
    MAX_SPLITS: checked against the rule's own terms."""
    s = choose_splits(batch, heads, bound, sms)
    assert 1 <= s <= MAX_SPLITS
    assert s == 1 or batch * heads * (s - 1) < 2 * sms  # one fewer split would leave SMs short of two blocks
    assert s == 1 or (s - 1) * 8 * 16 < bound  # every split but the last holds a tile per warp


def _tensors(d: int = 128, hkv: int = 2, bits: tuple[int, int] = (4, 4), ps: int = 16, **over: object) -> dict:
    g = hkv * d // 32
    t: dict[str, object] = {
        "q": torch.zeros(2, 4 * hkv, d, dtype=torch.float16),
        "k_codes": torch.zeros(4, ps, g * bits[0], dtype=torch.int32),
        "v_codes": torch.zeros(4, ps, g * bits[1], dtype=torch.int32),
        "quant": QuantPages(torch.zeros(4, ps, g, dtype=torch.float16), torch.zeros(4, ps, g, dtype=torch.float16),
                            *bits),
        "page_table": torch.zeros(2, 2, dtype=torch.int32), "cu_seqlens_q": torch.tensor([0, 1, 2], dtype=torch.int32),
        "seq_lens_k": torch.tensor([3, 5], dtype=torch.int32)}
    t.update(over)
    return t


@pytest.mark.parametrize("make,part", [
    (lambda: _tensors(), "must be on the GPU"),
    (lambda: _tensors(q=torch.zeros(2, 8, 128, dtype=torch.bfloat16)), "q must be float16"),
    (lambda: _tensors(bits=(4, 3)), "bits must be 4 or 8, got k_bits=4, v_bits=3"),
    (lambda: _tensors(d=96), "head dim must be 64 or 128"),
    (lambda: _tensors(ps=8), "page size must be a multiple of 16 (got 8)"),
    (lambda: _tensors(k_codes=torch.zeros(4, 16, 7, dtype=torch.int32)), "do not fit 8 groups at 4/4 bits"),
    (lambda: _tensors(q=torch.zeros(2, 18, 128, dtype=torch.float16)), "at most 8"),
    (lambda: _tensors(page_table=torch.zeros(2, 2, dtype=torch.int64)), "page_table must be int32"),
    (lambda: _tensors(seq_lens_k=torch.tensor([3], dtype=torch.int32)), "seq_lens_k must be contiguous int32 [B]"),
])
def test_check_call_names_the_bad_input(make, part: str) -> None:
    bad = " | ".join(check_call(**make()))
    assert part in bad, bad


def test_refuses_with_value_error_and_leaves_inputs() -> None:
    """The entry point raises before any kernel runs, naming every problem (and a bad split count)."""
    t = _tensors(page_table=torch.zeros(2, 2, dtype=torch.int64))
    before = {k: v.clone() for k, v in t.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=r"on the GPU.*page_table must be int32.*splits must be in \[1, 64\]"):
        decode_attention_qsplit(**t, scale=0.1, bound=64, splits=0)
    for k, v in before.items():
        assert torch.equal(v, t[k]), k
