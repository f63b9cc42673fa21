"""The CUDA cluster decode backend's static decisions (its kernel runs in tests/gpu/test_decode_attention_gpu.py)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from exl3_attn_backends.cuda_decode import MAX_KEYS, MAX_SPLITS, CudaDecodeAttention, num_splits
from exl3_attn_backends.triton_paged import TritonPagedAttention

from exl3_core.attention import AttnSpec


def _spec(**kw: object) -> AttnSpec:
    base = {"head_dim": 128, "num_q_heads": 32, "num_kv_heads": 8, "dtype": torch.float16, "cache": "kv/fp16",
            "phase": "decode", "page_size": 256, "device_type": "cuda", "device_cc": (9, 0)}
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
    ({"window": 128}, "sliding window"),
    ({"softcap": 30.0}, "softcap"),
    ({"has_sinks": True}, "sinks"),
])
def test_declines_with_reasons(kw: dict, part: str) -> None:
    reasons = " | ".join(CudaDecodeAttention().unsupported_reasons(_spec(**kw)))
    assert part in reasons, reasons


def test_cluster_size_from_the_static_bound() -> None:
    assert num_splits(1) == 1 and num_splits(64) == 1 and num_splits(65) == 2
    assert num_splits(MAX_KEYS) == MAX_SPLITS == 8
    assert num_splits(0) == 1
