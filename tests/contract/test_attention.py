"""Every registered attention backend vs the torch reference, on every spec it accepts."""
from __future__ import annotations

import pytest
import torch

from exl3_core.attention import get_dispatcher
from exl3_core.attention.spec import AttnSpec
from exl3_core.plugins import load_plugins
from exl3_core.testing.attention import Case, check_backend, default_cases

PLUGINS = load_plugins()
BACKENDS = get_dispatcher(PLUGINS).backends()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_HALF = default_cases(DEVICE, torch.float16)
# the first few 16-bit cases plus the long ones (16-bit kernels may run unmasked key chunks there)
CASES = default_cases(DEVICE, torch.float32) + _HALF[:4] + [c for c in _HALF[4:] if sum(c.q_lens) >= 80]


def test_some_backend_beyond_reference_is_checked() -> None:
    accepted = [n for n, b in BACKENDS.items() if n != "torch" and not b.unsupported_reasons(CASES[0].spec)]
    if not accepted:
        pytest.skip("only the torch reference accepts these specs here (no Triton/CUDA)")
    assert accepted


@pytest.mark.parametrize("name", sorted(n for n in BACKENDS if n != "torch"))  # torch IS the reference
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_backend_matches_reference(name: str, case: Case) -> None:
    backend = BACKENDS[name]
    reasons = backend.unsupported_reasons(case.spec)
    if reasons:
        pytest.skip(f"{name} declines: {'; '.join(reasons)}")
    check_backend(backend, case, DEVICE, seed=hash(case.id) % 1000)


def test_reference_rejects_nothing_it_needs() -> None:
    # the reference must accept the whole grid: it is the fallback for every configuration
    assert all(not BACKENDS["torch"].unsupported_reasons(c.spec) for c in CASES)


def test_triton_yields_fp32_cacheless_prefill_to_the_reference() -> None:
    """fp32 Triton dots are exact CUDA-core dots (<1 TFLOP/s measured on an H200): conversion's
    cache-less fp32 calibration prefill goes to the reference's cuBLAS matmuls instead."""
    if "triton_paged" not in BACKENDS:
        pytest.skip("the Triton backend is not installed")
    triton, ref = BACKENDS["triton_paged"], BACKENDS["torch"]
    common = {"head_dim": 128, "num_q_heads": 8, "num_kv_heads": 2, "device_type": "cuda", "device_cc": (9, 0)}
    fp32 = AttnSpec(dtype=torch.float32, **common)
    assert triton.priority(fp32) < ref.priority(fp32)
    for spec in (AttnSpec(dtype=torch.float16, **common),
                 AttnSpec(dtype=torch.float32, cache="kv/fp16", page_size=16, **common)):
        assert triton.priority(spec) > ref.priority(spec), spec
