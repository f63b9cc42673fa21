"""Build wiring for the optional compiled extension ``exl3_core._C`` (csrc/).

Metadata lives in pyproject.toml. The extension is optional: without a compiler, or if the
build fails, exl3-core installs as pure Python and every op falls back to torch. CUDA sources
(csrc/**/*.cu) are compiled only when nvcc is found; CPU sources (csrc/**/*.cpp) always.
Each source registers its ops with TORCH_LIBRARY_FRAGMENT(exl3, m), so there is no central
binding table to edit when a kernel is added.
"""
from __future__ import annotations

import glob
import os
import sys

from setuptools import setup


def _ext_modules() -> tuple[list, dict]:
    try:
        from torch.utils import cpp_extension as ce
    except ImportError:  # build isolation without torch: pure-Python install
        return [], {}
    cpp = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    cu = sorted(glob.glob("csrc/**/*.cu", recursive=True))
    if not cpp and not cu:
        return [], {}
    use_cuda = bool(cu) and ce.CUDA_HOME is not None and os.path.exists(os.path.join(ce.CUDA_HOME, "bin", "nvcc"))
    cxx = ["-O3", "-std=c++17", "-fopenmp"] + (["-march=native"] if sys.platform == "linux" else [])
    args = {"cxx": cxx}
    if use_cuda:
        args["nvcc"] = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]
        ext = ce.CUDAExtension("exl3_core._C", cpp + cu, extra_compile_args=args,
                               extra_link_args=["-fopenmp"], include_dirs=[os.path.abspath("csrc")])
    else:
        ext = ce.CppExtension("exl3_core._C", cpp, extra_compile_args=args,
                              extra_link_args=["-fopenmp"], include_dirs=[os.path.abspath("csrc")])

    class OptionalBuild(ce.BuildExtension):
        def run(self) -> None:
            try:
                super().run()
            except Exception as e:  # noqa: BLE001 - the extension is optional by design
                print(f"WARNING: exl3_core._C was not built ({e}); falling back to pure torch", file=sys.stderr)

    return [ext], {"build_ext": OptionalBuild.with_options(no_python_abi_suffix=True)}


ext_modules, cmdclass = _ext_modules()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
