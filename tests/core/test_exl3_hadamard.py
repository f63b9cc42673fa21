"""Hadamard constructions and the EXL3 blockwise rotation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from exl3_core.quant.exl3 import can_build, get_hadamard, had_blockwise

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "exl3-golden"

# every order up to 256 built by Sylvester, Paley I/II over prime-power fields, or Kronecker products
SUPPORTED = [n for n in [1, 2, *range(4, 257, 4)] if can_build(n)]


def test_had128_matches_exllamav3() -> None:
    ref = load_file(GOLDEN / "inner" / "hadamard_128.safetensors")["had_128"]
    h = get_hadamard(128)
    assert h.dtype == torch.float32
    assert torch.equal(h, ref.float())


def test_sylvester_natural_order_formula() -> None:
    h = get_hadamard(64)
    i = torch.arange(64)
    popcount = torch.tensor([(int(a) & int(b)).bit_count() for a in i for b in i]).view(64, 64)
    assert torch.equal(h, (1 - 2 * (popcount % 2)).float())


def test_supported_orders_cover_the_listed_ones() -> None:
    # 28, 52, 100 and 244 need GF(27), GF(25), GF(49), GF(243): prime-power Paley, not just primes
    for n in (12, 20, 28, 36, 44, 52, 60, 64, 100, 108, 128, 244, 256):
        assert n in SUPPORTED, n


@pytest.mark.parametrize("n", SUPPORTED)
def test_hadamard_is_orthogonal(n: int) -> None:
    h = get_hadamard(n)
    assert h.shape == (n, n)
    assert bool((h.abs() == 1).all())
    assert torch.equal(h @ h.T, n * torch.eye(n))


@pytest.mark.parametrize("n", [0, 3, 6, 10, 92, 172])
def test_unbuildable_orders_raise(n: int) -> None:
    assert not can_build(n)
    with pytest.raises(ValueError, match=f"order {n}"):
        get_hadamard(n)


def test_get_hadamard_returns_a_copy() -> None:
    h = get_hadamard(12)
    h.zero_()
    assert bool((get_hadamard(12).abs() == 1).all())


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_had_blockwise_equals_block_diagonal_product(dim: int) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 384, generator=g).to(torch.float16)  # any float dtype in, fp32 math
    h = get_hadamard(128).double() / 128**0.5
    xd = x.double()
    ref = torch.block_diag(h, h) @ xd if dim == 0 else xd @ torch.block_diag(h, h, h)
    y = had_blockwise(x, dim=dim)
    assert y.dtype == torch.float32
    assert torch.allclose(y.double(), ref, atol=1e-5)
    # orthogonal and symmetric: applying it twice is the identity
    assert torch.allclose(had_blockwise(y, dim=dim).double(), xd, atol=1e-5)


def test_had_blockwise_other_block_and_batch_dims() -> None:
    x = torch.randn(2, 3, 24)
    y = had_blockwise(x, dim=-1, block=12)
    h = get_hadamard(12) / 12**0.5
    assert torch.allclose(y, torch.cat([x[..., :12] @ h, x[..., 12:] @ h], dim=-1), atol=1e-6)


def test_had_blockwise_rejects_unpadded_dim() -> None:
    with pytest.raises(ValueError, match="size 320, not a multiple of the Hadamard block 128"):
        had_blockwise(torch.zeros(4, 320))
