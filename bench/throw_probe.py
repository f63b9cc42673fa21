"""Whether a TORCH_CHECK thrown inside a C++ extension reaches Python as a RuntimeError on this machine, for
an extension built with given compiler flags (a separate process per variant: a crash ends only it). A probe
of the device image's "TORCH_CHECK segfaults" record (tests/gpu/test_exl3_kernels.py).

    python bench/throw_probe.py NAME [cflag ...]      # builds op probe_NAME::boom, calls it, prints the outcome
"""
from __future__ import annotations

import sys
import tempfile

import torch
from torch.utils.cpp_extension import load_inline

SRC = r"""
#include <ATen/ATen.h>
#include <torch/library.h>
static void boom(const at::Tensor& t) { TORCH_CHECK(t.dim() == 9, "probe: want 9 dims, got ", t.dim()); }
static void warn(const at::Tensor& t) { TORCH_WARN("probe warning, dims ", t.dim()); }
TORCH_LIBRARY_FRAGMENT(NAME, m) {
    m.def("boom(Tensor t) -> ()");
    m.def("warn(Tensor t) -> ()");
    m.impl("boom", c10::DispatchKey::CompositeExplicitAutograd, &boom);
    m.impl("warn", c10::DispatchKey::CompositeExplicitAutograd, &warn);
}
"""


def main() -> None:
    name, flags = f"probe_{sys.argv[1]}", sys.argv[2:]
    ld = ["-fopenmp"] if "-fopenmp" in flags else []
    load_inline(name=name, cpp_sources=SRC.replace("NAME", name), extra_cflags=flags, extra_ldflags=ld,
                is_python_module=False, build_directory=tempfile.mkdtemp(), verbose=False)
    ns = getattr(torch.ops, name)
    for op in ("warn", "boom"):
        print(f"{name} {flags}: calling {op}", flush=True)
        try:
            getattr(ns, op)(torch.zeros(2))
            print(f"{name}: {op} returned", flush=True)
        except RuntimeError as e:
            print(f"{name}: {op} raised RuntimeError: {str(e).splitlines()[0]}", flush=True)


if __name__ == "__main__":
    main()
