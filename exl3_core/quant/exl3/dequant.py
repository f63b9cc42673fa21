"""Full EXL3 dequantization to the original basis (format spec 4.2) and codebook detection (1.3)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Mapping

import torch

from exl3_core.quant.exl3 import codebook as _cb
from exl3_core.quant.exl3.hadamard import had_blockwise
from exl3_core.quant.exl3.trellis import decode_inner

# marker tensors are 0-dim int32 holding the (locked) multiplier reinterpreted as signed
MARKER_VALUES = {"mcg": _cb.MCG_MULT, "mul1": _cb.MUL1_MULT}
MARKER_CODEBOOK = {"mcg": _cb.CB_MCG, "mul1": _cb.CB_MUL1}

TensorSource = Callable[[str], "torch.Tensor | None"] | Mapping[str, torch.Tensor] | Collection[str]


def marker_int32(name: str) -> int:
    """The signed int32 a writer stores in the ``mcg``/``mul1`` marker tensor."""
    v = MARKER_VALUES[name]
    return v - (1 << 32) if v >= 1 << 31 else v


def codebook_from_markers(
    module_key: str, mcg: torch.Tensor | bool | None, mul1: torch.Tensor | bool | None
) -> int:
    """Codebook id from the two optional marker tensors of one module (spec 1.3).

    Pass the marker tensor, ``True`` (present, value unknown) or ``None``/``False`` (absent).
    Both present is an error (the reference engine's GEMM refuses it too). A marker whose value is not the
    locked constant warns: such checkpoints came from experimental pre-2025-10 builds whose
    custom multiplier current decoders (this one included) ignore.
    """
    present = {name: m for name, m in (("mcg", mcg), ("mul1", mul1)) if m is not None and m is not False}
    if len(present) == 2:
        raise ValueError(
            f"{module_key}: both {module_key}.mcg and {module_key}.mul1 are present; an EXL3 tensor uses "
            f"one codebook, so the checkpoint is malformed (remove one marker; the reference engine "
            f"refuses it too)"
        )
    if not present:
        return _cb.CB_3INST
    name, marker = next(iter(present.items()))
    if isinstance(marker, torch.Tensor):
        if marker.numel() != 1 or marker.dtype.is_floating_point:
            warnings.warn(
                f"{module_key}.{name}: marker should be a 0-dim int32, got {marker.dtype} "
                f"{tuple(marker.shape)}; using the {name} codebook anyway",
                stacklevel=2,
            )
        else:
            value = int(marker.reshape(-1)[0].item()) & 0xFFFFFFFF
            if value != MARKER_VALUES[name]:
                warnings.warn(
                    f"{module_key}.{name}: marker value {value:#010x} differs from the locked multiplier "
                    f"{MARKER_VALUES[name]:#010x}; this checkpoint probably predates 2025-10 and will "
                    f"decode with the locked constant, likely wrongly (re-quantize it)",
                    stacklevel=2,
                )
    return MARKER_CODEBOOK[name]


def codebook_from_tensors(source: TensorSource, module_key: str) -> int:
    """Codebook id for ``module_key`` from a tensor getter, a name->tensor mapping, or a set of names.

    With a bare collection of names only presence is known, so marker values are not checked.
    """

    def fetch(name: str) -> torch.Tensor | bool | None:
        full = f"{module_key}.{name}"
        if isinstance(source, Mapping):
            return source.get(full)
        if callable(source):
            return source(full)
        return True if full in source else None

    return codebook_from_markers(module_key, fetch("mcg"), fetch("mul1"))


def apply_scales_and_rotations(inner: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """W = diag(suh) · BD_k · Ŵ · BD_n · diag(svh), all in fp32 (spec 4.2)."""
    w = had_blockwise(had_blockwise(inner, dim=0), dim=1)
    return w * suh.to(torch.float32)[:, None] * svh.to(torch.float32)[None, :]


def reconstruct(
    trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, K: int | None, codebook: int
) -> torch.Tensor:
    """fp32 weight ``[k, n]`` (padded, ``(in, out)`` orientation) in the original basis.

    The fp32 reference of spec 4.2: decode Ŵ exactly, rotate both sides with H128/sqrt(128) and
    scale rows by ``suh`` and columns by ``svh`` without intermediate rounding. The reference
    engine's own dequantizer rounds to fp16 between steps, so the two differ by ~1e-3 relative.
    """
    if trellis.dim() != 3:
        raise ValueError(
            f"reconstruct: trellis must be 3-D [k/16, n/16, 16K], got shape {tuple(trellis.shape)}"
        )
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    if suh.shape != (k,) or svh.shape != (n,):
        raise ValueError(
            f"reconstruct: trellis {tuple(trellis.shape)} needs suh [{k}] and svh [{n}], "
            f"got suh {tuple(suh.shape)} and svh {tuple(svh.shape)}"
        )
    return apply_scales_and_rotations(decode_inner(trellis, K, codebook), suh, svh)
