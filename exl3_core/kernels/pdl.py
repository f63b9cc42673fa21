"""Early launch of dependent kernels (programmatic dependent launch, Hopper and newer).

The decode-size EXL3 linear is launched as a *programmatic dependent* of the kernel before it
(``exl3_fused.cuh``): its blocks may start before that kernel has finished, prefetch their trellis
words and wait (``griddepcontrol.wait``) before reading the activations. A kernel that signals
``griddepcontrol.launch_dependents`` at its start lets that happen right away instead of after its
last block exits. The Triton kernels that feed a linear at decode (RMSNorm, the gated activation,
the attention combine) call :func:`gdc_launch_dependents` when their ``EARLY`` flag is set; the
signal is only a hint and is harmless when nothing dependent follows. ``EXL3_PDL=0`` turns both
sides off.
"""
from __future__ import annotations

import functools

import torch
import triton

try:
    from triton.language.extra.cuda import gdc_launch_dependents
    HAS_GDC = True
except ImportError:  # Triton without grid dependency control: the flag stays off
    HAS_GDC = False

    @triton.jit
    def gdc_launch_dependents():  # type: ignore[no-redef]
        pass


@functools.cache
def _sm90_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def early_launch(t: torch.Tensor) -> bool:
    """Whether a kernel writing ``t`` should signal its dependents at its start."""
    from exl3_core import settings

    return bool(t.is_cuda and HAS_GDC and settings.get().pdl
                and _sm90_or_newer(t.device.index if t.device.index is not None else torch.cuda.current_device()))
