"""Programmatic dependent launch (PDL, Hopper and newer) across the decode step's kernels.

A kernel launched as a *programmatic dependent* of the one before it on the stream may start before
that kernel has finished; it must execute ``griddepcontrol.wait`` before reading anything the
earlier kernel wrote. A kernel that executes ``griddepcontrol.launch_dependents`` early lets its
dependent start right away instead of after its last block exits. At b=1 decode every kernel is a
few microseconds long, so the launch gap between two kernels is a visible share of the step.

* The decode-size EXL3 linear (``csrc/exl3/exl3_fused.cuh``) is always launched as a dependent; it
  signals its own dependents at once, prefetches its trellis words (which no earlier kernel
  writes), then waits before touching x or its workspace.
* The Triton kernels of the step (RMSNorm, the gated activation, RoPE, the attention split and
  combine) take a ``PDL`` flag: launched with ``launch_pdl``, they wait first, then signal.

Both signals are hints and harmless when nothing dependent follows. Whether a forward launches this
way is its tuning's (``KernelTuning.pdl``): the execution plan sets it for the duration of its forward
(:func:`exl3_core.kernels.launch.launch_config`); outside one, kernels launch with PDL where the device has it.
"""
from __future__ import annotations

import functools

import torch
import triton

from exl3_core.kernels.launch import pdl_requested

try:
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
except ImportError:  # Triton without grid dependency control: PDL stays off
    HAS_GDC = False

if not HAS_GDC:
    @triton.jit
    def gdc_launch_dependents():  # type: ignore[no-redef]
        pass

    @triton.jit
    def gdc_wait():  # type: ignore[no-redef]
        pass


@functools.cache
def _sm90_or_newer(index: int) -> bool:
    # NVIDIA only: a ROCm build also reports is_cuda, with gfx9 parts as "capability 9.x"
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def early_launch(t: torch.Tensor) -> bool:
    """Whether a kernel writing ``t`` should signal its dependents at its start."""
    return bool(t.is_cuda and HAS_GDC and pdl_requested()
                and _sm90_or_newer(t.device.index if t.device.index is not None else torch.cuda.current_device()))


def launch_opts(t: torch.Tensor) -> dict[str, bool]:
    """Launch keywords and the kernel's ``PDL`` flag for a Triton kernel writing ``t``: launched as a
    programmatic dependent (``launch_pdl``) that waits for its predecessor, then signals its own."""
    on = early_launch(t)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}
