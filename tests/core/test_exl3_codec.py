"""EXL3 trellis codec against ExLlamaV3's golden tensors and independent per-tile oracles."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from exl3_core.quant.exl3 import (
    CB_3INST,
    CB_MCG,
    CB_MUL1,
    check_states,
    check_wrap,
    decode_inner,
    pack_trellis,
    place_tiles,
    reconstruct,
    tensor_core_perm,
    tensor_core_perm_inv,
    tiles_from_matrix,
    unpack_states,
)
from exl3_core.quant.exl3 import codebook as cbmod

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "exl3-golden"
KEYS = ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj")
VARIANTS = {
    "3.0bpw_3inst": CB_3INST,
    "3.0bpw_mcg": CB_MCG,
    "3.0bpw_mul1": CB_MUL1,
    "5.0bpw": CB_MUL1,
    "8.0bpw": CB_MUL1,
}


def _golden(variant: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = load_file(GOLDEN / "exl3" / f"model_c_exl3_{variant}" / "model.safetensors")
    inner = load_file(GOLDEN / "inner" / f"model_c_exl3_{variant}_inner.safetensors")
    return model, inner


# ---- oracles written straight from the spec's prose, one tile at a time


def _oracle_states_bitstream(tile_words: np.ndarray, K: int) -> np.ndarray:
    """Spec 3.3/3.4 in words: uint32 w[m] = u[2m] | u[2m+1] << 16, concatenated MSB first."""
    u = tile_words.astype(np.int64) & 0xFFFF
    w = u[0::2] | (u[1::2] << 16)
    bits = [(int(word) >> (31 - i)) & 1 for word in w for i in range(32)]
    n = len(bits)
    assert n == 256 * K
    out = np.zeros(256, dtype=np.int64)
    for p in range(256):
        v = 0
        for b in range((p + 1) * K - 16, (p + 1) * K):
            v = (v << 1) | bits[b % n]
        out[p] = v
    return out


def _oracle_states_kernel(tile_words: np.ndarray, K: int) -> np.ndarray:
    """Spec 3.4's kernel formula with 64-bit word pairs."""
    u = tile_words.astype(np.int64) & 0xFFFF
    w = [int(x) for x in (u[0::2] | (u[1::2] << 16))]
    nw = 8 * K
    out = np.zeros(256, dtype=np.int64)
    for p in range(256):
        b0 = p * K + K - 16 + 256 * K
        b1 = b0 + 16
        i0, i1 = b0 // 32, (b1 - 1) // 32
        shift = 32 * (i1 + 1) - b1
        out[p] = (((w[i0 % nw] << 32) | w[i1 % nw]) >> shift) & 0xFFFF
    return out


def _tailbiting_states(symbols: torch.Tensor, K: int) -> torch.Tensor:
    """Valid state sequences from the recurrence s_p = (s_{p-1} << K | sym_p) & 0xFFFF.

    Running the recurrence over the symbols twice makes the second pass start from s_255
    (256K >= 16 bits of history), which is exactly the tail-biting start state.
    """
    s = torch.zeros(symbols.shape[:-1], dtype=torch.int64)
    out = torch.empty_like(symbols, dtype=torch.int64)
    for rnd in range(2):
        for p in range(256):
            s = ((s << K) | symbols[..., p]) & 0xFFFF
            if rnd:
                out[..., p] = s
    return out


# ---- in-tile order


def test_tensor_core_perm_matches_spec_inverse_formula() -> None:
    perm, inv = tensor_core_perm(), tensor_core_perm_inv()
    assert sorted(perm.tolist()) == list(range(256))
    assert torch.equal(perm[inv], torch.arange(256)) and torch.equal(inv[perm], torch.arange(256))
    # the spec lists the first lane's 8 positions explicitly
    first = [(int(f) // 16, int(f) % 16) for f in perm[:8]]
    assert first == [(0, 0), (1, 0), (8, 0), (9, 0), (0, 8), (1, 8), (8, 8), (9, 8)]
    for r in range(16):
        for c in range(16):
            t = ((r & 7) >> 1) + 4 * (c & 7)
            j = (r & 1) + 2 * (r >> 3) + 4 * (c >> 3)
            assert int(inv[r * 16 + c]) == 8 * t + j


def test_place_tiles_round_trip() -> None:
    w = torch.randn(48, 80)
    tiles = tiles_from_matrix(w)
    assert tiles.shape == (3, 5, 256)
    assert torch.equal(place_tiles(tiles), w)
    # tile (1, 2), sequence position 0 is the tile's element (0, 0); position 2 is (8, 0)
    assert tiles[1, 2, 0] == w[16, 32] and tiles[1, 2, 2] == w[24, 32]


# ---- state extraction


@pytest.mark.parametrize("K", range(1, 9))
def test_unpack_states_matches_bitstream_oracles(K: int) -> None:
    g = torch.Generator().manual_seed(100 + K)
    trellis = torch.randint(-32768, 32768, (2, 3, 16 * K), generator=g, dtype=torch.int32).to(torch.int16)
    states = unpack_states(trellis, K)
    assert states.shape == (2, 3, 256)
    for tk, tn in ((0, 0), (1, 2)):
        words = trellis[tk, tn].numpy()
        a = _oracle_states_bitstream(words, K)
        b = _oracle_states_kernel(words, K)
        assert np.array_equal(a, b)
        assert np.array_equal(states[tk, tn].numpy(), a)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_decode_inner_bit_exact_vs_exllamav3(variant: str) -> None:
    model, inner = _golden(variant)
    for key in KEYS:
        trellis = model[f"{key}.trellis"]
        K = trellis.shape[-1] // 16
        w = decode_inner(trellis, K, VARIANTS[variant])
        ref = inner[f"{key}.inner"]
        assert w.dtype == torch.float16 and w.shape == ref.shape
        mismatches = int((w.view(torch.int16) != ref.view(torch.int16)).sum())
        assert mismatches == 0, f"{variant} {key}: {mismatches} of {ref.numel()} values differ"


@pytest.mark.parametrize("cb", [CB_3INST, CB_MCG, CB_MUL1])
def test_decode_exact_rounds_to_decode(cb: int) -> None:
    """decode_exact rounds to decode's fp16 for all 65536 states; MUL1's exact values follow the
    codebook's algebra, SCALE * (1 + b/1024) + BIAS, and sit within half
    an fp16 ulp of the rounded ones, 3INST/MCG are decode's values unchanged."""
    states = torch.arange(65536, dtype=torch.int64)
    exact, rounded = cbmod.decode_exact(states, cb), cbmod.decode(states, cb)
    assert exact.dtype == torch.float32
    assert torch.equal(exact.to(torch.float16).view(torch.int16), rounded.view(torch.int16))
    if cb != CB_MUL1:
        assert torch.equal(exact, rounded.to(torch.float32))
        return
    x = (states * cbmod.MUL1_MULT) & 0xFFFFFFFF
    b = sum((x >> sh) & 0xFF for sh in (0, 8, 16, 24)).to(torch.float64)
    raw = 6.9296875 * (1 + b / 1024) - 10.3828125  # csrc/exl3/exl3_decode.cuh MUL1_RAW_SCALE, _BIAS
    assert torch.equal(exact.double(), raw)
    ulp = torch.finfo(torch.float16).eps * rounded.abs().double().clamp(min=2.0**-14)
    diff = (exact.double() - rounded.double()).abs()
    assert (diff <= ulp / 2 + 1e-12).all() and diff.max() > 0, "exact values must be the unrounded ones"
    trellis = torch.randint(-32768, 32768, (2, 3, 16 * 4), dtype=torch.int16)
    w, we = decode_inner(trellis, 4, cb), decode_inner(trellis, 4, cb, exact=True)
    assert we.dtype == torch.float32 and torch.equal(we.to(torch.float16).view(torch.int16), w.view(torch.int16))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_golden_pack_unpack_round_trip_and_wrap(variant: str) -> None:
    model, _ = _golden(variant)
    for key in KEYS:
        trellis = model[f"{key}.trellis"]
        K = trellis.shape[-1] // 16
        states = unpack_states(trellis)
        assert bool(check_wrap(states, K).all()) and bool(check_states(states, K).all())
        assert torch.equal(pack_trellis(states, K), trellis)
        # decoding through the codebook oracle on the unpacked states agrees with decode_inner
        assert torch.equal(
            place_tiles(cbmod.decode(states, VARIANTS[variant])), decode_inner(trellis, K, VARIANTS[variant])
        )


# ---- packing


@pytest.mark.parametrize("K", range(1, 9))
def test_pack_unpack_round_trip_on_recurrence_states(K: int) -> None:
    g = torch.Generator().manual_seed(K)
    symbols = torch.randint(0, 1 << K, (3, 4, 256), generator=g)
    states = _tailbiting_states(symbols, K)
    assert bool(check_wrap(states, K).all()) and bool(check_states(states, K).all())
    trellis = pack_trellis(states, K)
    assert trellis.dtype == torch.int16 and trellis.shape == (3, 4, 16 * K)
    assert torch.equal(unpack_states(trellis, K).long(), states)
    assert torch.equal(pack_trellis(symbols, K), trellis)  # bare symbols pack the same
    # and the packed words match the spec's bit-level description
    assert np.array_equal(_oracle_states_bitstream(trellis[2, 1].numpy(), K), states[2, 1].numpy())


@pytest.mark.parametrize("K", [1, 3, 8])
def test_check_wrap_rejects_broken_sequences(K: int) -> None:
    g = torch.Generator().manual_seed(7)
    states = _tailbiting_states(torch.randint(0, 1 << K, (5, 256), generator=g), K)
    broken_start = states.clone()
    broken_start[:, 0] ^= 1 << 15  # a top bit of state_0 must repeat state_255's low bits
    assert not bool(check_wrap(broken_start, K).any())
    assert not bool(check_states(broken_start, K).any())
    broken_mid = states.clone()
    broken_mid[:, 100] ^= 1 << 15
    assert bool(check_wrap(broken_mid, K).all())  # the wrap alone cannot see it ...
    assert not bool(check_states(broken_mid, K).any())  # ... the full check can
    # a non-tail-biting sequence (recurrence started from 0) fails the wrap for most tiles
    s = torch.zeros(64, dtype=torch.int64)
    seq = torch.empty(64, 256, dtype=torch.int64)
    sym = torch.randint(0, 1 << K, (64, 256), generator=g)
    for p in range(256):
        s = ((s << K) | sym[:, p]) & 0xFFFF
        seq[:, p] = s
    assert int(check_wrap(seq, K).sum()) < 16


def test_pack_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="last dim must be 256"):
        pack_trellis(torch.zeros(2, 100, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="impossible EXL3 bitrate K=9"):
        pack_trellis(torch.zeros(2, 256, dtype=torch.int64), 9)
    with pytest.raises(ValueError, match="impossible K"):
        unpack_states(torch.zeros(1, 1, 40, dtype=torch.int16))
    with pytest.raises(ValueError, match="means K=3, but K=4"):
        unpack_states(torch.zeros(1, 1, 48, dtype=torch.int16), 4)


# ---- full reconstruction


def _block_diag_had(n: int, h128: torch.Tensor) -> torch.Tensor:
    h = h128.to(torch.float64) / 128**0.5
    return torch.block_diag(*([h] * (n // 128)))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_reconstruct_vs_exllamav3_weight(variant: str) -> None:
    model, inner = _golden(variant)
    h128 = load_file(GOLDEN / "inner" / "hadamard_128.safetensors")["had_128"]
    for key in KEYS:
        trellis, suh, svh = (model[f"{key}.{s}"] for s in ("trellis", "suh", "svh"))
        w = reconstruct(trellis, suh, svh, None, VARIANTS[variant])
        k, n = w.shape
        # fp64 oracle with explicit block-diagonal matrices built from the golden H128
        w_hat = inner[f"{key}.inner"].to(torch.float64)
        oracle = (
            suh.double()[:, None]
            * (_block_diag_had(k, h128) @ w_hat @ _block_diag_had(n, h128))
            * svh.double()
        )
        assert torch.allclose(w.double(), oracle, rtol=0, atol=1e-6)
        # ExLlamaV3 rounds to fp16 between its steps; the README quotes ~7e-4 max from an fp32 decoder
        ref = inner[f"{key}.weight"].float()
        max_diff = (w - ref).abs().max().item()
        rel = ((w - ref).norm() / ref.norm()).item()
        print(f"{variant} {key}: max|Δ| {max_diff:.2e}, rel L2 {rel:.2e}")
        assert max_diff < 1e-3 and rel < 2e-3


def test_decode_speed_4096_square() -> None:
    trellis = torch.randint(-32768, 32768, (256, 256, 64), dtype=torch.int32).to(torch.int16)
    decode_inner(trellis[:1, :1], 4, CB_MUL1)  # warm the tables
    t0 = time.perf_counter()
    w = decode_inner(trellis, 4, CB_MUL1)
    dt = time.perf_counter() - t0
    print(f"decode 4096x4096 K=4: {dt * 1000:.0f} ms")
    assert w.shape == (4096, 4096)
    assert dt < 3.0  # ~0.2 s on 2 cores; the margin absorbs noisy CI machines
