"""Triton paged attention vs the torch reference (CPU interpreter in CI, CUDA on a GPU)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from exl3_attn_backends.triton_paged import TritonPagedAttention  # noqa: E402
from exl3_core.attention import AttnSpec  # noqa: E402
from exl3_core.testing.attention import Case, check_backend, default_cases  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("case", default_cases(DEVICE, torch.float32), ids=lambda c: c.id)
def test_matches_reference(case: Case) -> None:
    b = TritonPagedAttention()
    assert b.unsupported_reasons(case.spec) == []
    check_backend(b, case, DEVICE, seed=7)


def test_declines_with_reasons() -> None:
    b = TritonPagedAttention()
    spec = AttnSpec(head_dim=64, num_q_heads=6, num_kv_heads=4, dtype=torch.float16, cache="kv/quant",
                    has_sinks=True, device_type="cuda", device_cc=(7, 5))
    reasons = " | ".join(b.unsupported_reasons(spec))
    for part in ("compute capability", "multiple of num_kv_heads", "sinks", "kv/quant"):
        assert part in reasons


def test_never_preferred_on_cpu() -> None:
    spec = AttnSpec(head_dim=64, num_q_heads=4, num_kv_heads=4, dtype=torch.float32)
    assert TritonPagedAttention().priority(spec) < 0
