"""CPU model of recon_full_kernel (exl3_recon_full.cuh): the same thread/register index math and the
same operation order, so its output should equal the kernel's bit for bit. ``half=False`` models the
default fp32 kernel, ``half=True`` the half2 kernel used for K <= EXL3_RF_HALF_MAX_K (half2 butterflies, every stage rounded
to fp16, swizzled fp16 smem tile, pass-2 lane bits for row bits 0 and 3 swapped).

Checks (python3 csrc/exl3/recon_full_emu.py): each pass covers every element of a 128x128 block
exactly once; pass-1 scalar smem stores and pass-2 16-byte smem loads are bank-conflict free (fp32:
132-float row stride; half: 136-half row stride plus the chunk XOR); each thread's 8 pass-2 values
per (rr, j) are 8 contiguous, 16-byte aligned columns (one 16-byte global store); and the emulated
fp16 output passes the GPU test's oracle check for every K and codebook, for both variants.
"""
from __future__ import annotations

import torch

RS = 132  # smem row stride in floats (RF_RS)
RS_H = 136  # half variant: smem row stride in halves (RFH_RS)


def rnd16(x: torch.Tensor) -> torch.Tensor:
    """Round fp64 to fp16 and back (one fp16 operation: exact in fp64 for sums/products of fp16)."""
    return x.to(torch.float16).to(torch.float64)


def wht_half(v: torch.Tensor) -> torch.Tensor:
    """The half variant's 7 stages over the register index e (fp64 holding fp16 values): the half2
    stages over e bits 1..6 in increasing order (rf_wht64h), then e bit 0 (inside each half2), every
    result rounded to fp16."""
    v = v.clone()
    i = torch.arange(128)
    for s in (2, 4, 8, 16, 32, 64, 1):
        lo = i[(i & s) == 0]
        hi = lo | s
        a, b = v[..., lo].clone(), v[..., hi].clone()
        v[..., lo] = rnd16(a + b)
        v[..., hi] = rnd16(a - b)
    return v


def wht_regs(v: torch.Tensor) -> torch.Tensor:
    """Unnormalized WHT over the last dim (128 register values), stages s = 1, 2, ..., 64 in fp32."""
    v = v.clone()
    i = torch.arange(128)
    s = 1
    while s < 128:
        lo = i[(i & s) == 0]
        hi = lo | s
        a, b = v[..., lo].clone(), v[..., hi].clone()
        v[..., lo] = a + b
        v[..., hi] = a - b
        s <<= 1
    return v


def pass1_map() -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) in the block of thread t's register e after decode: e = b|h<<1|nb<<2|tcl<<3|tr<<4."""
    t = torch.arange(128)[:, None]
    e = torch.arange(128)[None, :]
    lane, w = t & 31, t >> 5
    q, g = lane & 3, lane >> 2
    b, h, nb, tcl, tr = e & 1, (e >> 1) & 1, (e >> 2) & 1, (e >> 3) & 1, e >> 4
    return b + 2 * q + 8 * h + 16 * tr, g + 8 * nb + 16 * (2 * w + tcl)


def pass2_map() -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of thread t's register e in pass 2: e = c|rr<<3|j<<5."""
    t = torch.arange(128)[:, None]
    e = torch.arange(128)[None, :]
    lane, w = t & 31, t >> 5
    rowbase = ((lane >> 2) & 1) + 8 * ((lane >> 3) & 1) + 16 * ((lane >> 4) & 1) + 32 * w
    colbase = 8 * (lane & 1) + 16 * ((lane >> 1) & 1)
    c, rr, j = e & 7, (e >> 3) & 3, e >> 5
    return rowbase + 2 * rr, colbase + c + 32 * j


def pass2_map_half(t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Half variant: (row, col) of thread t's register e in pass 2, e = c|rr<<3|j<<5 (the half2 index
    is e >> 1, the pair bit c & 1); lane bit 2 carries row bit 3 and lane bit 3 row bit 0."""
    t = torch.arange(128)[:, None] if t is None else t
    e = torch.arange(128)[None, :]
    lane, w = t & 31, t >> 5
    rowbase = ((lane >> 3) & 1) + 8 * ((lane >> 2) & 1) + 16 * ((lane >> 4) & 1) + 32 * w
    colbase = 8 * (lane & 1) + 16 * ((lane >> 1) & 1)
    c, rr, j = e & 7, (e >> 3) & 3, e >> 5
    return rowbase + 2 * rr, colbase + c + 32 * j


def smem_half(r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Half variant: smem offset in halves of block element (r, c): 16-byte chunk (c >> 3) with its
    bit 2 XORed by row bit 3, rows RS_H halves apart."""
    return r * RS_H + (((c >> 3) ^ (((r >> 3) & 1) << 2)) << 3) + (c & 7)


def emulate(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, K: int, cb: int,
            half: bool = False) -> torch.Tensor:
    """The kernel's fp16 [k, n] output, computed block by block with its index math and op order."""
    from exl3_core.quant.exl3.trellis import decode_inner

    if half:
        return _emulate_half(trellis, suh, svh, K, cb)
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    w_hat = decode_inner(trellis, K, cb).float()
    r1, c1 = pass1_map()
    r2, c2 = pass2_map()
    su = suh.to(torch.float16).float() * 0.0078125
    sv = svh.to(torch.float16).float()
    # all blocks at once: [k/128, n/128, 128, 128]
    blocks = w_hat.reshape(k // 128, 128, n // 128, 128).transpose(1, 2)
    smem = torch.full_like(blocks, float("nan"))
    smem[:, :, r1, c1] = wht_regs(blocks[:, :, r1, c1])
    v = wht_regs(smem[:, :, r2, c2])
    rows = torch.arange(k // 128)[:, None, None, None] * 128 + r2
    cols = torch.arange(n // 128)[None, :, None, None] * 128 + c2
    y = (v * su[rows]) * sv[cols]
    out = torch.full((k, n), float("nan"), dtype=torch.float16)
    out[rows.expand_as(y), cols.expand_as(y)] = y.to(torch.float16)
    return out


def _emulate_half(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, K: int, cb: int) -> torch.Tensor:
    """recon_full_half_kernel: decoded values * 2^-7, 14 fp16-rounded stages, then ((a +- b) * suh) * svh with
    each product rounded to fp16. The smem transpose only moves values, so it is modelled by the maps
    (check_layout verifies that the swizzled addresses are a bijection)."""
    from exl3_core.quant.exl3.trellis import decode_inner

    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    w_hat = rnd16(decode_inner(trellis, K, cb).double() * 0.0078125)
    r1, c1 = pass1_map()
    r2, c2 = pass2_map_half()
    su = suh.to(torch.float16).double()
    sv = svh.to(torch.float16).double()
    blocks = w_hat.reshape(k // 128, 128, n // 128, 128).transpose(1, 2)
    smem = torch.full_like(blocks, float("nan"))
    smem[:, :, r1, c1] = wht_half(blocks[:, :, r1, c1])
    v = wht_half(smem[:, :, r2, c2])
    rows = torch.arange(k // 128)[:, None, None, None] * 128 + r2
    cols = torch.arange(n // 128)[None, :, None, None] * 128 + c2
    y = rnd16(rnd16(v * su[rows]) * sv[cols])
    out = torch.full((k, n), float("nan"), dtype=torch.float16)
    out[rows.expand_as(y), cols.expand_as(y)] = y.to(torch.float16)
    return out


def check_layout_half() -> None:
    r1, c1 = pass1_map()
    r2, c2 = pass2_map_half()
    for r, c in ((r1, c1), (r2, c2)):
        assert torch.equal((r * 128 + c).flatten().sort().values, torch.arange(128 * 128)), "coverage"
    a1, a2 = smem_half(r1, c1), smem_half(r2, c2)
    assert torch.equal(a1.flatten().sort().values, a2.flatten().sort().values), "same smem cells"
    assert a1.unique().numel() == 128 * 128 and (a1 < 128 * RS_H).all(), "swizzle is a bijection into the tile"
    for w in range(4):
        for e in range(128):  # one STS.U16 per value: distinct 32-bit words in distinct banks
            words = (a1[32 * w:32 * w + 32, e] >> 1).unique()
            assert len({x % 32 for x in words.tolist()}) == words.numel(), (w, e)
    # 8 contiguous columns per (rr, j) at a 16-byte aligned address: one LDS.128 and one 16-byte STG
    assert torch.equal(c2[:, 7::8] - c2[:, 0::8], torch.full((128, 16), 7)) and (c2[:, 0::8] % 8 == 0).all()
    assert torch.equal(a2[:, 7::8] - a2[:, 0::8], torch.full((128, 16), 7)) and (a2[:, 0::8] % 8 == 0).all()
    for t0 in range(0, 128, 8):  # LDS.128 in quarter-warp phases: 8 lanes x 16 bytes, all 32 banks
        for e in range(0, 128, 8):
            chunks = {(a // 8) % 8 for a in a2[t0:t0 + 8, e].tolist()}
            assert len(chunks) == 8, (t0, e)


def check_layout() -> None:
    r1, c1 = pass1_map()
    r2, c2 = pass2_map()
    for r, c in ((r1, c1), (r2, c2)):
        assert torch.equal((r * 128 + c).flatten().sort().values, torch.arange(128 * 128)), "coverage"
    addr1 = r1 * RS + c1
    for w in range(4):
        for e in range(128):  # one STS.32 per register: 32 lanes, 32 distinct banks
            assert len(set((addr1[32 * w:32 * w + 32, e] % 32).tolist())) == 32, (w, e)
    addr2 = r2 * RS + c2
    assert torch.equal(c2[:, 3::4] - c2[:, 0::4], torch.full((128, 32), 3)) and (addr2[:, 0::4] % 4 == 0).all()
    for t0 in range(0, 128, 8):  # LDS.128 runs in quarter-warp phases: 8 lanes x 4 banks, all distinct
        for e in range(0, 128, 4):
            banks = {(a + i) % 32 for a in addr2[t0:t0 + 8, e].tolist() for i in range(4)}
            assert len(banks) == 32, (t0, e)
    assert torch.equal(c2[:, 7::8] - c2[:, 0::8], torch.full((128, 16), 7)) and (c2[:, 0::8] % 8 == 0).all()


if __name__ == "__main__":
    import importlib.util
    import os

    check_layout()
    check_layout_half()
    print("layout ok (fp32 and half variants): coverage, bank conflicts, 16-byte stores")
    # the GPU test's own tolerance check, applied to the emulated kernel output
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        "trf", os.path.join(here, "..", "..", "tests", "gpu", "test_reconstruct_full.py"))
    trf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trf)
    torch.manual_seed(0)
    worst = 0.0
    for K in range(1, 9):
        for cb in (0, 1, 2):
            tr = trf.rand_trellis(256, 384, K)
            suh, svh = trf.rand_scales(256, 384)
            half = K <= trf.RF_HALF_MAX_K  # the kernel the launcher picks for this K
            out = emulate(tr, suh, svh, K, cb, half=half)
            trf.check_against_oracle(out, tr, suh, svh, K, cb, f"emulated {'half' if half else 'fp32'} K={K} cb={cb}")
            if half:
                worst = max(worst, trf.rel_err(out, trf.dequantize_padded(tr, suh, svh, K, cb)))
    print(f"emulated kernel output (half2 for K <= {trf.RF_HALF_MAX_K}, fp32 above) within the GPU test's tolerances "
          f"for K=1..8 x 3 codebooks; half2 worst rel-L2 {worst:.2e}")
