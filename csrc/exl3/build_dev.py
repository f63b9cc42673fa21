"""Fallback developer build of the EXL3 CUDA ops via torch.utils.cpp_extension.load (JIT).

setup.py is the real build (``TORCH_CUDA_ARCH_LIST=9.0 python setup.py build_ext --inplace``); this
loads the same sources as a throwaway module so ``torch.ops.exl3.*`` exist for quick experiments.
Note ``exl3_core.ext.has_op`` still reports False: it requires ``exl3_core._C``.
"""
from __future__ import annotations

import glob
import os

from torch.utils.cpp_extension import load


def build(verbose: bool = True) -> object:
    here = os.path.dirname(os.path.abspath(__file__))
    srcs = sorted(glob.glob(os.path.join(here, "*.cu")))
    return load(
        name="exl3_cuda_dev",
        sources=srcs,
        extra_cuda_cflags=["-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr",
                           "-gencode=arch=compute_90,code=sm_90"],
        extra_include_paths=[os.path.dirname(here)],
        verbose=verbose,
        is_python_module=False,
    )


if __name__ == "__main__":
    build()
    import torch

    print("ops:", [n for n in ("reconstruct", "exl3_gemm", "exl3_gemm_xh", "had128", "decode_bench")
                   if hasattr(torch.ops.exl3, n)])
