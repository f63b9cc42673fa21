"""Codes shared by the Triton kernels, the compiled kernels and their callers."""
from __future__ import annotations

#: gated activations with a fused ``act(gate) * up`` -> their kernel codes: the Triton act*mul kernel
#: (exl3_core.kernels.fused) and the compiled linear's prologue (csrc exl3_fused.cuh FUSED_ACT_*)
ACT_CODES: dict[str, int] = {"silu": 0, "gelu_tanh": 1}
