"""The CUDA short-bound (tensor-core, one block per kv head) decode backend's static decisions and input checks (its kernel runs in
tests/gpu/test_decode_attention_gpu.py)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from exl3_attn_backends.cuda_decode import (
    CudaDecodeAttention,
    check_call,
    decode_attention,
)
from exl3_attn_backends.triton_paged import TritonPagedAttention

from exl3_core.attention import AttnSpec


def _spec(**kw: object) -> AttnSpec:
    base = {"head_dim": 128, "num_q_heads": 32, "num_kv_heads": 8, "dtype": torch.float16, "cache": "kv/fp16",
            "phase": "decode", "page_size": 256, "device_type": "cuda", "device_cc": (9, 0), "max_keys": 256,
            "num_seqs": 1, "q_per_seq": 1, "sm_count": 132}
    base.update(kw)
    return AttnSpec(**base)  # type: ignore[arg-type]


def test_outranks_triton_for_decode_only() -> None:
    cuda, triton = CudaDecodeAttention(), TritonPagedAttention()
    assert cuda.priority(_spec()) > triton.priority(_spec())
    assert cuda.priority(_spec(phase="prefill")) < 0
    assert cuda.priority(_spec(device_type="cpu")) < 0


@pytest.mark.parametrize("kw,part", [
    ({"device_type": "cpu", "device_cc": (0, 0)}, "CUDA device"),
    ({"device_cc": (8, 0)}, "compute capability >= 9.0"),
    ({"phase": "prefill"}, "decode steps only"),
    ({"cache": "kv/bf16"}, "kv/fp16 or kv/bf16 cache of the query's dtype"),
    ({"dtype": torch.float32}, "kv/fp16 or kv/bf16 cache of the query's dtype"),
    ({"cache": "mla/fp16", "head_dim": 96, "head_dim_v": 64}, "head dim must be 64 or 128"),
    ({"head_dim": 80}, "head dim must be 64 or 128"),
    ({"num_q_heads": 72}, "at most 8"),
    ({"num_q_heads": 30}, "divide evenly"),
    ({"window": 128}, "sliding window"),
    ({"softcap": 30.0}, "softcap"),
    ({"has_sinks": True}, "sinks"),
    ({"q_per_seq": 3}, "one query per sequence"),
    ({"max_keys": 512}, "past one pass of shared memory (256 keys at head dim 128)"),
    ({"max_keys": 0}, "key bound unknown"),
    ({"num_seqs": 32}, "32 sequences x 8 kv heads = 256 blocks, more than 1 per SM of 132"),
])
def test_declines_with_reasons(kw: dict, part: str) -> None:
    reasons = " | ".join(CudaDecodeAttention().unsupported_reasons(_spec(**kw)))
    assert part in reasons, reasons


def test_accepts_its_bounds() -> None:
    """Within its bound and batch it only lacks the compiled op here (a CPU build); head dim 64 takes 512 keys."""
    for kw in ({}, {"head_dim": 64, "max_keys": 512}, {"num_seqs": 16}):
        reasons = CudaDecodeAttention().unsupported_reasons(_spec(**kw))
        assert all("decode_attention" in r for r in reasons), reasons


def test_dispatcher_routes_long_bounds_and_big_batches_to_triton() -> None:
    """The decline is the route: past its bound or batch, the next backend by priority (Triton) takes the spec."""
    from exl3_core.attention.dispatch import Dispatcher
    from exl3_core.plugins import load_plugins

    d = Dispatcher(load_plugins())
    spec = _spec(device_type="cpu", device_cc=(0, 0), dtype=torch.float32, cache="kv/fp32", max_keys=4096)
    assert "past one pass" in " ".join(CudaDecodeAttention().unsupported_reasons(spec))
    chosen = d.select(spec)
    assert chosen.name in ("triton_paged", "torch")
    assert TritonPagedAttention().route(_spec()) .startswith("split-KV")
    assert TritonPagedAttention().route(_spec(q_per_seq=3)).startswith("split-KV")  # a verification step
    assert TritonPagedAttention().route(_spec(q_per_seq=0)).startswith("single-pass")  # varying queries


def _tensors(**over: torch.Tensor) -> dict[str, torch.Tensor]:
    t = {"q": torch.zeros(2, 8, 64, dtype=torch.float16), "k_cache": torch.zeros(4, 16, 2, 64, dtype=torch.float16),
         "v_cache": torch.zeros(4, 16, 2, 64, dtype=torch.float16), "page_table": torch.zeros(2, 2, dtype=torch.int32),
         "cu_seqlens_q": torch.tensor([0, 1, 2], dtype=torch.int32),
         "seq_lens_k": torch.tensor([3, 5], dtype=torch.int32)}
    t.update(over)
    return t


@pytest.mark.parametrize("over,part", [
    ({}, "must be on the GPU"),
    ({"q": torch.zeros(2, 8, 64)}, "float16 or bfloat16"),
    ({"k_cache": torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)}, "must have q's dtype"),
    ({"q": torch.zeros(2, 8, 96, dtype=torch.float16)}, "head dim must be 64 or 128"),
    ({"q": torch.zeros(2, 18, 64, dtype=torch.float16)}, "at most 8"),
    ({"q": torch.zeros(2, 8, 68, dtype=torch.float16)[:, :, :64]}, "16-byte aligned"),
    ({"page_table": torch.zeros(2, 2, dtype=torch.int64)}, "page_table must be int32"),
    ({"cu_seqlens_q": torch.tensor([0, 1], dtype=torch.int32)}, "cu_seqlens_q must be contiguous int32 [B + 1]"),
    ({"seq_lens_k": torch.tensor([3], dtype=torch.int32)}, "seq_lens_k must be contiguous int32 [B]"),
    ({"q": torch.zeros(2, 64, dtype=torch.float16)}, "q must be [T, Hq, D]"),
])
def test_check_call_names_the_bad_input(over: dict, part: str) -> None:
    bad = " | ".join(check_call(**_tensors(**over)))
    assert part in bad, bad


def test_decode_attention_refuses_with_value_error() -> None:
    """The checked entry point raises before any kernel runs, naming every problem; the inputs are untouched."""
    t = _tensors(page_table=torch.zeros(2, 2, dtype=torch.int64))
    before = {k: v.clone() for k, v in t.items()}
    with pytest.raises(ValueError, match=r"on the GPU.*page_table must be int32"):
        decode_attention(**t, scale=0.125)
    for k, v in t.items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("bound", [-1, 2**30])
def test_decode_attention_refuses_a_bad_bound(bound: int) -> None:
    """The static key bound that sizes the block's shared memory is checked with the tensors."""
    with pytest.raises(ValueError, match=r"bound must be in \[0, 2\*\*30\), got " + str(bound)):
        decode_attention(**_tensors(), scale=0.125, bound=bound)
