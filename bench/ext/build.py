"""Build the bench extension and check it on the GPU.

The extension holds benchmark kernels that have no place in ``exl3_core._C``: today the decode-only ceiling
kernel (decode_only.cuh), registered as ``torch.ops.exl3_bench.decode_only(trellis, codebook, kt_per_warp=0)``.
It includes the product's kernel headers from csrc/, so it decodes exactly as the GEMV does.

    python bench/ext/build.py            # build bench/ext/build/exl3_bench.so (nvcc and a CUDA torch)
    python bench/ext/build.py --check    # build, then check the op on the GPU

``exl3 bench`` loads that library when it exists (or ``--ceiling-lib PATH``) for its decode-only ceiling;
bench/exl3_kernels.py uses it for the same bound. Set TORCH_CUDA_ARCH_LIST (e.g. 9.0) as for setup.py.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BUILD = HERE / "build"
NVCC_FLAGS = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]  # setup.py's


def build(verbose: bool = False) -> Path:
    """Compile decode_only_op.cu into ``BUILD/exl3_bench.so`` (setuptools, as setup.py builds exl3_core._C)."""
    from setuptools import setup
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

    if CUDA_HOME is None:
        raise SystemExit("bench/ext/build.py: no CUDA toolkit found (nvcc); the bench extension is CUDA only")
    ext = CUDAExtension("exl3_bench", [str(HERE / "decode_only_op.cu")],
                        include_dirs=[str(ROOT / "csrc"), str(HERE)],
                        extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": NVCC_FLAGS})
    args = ["build_ext", "--build-lib", str(BUILD), "--build-temp", str(BUILD / "tmp")]
    setup(name="exl3_bench", ext_modules=[ext], script_args=args if verbose else ["-q", *args],
          cmdclass={"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)})
    lib = BUILD / "exl3_bench.so"
    if not lib.is_file():
        raise SystemExit(f"bench/ext/build.py: the build wrote no {lib}")
    return lib


def _graph_us(fn, calls: int) -> float:
    """Median microseconds per call of ``fn(i)``, i < calls, replayed from one CUDA graph."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def check(lib: Path) -> None:
    """The op on the GPU: every K and codebook runs and returns its sink; bad input is refused with the
    op's name; and on one 8B-shape weight the decode-only kernel is faster than the fused GEMV over the
    same trellis (which decodes the same weights and multiplies them too) but not implausibly faster
    (a kernel whose decoding the compiler dropped would be)."""
    from exl3_core import ext
    from exl3_core.bench.run import decode_only_op

    if not torch.cuda.is_available():
        raise SystemExit("bench/ext/build.py --check: needs a CUDA device")
    op = decode_only_op(lib)
    assert op is not None
    for K in range(1, 9):
        for cb in (0, 1, 2):
            t = torch.randint(-32768, 32768, (64, 32, 16 * K), dtype=torch.int16, device="cuda")
            sink = op(t, cb, 0)
            torch.cuda.synchronize()
            if sink.dtype != torch.float32 or sink.numel() < (32 // 4) * 64:
                raise SystemExit(f"check: K={K} cb={cb}: sink {sink.dtype} of {sink.numel()} floats")
    bad = torch.zeros(4, 4, 64, dtype=torch.int16, device="cuda")  # n = 64: not a multiple of 128
    try:
        op(bad, 2, 0)
    except RuntimeError as e:
        if "exl3_bench::decode_only" not in str(e):
            raise SystemExit(f"check: the refusal does not name the op: {e}") from e
    else:
        raise SystemExit("check: n = 64 was not refused")
    if not ext.has_op("exl3_linear"):
        raise SystemExit(f"check: exl3_core._C has no CUDA linear to compare with ({ext.load_error})")
    k, n, K = 4096, 14336, 4
    l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 60 << 20)
    copies = max(2, -(-3 * l2 // (k * n * K // 8)))  # rotate through > 3x L2: the weights come from HBM
    ts = [torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=torch.int16, device="cuda")
          for _ in range(copies)]
    su = torch.randn(k, device="cuda").sign().half()
    sv = (torch.rand(n, device="cuda") * 0.01).half()
    x = torch.randn(1, k, device="cuda").half()
    t_dec = _graph_us(lambda i: op(ts[i % copies], 2, 0), copies)
    t_gemv = _graph_us(lambda i: torch.ops.exl3.exl3_linear(x, ts[i % copies], su, sv, 2, 0), copies)
    ratio = t_dec / t_gemv
    print(f"decode-only {t_dec:.2f} us, fused GEMV {t_gemv:.2f} us ({k}x{n}, K={K} MUL1, m=1): ratio {ratio:.2f}")
    if not 0.3 < ratio < 1.0:
        raise SystemExit(f"check: decode-only / GEMV time {ratio:.2f} is outside (0.3, 1.0)")
    print("bench extension: check passed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="after the build, check the op on the GPU")
    ap.add_argument("--verbose", action="store_true", help="show the compiler's output")
    a = ap.parse_args()
    lib = build(a.verbose)
    print(f"built {lib}")
    if a.check:
        check(lib)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # exl3_core of this checkout
    main()
