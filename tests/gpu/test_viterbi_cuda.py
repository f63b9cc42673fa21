"""CUDA Viterbi tile encoder (csrc/quant/viterbi_cuda.cu) == the CPU op, state for state.

Fresh random tiles every run (Gaussian at the codebook's RMS), plus adversarial ones: decoded valid
streams (zero-cost paths), constants, zeros, subnormals, and a coarse LUT on a coarse value grid
where equal path costs are everywhere, so only the lowest-a tie rule decides. Throughput is printed.
"""
from __future__ import annotations

import math
import time

import pytest
import torch

from exl3_core.quant.exl3 import codebook as cb
from exl3_core.quant.exl3 import viterbi as V

pytestmark = pytest.mark.cuda
CBS = (cb.CB_3INST, cb.CB_MCG, cb.CB_MUL1)
DEV = "cuda"


@pytest.fixture(scope="module")
def vit():
    """``torch.ops.exl3.viterbi_encode`` with both kernels; a missing build fails on a CUDA machine."""
    from exl3_core import ext

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ok = ext.has_op("viterbi_encode") and all(
        torch._C._dispatch_has_kernel_for_dispatch_key("exl3::viterbi_encode", k) for k in ("CPU", "CUDA"))
    if not ok:
        pytest.fail("exl3::viterbi_encode lacks its CPU or CUDA kernel; build with nvcc "
                    f"(TORCH_CUDA_ARCH_LIST=9.0 python setup.py build_ext --inplace). load errors: {ext.load_error}")
    return ext.op("viterbi_encode")


def lut32(codebook: int) -> torch.Tensor:
    return cb.lut(codebook).float()


def valid_tiles(n: int, K: int, codebook: int, g: torch.Generator) -> torch.Tensor:
    sym = torch.randint(0, 1 << K, (n, 256), generator=g)
    s = torch.zeros(n, 256, dtype=torch.int64)
    for j in range(math.ceil(16 / K)):
        s |= torch.roll(sym, j, dims=-1) << (j * K)
    return V.decode_states(s & 0xFFFF, codebook).float()


def mixed_tiles(n: int, K: int, codebook: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rms = float(lut32(codebook).pow(2).mean().sqrt())
    parts = [
        torch.randn(n, 256, generator=g) * rms,
        valid_tiles(max(1, n // 8), K, codebook, g),
        valid_tiles(max(1, n // 8), K, codebook, g) + 1e-3 * torch.randn(max(1, n // 8), 256, generator=g),
        torch.full((2, 256), 0.3),
        torch.zeros(2, 256),
        torch.full((1, 256), 1e-41),  # subnormal: a flush-to-zero path would diverge
        torch.randn(1, 256, generator=g) * 1e-20,  # d*d underflows into the subnormal range
        (torch.rand(1, 256, generator=g) - 0.5) * 2 * 65504,  # fp16-range extremes
    ]
    return torch.cat(parts)[torch.randperm(sum(p.shape[0] for p in parts), generator=g)]


def check_equal(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert got.dtype == torch.int32 and got.shape == ref.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    bad = (got != ref).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"{what}: {len(bad)} of {ref.shape[0]} tiles differ from the CPU op (first {bad[:8]})"


@pytest.mark.parametrize("codebook", CBS)
@pytest.mark.parametrize("K", range(1, 9))
def test_cuda_equals_cpu(vit, K: int, codebook: int) -> None:
    tiles = mixed_tiles(48, K, codebook, seed=1000 * K + codebook)
    lut = lut32(codebook)
    ref = vit(tiles, lut, K)
    got = vit(tiles.to(DEV), lut.to(DEV), K)
    check_equal(got.cpu(), ref, f"K={K} cb={codebook}")
    assert V.states_consistent(got.cpu(), K).all()


@pytest.mark.parametrize("K", range(1, 9))
def test_tie_rule_coarse_lut(vit, K: int) -> None:
    g = torch.Generator().manual_seed(77 + K)
    lut = (lut32(cb.CB_3INST) * 2).round() / 2  # fp16-exact, massively duplicated values
    tiles = torch.randint(-4, 5, (24, 256), generator=g).float() / 2
    check_equal(vit(tiles.to(DEV), lut.to(DEV), K).cpu(), vit(tiles, lut, K), f"K={K} coarse LUT")


@pytest.mark.parametrize("K", [1, 4, 8])
def test_many_groups_per_block(vit, K: int) -> None:
    """More tile groups than resident blocks: blocks stride over several groups, last one padded."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_block = {1: 1, 4: 2, 8: 4}[K]
    n = sms * per_block * 2 + 3
    g = torch.Generator().manual_seed(5)
    tiles = torch.randn(n, 256, generator=g) * 1.24
    lut = lut32(cb.CB_MCG)
    check_equal(vit(tiles.to(DEV), lut.to(DEV), K).cpu(), vit(tiles, lut, K), f"K={K} n={n}")


def test_noncontiguous_input_and_empty(vit) -> None:
    g = torch.Generator().manual_seed(9)
    big = torch.randn(16, 512, generator=g)
    tiles = big[:, ::2]  # stride-2 view
    lut = lut32(cb.CB_MUL1)
    check_equal(vit(tiles.to(DEV), lut.to(DEV), 3).cpu(), vit(tiles.contiguous(), lut, 3), "non-contiguous")
    assert vit(torch.empty(0, 256, device=DEV), lut.to(DEV), 4).shape == (0, 256)


def test_throughput_printed(vit) -> None:
    """Encode a few waves of tiles per K and print tiles/s (no threshold: a measurement)."""
    lut = lut32(cb.CB_3INST).to(DEV)
    lines = []
    for K in range(1, 9):
        n = 4096 if K >= 3 else 1024
        tiles = torch.randn(n, 256, device=DEV) * 1.24
        vit(tiles[:64], lut, K)  # warm-up (attributes, allocator)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = vit(tiles, lut, K)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        assert V.states_consistent(out[:64].cpu(), K).all()
        lines.append(f"K={K}: {n / dt:,.0f} tiles/s ({n} tiles, {dt * 1e3:.1f} ms)")
    print("\nviterbi_encode CUDA throughput (3INST):\n  " + "\n  ".join(lines))


def test_encode_tiles_auto_uses_cuda_and_matches_cpu() -> None:
    from exl3_core.quant.exl3 import codebook as cb
    from exl3_core.quant.exl3.viterbi import encode_tiles, has_cuda

    assert has_cuda()
    tiles = torch.randn(96, 256)
    gpu = encode_tiles(tiles.cuda(), 4, cb.CB_MUL1)
    assert gpu.is_cuda
    assert torch.equal(gpu.cpu(), encode_tiles(tiles, 4, cb.CB_MUL1, impl="cpp"))
