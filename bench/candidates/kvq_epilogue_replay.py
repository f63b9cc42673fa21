"""Candidate kvq_epilogue: the epilogue's quantized store (csrc quant_store in its patch) replayed lane by lane in
numpy fp32 against :func:`exl3_core.reference.kv_quant.quantize` (CPU; what the GPU test checks on the device).

Each 32-column group is 8 lanes of 4 values: widths 1 and 2 of the H32 butterfly inside a lane, widths 4, 8, 16
across lanes (the lane holding a pair's first half keeps a + b, the other a - b), the 1/sqrt(32) scale, the
group's max-abs scale, midpoint codes with IEEE division, and each bit plane's words OR-reduced over the lanes
that share them. Exits non-zero on any difference.

    python bench/candidates/kvq_epilogue_replay.py [--rows 300] [--seed 0]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from exl3_core.reference import kv_quant as kq

INV_SQRT32 = np.float32(0.17677669529663688)


def replay(row: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """fp16 ``row [C]`` -> (int32 words ``[C / 32 * bits]``, fp16 scales ``[C / 32]``) as the lanes compute them."""
    groups = row.shape[0] // 32
    words = np.zeros(groups * bits, dtype=np.uint32)
    scales = np.zeros(groups, dtype=np.float16)
    m, top = np.float32(1 << (bits - 1)), np.float32((1 << bits) - 1)
    for g in range(groups):
        y = [row[g * 32 + 4 * p:g * 32 + 4 * p + 4].astype(np.float32) for p in range(8)]
        for v in y:  # widths 1 and 2 inside the lane
            v[0], v[1] = v[0] + v[1], v[0] - v[1]
            v[2], v[3] = v[2] + v[3], v[2] - v[3]
            v[0], v[2] = v[0] + v[2], v[0] - v[2]
            v[1], v[3] = v[1] + v[3], v[1] - v[3]
        for d in (1, 2, 4):  # across lanes, as __shfl_xor_sync with lane mask d
            y = [(y[p ^ d] - y[p] if p & d else y[p] + y[p ^ d]).astype(np.float32) for p in range(8)]
        y = [(v * INV_SQRT32).astype(np.float32) for v in y]
        s = np.float32(min(np.float32(max(float(np.abs(v).max()) for v in y)) + np.float32(1e-10), np.float32(65504)))
        scales[g] = np.float16(s)
        code = [np.clip(np.floor((v / s).astype(np.float32) * m + m), 0, top).astype(np.int64) for v in y]
        low, first = bits, 0
        for w in (8, 4, 2, 1):
            if not bits & w:
                continue
            low -= w
            lane = [sum(((int(code[p][j]) >> low) & ((1 << w) - 1)) << (((4 * p + j) * w) & 31) for j in range(4))
                    for p in range(8)]
            share, d = 8 // w, 1
            while d < share:  # the OR reduction over the lanes sharing a word
                lane = [lane[p] | lane[p ^ d] for p in range(8)]
                d <<= 1
            for p in range(0, 8, share):
                words[g * bits + first + (p * w >> 3)] = lane[p]
            first += w
    return words.view(np.int32), scales


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    bad = 0
    for i in range(a.rows):
        bits, channels = int(rng.integers(2, 9)), 32 * int(rng.integers(1, 5))
        x = (rng.standard_normal(channels) * rng.choice([0.01, 1.0, 30.0, 1000.0])).astype(np.float16)
        if i % 7 == 0:  # an outlier (or a zero) in one channel
            x[rng.integers(0, channels)] = np.float16(rng.choice([60000.0, -60000.0, 0.0]))
        words, scales = replay(x, bits)
        want_w, want_s = kq.quantize(torch.from_numpy(x.astype(np.float32))[None], bits)
        bad += not (np.array_equal(words, want_w[0].numpy()) and np.array_equal(scales, want_s[0].numpy()))
    print(f"{a.rows} rows: {bad} differ from the reference")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
