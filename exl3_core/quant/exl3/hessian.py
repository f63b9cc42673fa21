"""Proxy Hessians for the EXL3 quantizer: accumulation, finalisation and block LDL (format spec 5.2).

One :class:`HessianInfo` belongs to one input ("qmap"): every linear that reads the same
activations (e.g. the q/k/v projections) shares it, including the random input sign pattern
``su0``. The only O(k^3) work of the whole quantizer is the single Cholesky done here.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace

import torch

from exl3_core.quant.exl3.hadamard import EXL3_BLOCK, get_hadamard

TILE = 16  # LDL block size = tile height
CHOL_RETRIES = 10
TINY_DIAG = 1e-20


@dataclass
class HessianInfo:
    """Finalised Hessian of one input, shared by every linear reading it.

    ``k`` is the padded input width (a multiple of 128). ``su0`` (fp32 ±1, ``[k]``) is the input
    sign pattern, ``h_rot`` (fp32 ``[k, k]``) the rotated, damped H' = BD·diag(su0)·H·diag(su0)·BD
    and ``l_u`` (fp32 ``[k, k]``) its unit-block-lower LDL factor with the 16x16 diagonal blocks
    zeroed (what LDLQ feeds back through). In fallback mode (no usable statistics) ``h_rot`` and
    ``l_u`` are None and tensors are quantized tile by tile without feedback.
    """

    k: int
    su0: torch.Tensor
    h_rot: torch.Tensor | None
    l_u: torch.Tensor | None
    diag: torch.Tensor | None  # diag of H/count before damping (for the out-scales "auto" skew test)
    count: int
    fallback: bool
    reason: str = ""
    damping: float = 0.0  # total relative damping that made the Cholesky succeed
    seed: int = 0

    def to(self, device: torch.device | str) -> HessianInfo:
        """This info with its tensors on ``device`` (self when they are there already)."""
        device = torch.device(device)
        if self.su0.device == device:
            return self

        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(self, su0=self.su0.to(device), h_rot=mv(self.h_rot), l_u=mv(self.l_u), diag=mv(self.diag))


def _bd64(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Blockwise H128/sqrt(128) along ``dim`` in fp64 (the rotation must not cost H its precision)."""
    H = get_hadamard(EXL3_BLOCK).to(x.device, torch.float64) / math.sqrt(EXL3_BLOCK)
    # contiguous 2-D matmul: a strided 3-D fp64 matmul takes a path ~100x slower on CPU
    xt = x.movedim(dim, -1).contiguous()
    y = (xt.reshape(-1, EXL3_BLOCK) @ H).reshape(xt.shape)
    return y.movedim(-1, dim)


def sign_pattern(size: int, seed: int) -> torch.Tensor:
    """fp32 ±1 ``[size]``: sign(randn) from a generator seeded with ``seed``; zeros map to +1."""
    g = torch.Generator().manual_seed(int(seed))
    s = torch.sign(torch.randn(size, generator=g))
    return torch.where(s == 0, torch.ones_like(s), s)


def padded_size(features: int) -> int:
    return -(-features // EXL3_BLOCK) * EXL3_BLOCK


def block_ldl(h: torch.Tensor) -> torch.Tensor:
    """Unit-block-lower factor of ``h = L_u D L_uᵀ`` (16x16 blocks) from ``L = chol(h)``.

    Right-multiplying each 16-column block of L by the inverse of its diagonal block makes those
    blocks identities; they are then zeroed, so the result holds only the strictly-lower blocks.
    Raises ``torch.linalg.LinAlgError`` when ``h`` is not positive definite.
    """
    k = h.shape[0]
    kb = k // TILE
    L = torch.linalg.cholesky(h)
    diag_blocks = L.view(kb, TILE, kb, TILE).diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # [kb,16,16]
    eye = torch.eye(TILE, dtype=h.dtype, device=h.device).expand(kb, TILE, TILE)
    inv = torch.linalg.solve_triangular(diag_blocks, eye, upper=False)
    lu = torch.einsum("ibj,bjl->ibl", L.view(k, kb, TILE), inv).reshape(k, k)
    blk = torch.arange(k, device=h.device) // TILE
    mask = blk[:, None] == blk[None, :]
    return lu.masked_fill(mask, 0.0)


def _fallback(k: int, su0: torch.Tensor, count: int, reason: str, seed: int, diag=None) -> HessianInfo:
    return HessianInfo(k, su0, None, None, diag, count, True, reason, 0.0, seed)


def fallback_hessian(in_features: int, *, seed: int = 0, reason: str = "no calibration data") -> HessianInfo:
    """A fallback HessianInfo (plain tile quantization, no LDLQ) for ``in_features`` inputs."""
    k = padded_size(in_features)
    return _fallback(k, sign_pattern(k, seed), 0, reason, seed)


def mean_hessian64(h_sum: torch.Tensor, count: int, k: int) -> torch.Tensor:
    """``Σ XᵀX / count`` in fp64 on the sum's device, zero-padded to ``[k, k]`` and symmetrised (fp32
    accumulation leaves tiny asymmetries). ``count`` > 0."""
    kt = h_sum.shape[0]
    h = torch.zeros(k, k, dtype=torch.float64, device=h_sum.device)
    h[:kt, :kt] = h_sum.detach().to(torch.float64) / count
    return 0.5 * (h + h.T)


def finalize_hessian(
    h_sum: torch.Tensor,
    count: int,
    *,
    sigma_reg: float = 0.025,
    seed: int = 0,
    name: str = "hessian",
) -> HessianInfo:
    """Turn an accumulated ``Σ XᵀX`` (``[k, k]``, true or padded input width) into a HessianInfo.

    Spec 5.2: H /= count; fallback when count is 0 or the diagonal mean is non-finite or < 1e-20;
    damp the diagonal by ``sigma_reg``·mean(diag); rotate with the sign pattern drawn from ``seed``
    and the blockwise Hadamard; block LDL, adding 2·sigma_reg·mean(diag) and retrying (up to 10
    times) when the Cholesky fails. Inputs narrower than a 128 multiple are zero-padded, as the
    runtime zero-extends activations. Math in fp64; stored factors are fp32.
    """
    if h_sum.dim() != 2 or h_sum.shape[0] != h_sum.shape[1]:
        raise ValueError(f"{name}: H must be a square [k, k] matrix, got shape {tuple(h_sum.shape)}")
    if sigma_reg < 0 or not math.isfinite(sigma_reg):
        raise ValueError(f"{name}: sigma_reg={sigma_reg!r} must be a finite value >= 0")
    k_true = h_sum.shape[0]
    k = padded_size(k_true)
    su0 = sign_pattern(k, seed)
    if count <= 0:
        return _fallback(k, su0, 0, "no calibration rows (count=0)", seed)
    # fp64 on the sum's device: a GPU factorises a 14336-wide H in well under a second, a CPU in tens
    dev = h_sum.device
    h = mean_hessian64(h_sum, count, k)
    diag = h.diagonal().clone()
    mean_diag = float(diag.mean())
    if not math.isfinite(mean_diag) or not bool(torch.isfinite(h).all()):
        return _fallback(k, su0, count, "non-finite Hessian entries", seed)
    if mean_diag < TINY_DIAG:
        return _fallback(k, su0, count, f"diagonal mean {mean_diag:.3g} < {TINY_DIAG:g}", seed, diag.float())

    h.diagonal().add_(sigma_reg * mean_diag)
    s0 = su0.to(dev, torch.float64)
    h_rot = _bd64(_bd64(h * s0[:, None] * s0[None, :], 0), 1)
    h_rot = 0.5 * (h_rot + h_rot.T)
    damping = sigma_reg
    for _ in range(CHOL_RETRIES + 1):
        try:
            l_u = block_ldl(h_rot)
            break
        except torch.linalg.LinAlgError:
            # adding c·I commutes with the orthogonal rotation, so damp H' directly
            h_rot.diagonal().add_(2 * sigma_reg * mean_diag)
            damping += 2 * sigma_reg
    else:
        warnings.warn(
            f"{name}: Cholesky failed after {CHOL_RETRIES} damping retries (damping {damping:.3g}·mean diag); "
            f"quantizing its linears without LDLQ feedback",
            stacklevel=2,
        )
        return _fallback(k, su0, count, "Cholesky failed", seed, diag.float())
    return HessianInfo(k, su0, h_rot.float(), l_u.float(), diag.float(), count, False, "", damping, seed)


class HessianAccumulator:
    """Running ``Σ XᵀX`` (fp32) over calibration rows of one input; rows with non-finite values are dropped.

    The sum lives on the device of the first batch (so GPU captures never copy activations to the
    host); ``finalize`` factorises it in fp64 on that same device.
    """

    def __init__(self, in_features: int, name: str = "hessian") -> None:
        self.in_features = in_features
        self.name = name
        self.h_sum: torch.Tensor | None = None
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        """Add activations ``x`` ``[..., in_features]``."""
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"{self.name}: activations have last dim {x.shape[-1]}, expected {self.in_features}"
            )
        if self.h_sum is None:
            self.h_sum = torch.zeros(self.in_features, self.in_features, dtype=torch.float32, device=x.device)
        x = x.detach().reshape(-1, self.in_features).to(self.h_sum.device, torch.float32)
        # a NaN or inf anywhere makes the sum non-finite (and so does an overflowing sum, which then
        # takes the exact row filter too): one reduction instead of a mask and a copy of every batch
        if not bool(torch.isfinite(x.sum())):
            x = x[torch.isfinite(x).all(dim=1)]
        self.h_sum.addmm_(x.T, x)
        self.count += x.shape[0]

    def finalize(self, *, sigma_reg: float = 0.025, seed: int = 0) -> HessianInfo:
        h = self.h_sum if self.h_sum is not None else torch.zeros(self.in_features, self.in_features)
        return finalize_hessian(h, self.count, sigma_reg=sigma_reg, seed=seed, name=self.name)
