"""Candidate page readers of the quantized KV cache, timed through ``exl3 bench --cache-bits`` (GPU).

On an H100 the Triton split-KV decode over K4V4 pages ran at 0.93x the fp16 cache's rate at ctx 256 and
0.88x at ctx 32768 (34% of the K4V4 roofline against 62% for fp16), so reading the pages, not their bytes,
binds. Compiled for sm_90, that reader's key loop took 900 instructions per 32 keys against 363 for fp16 pages,
68 shared-memory stores and 66 loads of them from spreading the words to values by a reshape of ``[rows,
groups, words, values per word]``. The product's reader (``exl3_core.kernels.kv_quant.dequant_tile``) now
halves each word into its fields by joins (values stay in the threads that loaded them) and makes floats by
integer ops: 668 instructions, 10 stores. Measured on an H100 before that change: ``gather`` 0.79x / 0.15x,
``splits64`` 0.97x / 0.81x, ``warps8`` 0.94x / 0.69x (ctx 256 / 32768, against the product's 0.92x / 0.87x in
the same call). The candidates here, each installed for one bench run (``a+b`` combines them), change the
quantized path only, so the run's fp16 figure is the same:

* ``product``: the reader and launch as they are (the baseline);
* ``gather``: every value loads its own word (``value // per_word``) and shifts it (``value % per_word``), so
  the tile is built in its final ``[rows, channels]`` shape with no reshape; the words a warp shares are one
  transaction, at the cost of more load instructions;
* ``splits64``: quantized decode aims at 8 programs per SM with at most 64 splits (more programs to hide the
  dequantization's latency, a longer merge);
* ``warps8``: quantized decode launched with 8 warps.

    python bench/kvq_variants.py --check                 # the candidate against the torch reference
    python bench/kvq_variants.py --variant gather+warps8 [--json OUT]   # exl3 bench 8B, b=1, ctx 256 and 32768,
                                                                       # fp16 and K4V4

The pipeline's ``kvqvar`` stage runs each variant in its own process on one device.
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


def _quant(args: object) -> bool:
    cache = getattr(getattr(args, "spec", None), "cache", None)
    return bool(cache and cache.endswith("/quant"))


def install(variant: str) -> None:
    """Route the Triton attention backend's quantized reads and launches through ``variant`` (before any kernel
    compiles)."""
    import exl3_attn_backends.triton_paged as tp

    for part in variant.split("+"):
        if part == "gather":
            tp.dequant_tile = dequant_tile_gather
        elif part == "splits64":
            choose = tp.choose_num_splits

            def splits(args, choose=choose):  # type: ignore[no-untyped-def]
                return choose(args, programs_per_sm=8, max_splits=64) if _quant(args) else choose(args)

            tp.choose_num_splits = splits
        elif part == "warps8":
            kernel = tp._decode_split

            class _Wider:
                def __init__(self, kernel) -> None:  # type: ignore[no-untyped-def]
                    self.kernel = kernel

                def __getitem__(self, grid):  # type: ignore[no-untyped-def]
                    launch = self.kernel[grid]

                    def run(*a, **kw):  # type: ignore[no-untyped-def]
                        return launch(*a, **({**kw, "num_warps": 8} if kw.get("QUANT") else kw))
                    return run

            tp._decode_split = _Wider(kernel)
        elif part != "product":
            raise SystemExit(f"unknown variant {part!r}: product, gather, splits64, warps8 (joined by +)")


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
