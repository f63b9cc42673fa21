"""Throughput of the CUDA Viterbi tile encoder (exl3::viterbi_encode on CUDA), tiles/s per K.

Usage (CUDA machine, extension built with nvcc):
    PYTHONPATH=. python bench/viterbi_cuda.py [--K 1 2 3 4 5 6 7 8] [--codebook 0] [--waves 4] [--check 64]

Tiles are N(0, rms^2) at the codebook's RMS. Each K runs ``waves`` full waves of resident blocks
(one block per SM encodes T tiles at a time: T = 1 for K <= 3, 2 for K = 4, 4 for K >= 5), timed with
CUDA events after a warm-up, median of 3. ``--check N`` compares the first N tiles with the CPU op.
The last column extrapolates to 29M tiles (an 8B-parameter model's linear layers).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from exl3_core import ext
from exl3_core.quant.exl3 import codebook as cb

TILES_PER_BLOCK = {1: 1, 2: 1, 3: 1, 4: 2, 5: 4, 6: 4, 7: 4, 8: 4}
MODEL_TILES = 29e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--K", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--codebook", type=int, default=cb.CB_3INST, choices=(0, 1, 2))
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--check", type=int, default=0, help="compare the first N tiles with the CPU op")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/viterbi_cuda.py: needs a CUDA device")
    if not (ext.has_op("viterbi_encode")
            and torch._C._dispatch_has_kernel_for_dispatch_key("exl3::viterbi_encode", "CUDA")):
        raise SystemExit("bench/viterbi_cuda.py: exl3::viterbi_encode has no CUDA kernel; build with "
                         f"TORCH_CUDA_ARCH_LIST=9.0 python setup.py build_ext --inplace ({ext.load_error})")
    vit = ext.op("viterbi_encode")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lut = cb.lut(a.codebook).float()
    lut_d = lut.cuda()
    rms = float(lut.pow(2).mean().sqrt())
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs, codebook {a.codebook}")
    print(f"{'K':>2} {'tiles':>7} {'ms':>9} {'tiles/s':>11} {'29M tiles':>10}  check")
    for K in a.K:
        n = sms * TILES_PER_BLOCK[K] * a.waves
        tiles = torch.randn(n, 256, device="cuda") * rms
        vit(tiles[: TILES_PER_BLOCK[K]], lut_d, K)  # warm-up: kernel attributes, allocator
        times = []
        for _ in range(3):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            out = vit(tiles, lut_d, K)
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        dt = statistics.median(times)
        check = ""
        if a.check:
            m = min(a.check, n)
            ref = vit(tiles[:m].cpu(), lut, K)
            bad = int((out[:m].cpu() != ref).any(dim=1).sum())
            check = "identical" if bad == 0 else f"{bad}/{m} tiles DIFFER"
        print(f"{K:>2} {n:>7} {dt * 1e3:>9.2f} {n / dt:>11,.0f} {MODEL_TILES * dt / n / 60:>8.1f} min  {check}")


if __name__ == "__main__":
    main()
