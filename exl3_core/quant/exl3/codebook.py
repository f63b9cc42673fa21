"""Procedural EXL3 codebooks: 16-bit trellis state -> fp16 weight (format spec section 2).

Pure torch, vectorised, bit-exact. This is the oracle every kernel is tested against, and the
Viterbi encoder builds its 65536-entry lookup tables from it.
"""
from __future__ import annotations

import functools

import torch

CB_3INST = 0
CB_MCG = 1
CB_MUL1 = 2
CODEBOOK_NAMES = {"3inst": CB_3INST, "mcg": CB_MCG, "mul1": CB_MUL1}

MCG_MULT = 0xCBAC1FED
MUL1_MULT = 0x83DCD12D
_3INST_MULT = 89226354
_3INST_ADD = 64248484
# MUL1 affine map, fp16 constants 0x1EEE (1774/2^18) and 0xC931 (-10.3828125)
MUL1_INV = 1774.0 / 2.0**18
MUL1_BIAS = -10.3828125
# RMS of the 3INST codebook over all states (quantizer's input-scale constant)
CODEBOOK_SCALE_3INST = 1.24371088


def _u16_to_f16(bits: torch.Tensor) -> torch.Tensor:
    """Reinterpret integer tensor holding 0..65535 as fp16 bit patterns."""
    signed = torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16)
    return signed.view(torch.float16)


def decode(states: torch.Tensor, codebook: int) -> torch.Tensor:
    """Map 16-bit states (any integer dtype, values 0..65535) to fp16 weights, bit-exactly."""
    if codebook == CB_MUL1:
        # decode_exact's value is exact in fp32, so one rounding to fp16 equals the kernel's
        # single-rounding fp16 fma
        return decode_exact(states, codebook).to(torch.float16)
    s = states.to(torch.int64) & 0xFFFF
    if codebook == CB_3INST:
        x = (s * _3INST_MULT + _3INST_ADD) & 0xFFFFFFFF
    elif codebook == CB_MCG:
        x = (s * MCG_MULT) & 0xFFFFFFFF
    else:
        raise ValueError(f"unknown EXL3 codebook id {codebook!r}; expected 0 (3inst), 1 (mcg) or 2 (mul1)")
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = _u16_to_f16(x & 0xFFFF).to(torch.float32)
    hi = _u16_to_f16(x >> 16).to(torch.float32)
    return (lo + hi).to(torch.float16)  # exact fp32 sum, rounded once like __hadd


def decode_exact(states: torch.Tensor, codebook: int) -> torch.Tensor:
    """The codebook values before their final fp16 rounding, as fp32 (exact for every codebook).

    Only MUL1 differs from :func:`decode`, which rounds these values once to fp16; 3INST and MCG
    produce fp16 values directly, so this is :func:`decode` in fp32.
    """
    if codebook != CB_MUL1:
        return decode(states, codebook).to(torch.float32)
    s = states.to(torch.int64) & 0xFFFF
    x = (s * MUL1_MULT) & 0xFFFFFFFF
    b = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
    # (1024 + b) * k_inv + k_bias is exact in fp32 (22 significant bits)
    return (1024 + b).to(torch.float32) * MUL1_INV + MUL1_BIAS


@functools.cache
def lut_exact(codebook: int) -> torch.Tensor:
    """:func:`decode_exact` of all 65536 states (fp32). Cached; treat as read-only."""
    return decode_exact(torch.arange(65536, dtype=torch.int64), codebook)


@functools.cache
def lut(codebook: int) -> torch.Tensor:
    """All 65536 codebook values as fp16 (index = state). Cached; treat as read-only."""
    return decode(torch.arange(65536, dtype=torch.int64), codebook)
