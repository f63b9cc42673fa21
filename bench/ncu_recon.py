"""Device helper: run ``exl3::reconstruct_full`` a few times on an 8B-shape weight (14336 x 4096 and
4096 x 14336, K=4, MUL1) so that ``ncu -k regex:recon_full`` can profile one launch.

    ncu --clock-control none -k regex:recon_full --launch-skip 2 --launch-count 1 python bench/ncu_recon.py
"""
from __future__ import annotations

import torch

from exl3_core.quant.exl3 import CB_MUL1
from exl3_core.quant.exl3.cuda_ops import reconstruct_full_cuda


def main() -> None:
    for k, n in ((4096, 14336), (14336, 4096)):
        tr = torch.randint(-32768, 32768, (k // 16, n // 16, 64), dtype=torch.int16, device="cuda")
        su = (torch.randint(0, 2, (k,), device="cuda") * 2 - 1).half()
        sv = torch.rand(n, device="cuda").half()
        for _ in range(3):
            reconstruct_full_cuda(tr, su, sv, 4, CB_MUL1)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
