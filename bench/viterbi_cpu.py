"""Throughput of the CPU Viterbi tile encoder (exl3::viterbi_encode, csrc/cpu/viterbi.cpp), tiles/s.

Usage (any machine with the compiled extension):
    python bench/viterbi_cpu.py [--K 1 2 4 8] [--tiles 48] [--codebook 2] [--repeats 3]

For each K it times both survivor storages (mode 1: survivor table, mode 2: cost history; the
default, mode 0, picks one per K and SIMD width) on N(0, 1) tiles after a warm-up, and prints the
median of ``repeats`` runs. All threads of torch's intra-op pool take part (torch.get_num_threads()).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from exl3_core import ext
from exl3_core.quant.exl3 import codebook as cb
from exl3_core.quant.exl3 import viterbi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--K", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tiles", type=int, default=48)
    ap.add_argument("--codebook", type=int, default=cb.CB_MUL1, choices=(0, 1, 2))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if not viterbi.has_cpp():
        raise SystemExit("viterbi_cpu: the compiled extension is not built (python setup.py build_ext --inplace)")
    op = ext.op("viterbi_encode")
    lut = viterbi._lut32(args.codebook)
    tiles = torch.randn(args.tiles, 256, generator=torch.Generator().manual_seed(0))
    print(f"threads {torch.get_num_threads()}, {args.tiles} tiles, codebook {args.codebook}")
    print("K | survivor table | cost history (tiles/s)")
    for k in args.K:
        rates = []
        for mode in (1, 2):
            op(tiles[:2], lut, k, mode)  # warm-up: workspace pages, LUT permutation
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                op(tiles, lut, k, mode)
                times.append(time.perf_counter() - t0)
            rates.append(args.tiles / statistics.median(times))
        print(f"{k} | {rates[0]:.1f} | {rates[1]:.1f}")


if __name__ == "__main__":
    main()
