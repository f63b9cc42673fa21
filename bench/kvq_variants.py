"""Candidate page readers of the quantized KV cache, timed through ``exl3 bench --cache-bits`` (GPU).

On an H100 the Triton split-KV decode over K4V4 pages ran at 0.93x the fp16 cache's rate at ctx 256 and
0.88x at ctx 32768 (34% of the K4V4 roofline against 62% for fp16), so reading the pages, not their bytes,
binds. The product's reader (``exl3_core.kernels.kv_quant.dequant_tile``) loads each group's bit-plane words
once and spreads them to 32 values by a reshape of ``[rows, groups, words, values per word]``, which Triton
may lower through shared memory. The candidate here, installed in place of it for one bench run:

* ``product``: the reader as it is (the baseline);
* ``gather``: every value loads its own word (``value // per_word``) and shifts it (``value % per_word``), so
  the tile is built in its final ``[rows, channels]`` shape with no reshape; the words a warp shares are one
  transaction, at the cost of more load instructions.

    python bench/kvq_variants.py --check                 # the candidate against the torch reference
    python bench/kvq_variants.py --variant gather [--json OUT]   # exl3 bench 8B, b=1, ctx 256 and 32768, fp16 and K4V4

The pipeline's ``kvqvar`` stage runs both variants, each in its own process, on one device.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_plane(Codes, base, ok, i, W: tl.constexpr, LOW: tl.constexpr, FIRST: tl.constexpr):
    # int32 [rows, channels]: the W-bit plane of each value (i: its index within its group), at bits LOW..
    PER: tl.constexpr = 32 // W
    word = tl.load(Codes + base + FIRST + (i // PER)[None, :], mask=ok, other=0)
    return ((word >> ((i % PER) * W)[None, :]) & ((1 << W) - 1)) << LOW


@triton.jit
def dequant_tile_gather(Codes, Scales, code_row, scale_row, n_ok, G0, NG, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_G: tl.constexpr):
    """``dequant_tile``'s contract (fp32 ``[BLOCK_N, BLOCK_G * 32]``, rotated basis, zeros where not ``n_ok`` or
    past NG), built in its final shape."""
    c = tl.arange(0, BLOCK_G * 32)
    g = c // 32
    i = c % 32
    ok = n_ok[:, None] & (g < NG)[None, :]
    s = tl.load(Scales + scale_row[:, None] + (G0 + g)[None, :], mask=ok, other=0.0).to(tl.float32)
    base = code_row[:, None] + ((G0 + g) * BITS)[None, :]
    code = tl.zeros([BLOCK_N, BLOCK_G * 32], tl.int32)
    if BITS & 8:
        code = code | _gather_plane(Codes, base, ok, i, 8, BITS & 7, 0)
    if BITS & 4:
        code = code | _gather_plane(Codes, base, ok, i, 4, BITS & 3, BITS & 8)
    if BITS & 2:
        code = code | _gather_plane(Codes, base, ok, i, 2, BITS & 1, BITS & 12)
    if BITS & 1:
        code = code | _gather_plane(Codes, base, ok, i, 1, 0, BITS & 14)
    M: tl.constexpr = 1 << (BITS - 1)
    return (code.to(tl.float32) - (M - 0.5)) * (s * (1.0 / M))


@triton.jit
def _check_kernel(Codes, Scales, Out, T, NG: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_G: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rows < T
    r64 = rows.to(tl.int64)
    v = dequant_tile_gather(Codes, Scales, r64 * (NG * BITS), r64 * NG, n_ok, 0, NG, BITS, BLOCK_N, BLOCK_G)
    c = tl.arange(0, BLOCK_G * 32)
    tl.store(Out + r64[:, None] * (NG * 32) + c[None, :], v, mask=n_ok[:, None] & (c < NG * 32)[None, :])


def check(device: torch.device) -> None:
    """The candidate against the torch reference's rotated-basis dequantization, every width, ragged shapes."""
    from exl3_core.reference import kv_quant as ref

    g = torch.Generator().manual_seed(0)
    for bits in range(2, 9):
        for tokens, groups in ((1, 4), (13, 3), (40, 8)):
            x = (torch.randn(tokens, groups * 32, generator=g) * 3).to(device)
            words, scales = ref.quantize(x, bits)
            want = ref.dequantize_rotated(words, scales, bits)
            out = torch.full_like(want, float("nan"))
            block_g = triton.next_power_of_2(groups)
            _check_kernel[(triton.cdiv(tokens, 16),)](words.contiguous(), scales.contiguous(), out, tokens, NG=groups,
                                                      BITS=bits, BLOCK_N=16, BLOCK_G=block_g)
            assert torch.equal(out, want), (bits, tokens, groups, float((out - want).abs().max()))
    print("gather reader equals the reference, bits 2-8 (bit for bit)")


def install(variant: str) -> None:
    """Route the Triton attention backend's page reads through ``variant`` (before any kernel compiles)."""
    import exl3_attn_backends.triton_paged as tp

    if variant == "gather":
        tp.dequant_tile = dequant_tile_gather
    elif variant != "product":
        raise SystemExit(f"unknown variant {variant!r}: product or gather")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="product")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.check:
        check(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        return
    install(a.variant)
    from exl3_core.cli import main as exl3

    args = ["bench", "--shape", "8b", "--codebook", "mul1", "--contexts", "256,32768", "--batches", ",",
            "--prefill", "0", "--cache-bits", "16", "--cache-bits", "4"]
    sys.exit(exl3(args + (["--json", a.json] if a.json else [])))


if __name__ == "__main__":
    main()
