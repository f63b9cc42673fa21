"""Fallback developer build of the EXL3 CUDA ops via torch.utils.cpp_extension.load (JIT).

setup.py is the real build (``TORCH_CUDA_ARCH_LIST=9.0 python setup.py build_ext --inplace``); this
loads the same sources as a throwaway module so ``torch.ops.exl3.*`` exist for quick experiments.
Note ``exl3_core.ext.has_op`` still reports False: it requires ``exl3_core._C``.
"""
from __future__ import annotations

import glob
import os

from torch.utils.cpp_extension import load


def build(name: str = "exl3_cuda_dev", defines: tuple[str, ...] = (), verbose: bool = True) -> str:
    """Compile csrc/exl3/*.cu (with extra ``-D`` defines, for kernel variants); returns the .so path."""
    here = os.path.dirname(os.path.abspath(__file__))
    srcs = sorted(glob.glob(os.path.join(here, "*.cu")))
    return load(
        name=name,
        sources=srcs,
        extra_cuda_cflags=["-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr",
                           "-gencode=arch=compute_90,code=sm_90", *(f"-D{d}" for d in defines)],
        extra_include_paths=[os.path.dirname(here)],
        verbose=verbose,
        is_python_module=False,
    )


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--name", default="exl3_cuda_dev")
    ap.add_argument("--define", action="append", default=[], help="NAME=VALUE, e.g. EXL3_RING_STAGES=4")
    a = ap.parse_args()
    build(a.name, tuple(a.define), verbose=False)
    import torch

    print("built", a.name, "ops:", [n for n in ("reconstruct", "exl3_gemm", "exl3_gemm_xh", "had128", "decode_bench")
                                    if hasattr(torch.ops.exl3, n)])
