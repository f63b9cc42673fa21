"""LDLQ: trellis-quantize a rotated weight matrix with Hessian-aware error feedback (format spec 5.4).

Rows are processed in 16-row blocks from the last to the first. Block b is quantized towards
``W_b + Σ_{r>b} L_u[r,b]ᵀ (W_r − Ŵ_r)``, which is LDLQ for ``tr(EᵀH'E)`` with ``H' = L_u D L_uᵀ``.
All n/16 tiles of a block row go through one encoder call, in tensor-core sequence order (spec 3.2).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch

from exl3_core.quant.exl3 import codebook as _cb
from exl3_core.quant.exl3.trellis import check_k, tensor_core_perm, tensor_core_perm_inv

TILE = 16
SEQ = 256

# (tiles fp32 [N, 256] in sequence order, K, codebook id) -> int states [N, 256] (16-bit, tail-biting)
TileEncoder = Callable[[torch.Tensor, int, int], torch.Tensor]


def codebook_id(codebook: int | str, what: str = "codebook") -> int:
    """Codebook id from a name (``mul1``/``mcg``/``3inst``) or an id (0..2)."""
    if isinstance(codebook, str):
        cb = _cb.CODEBOOK_NAMES.get(codebook.lower())
        if cb is None:
            raise ValueError(
                f"{what}: unknown codebook {codebook!r}; use one of {sorted(_cb.CODEBOOK_NAMES)}"
            )
        return cb
    if codebook not in _cb.CODEBOOK_NAMES.values() or isinstance(codebook, bool):
        raise ValueError(f"{what}: unknown codebook id {codebook!r}; use 0 (3inst), 1 (mcg) or 2 (mul1)")
    return int(codebook)


@functools.cache
def _warn_slow() -> None:
    warnings.warn(
        "EXL3 quantizer: the compiled Viterbi op exl3::viterbi_encode is unavailable, so tiles are "
        "encoded by the pure-torch reference (~100x slower); build it with "
        "`python setup.py build_ext --inplace`",
        stacklevel=3,
    )


def default_encoder(tiles: torch.Tensor, K: int, codebook: int) -> torch.Tensor:
    """The real tail-biting Viterbi encoder (compiled op when built, torch reference otherwise)."""
    from exl3_core.quant.exl3 import viterbi

    if not viterbi.has_cpp():
        _warn_slow()
    return viterbi.encode_tiles(tiles, K, codebook, impl="auto")


@functools.cache
def lut32(codebook: int) -> torch.Tensor:
    """fp32 codebook values (index = state); cached, treat as read-only."""
    return _cb.lut(codebook).to(torch.float32)


def encode(
    tiles: torch.Tensor, K: int, codebook: int, encoder: TileEncoder | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode tiles ``[N, 256]`` (sequence order); returns (int32 states, fp32 decoded values)."""
    if tiles.shape[0] == 0:
        return torch.empty(0, SEQ, dtype=torch.int32), torch.empty(0, SEQ, dtype=torch.float32)
    states = (encoder or default_encoder)(tiles.contiguous(), K, codebook).to(torch.int32) & 0xFFFF
    values = lut32(codebook).to(states.device)[states.to(torch.int64)]
    return states, values


def rows_to_tiles(block: torch.Tensor) -> torch.Tensor:
    """``[16, n]`` block row -> ``[n/16, 256]`` tiles in sequence order."""
    n = block.shape[1]
    flat = block.reshape(TILE, n // TILE, TILE).permute(1, 0, 2).reshape(n // TILE, SEQ)
    return flat.index_select(1, tensor_core_perm(block.device))


def tiles_to_rows(tiles: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rows_to_tiles`: ``[n/16, 256]`` sequence order -> ``[16, n]``."""
    tn = tiles.shape[0]
    flat = tiles.index_select(1, tensor_core_perm_inv(tiles.device))
    return flat.reshape(tn, TILE, TILE).permute(1, 0, 2).reshape(TILE, tn * TILE)


def plain_quantize(
    w_rot: torch.Tensor, K: int, codebook: int, encoder: TileEncoder | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile-by-tile quantization without feedback (the fallback path): (states [k/16, n/16, 256], Ŵ)."""
    k, n = w_rot.shape
    tiles = w_rot.reshape(k // TILE, TILE, n // TILE, TILE).permute(0, 2, 1, 3).reshape(-1, SEQ)
    tiles = tiles.index_select(1, tensor_core_perm(w_rot.device))
    states, values = encode(tiles, K, codebook, encoder)
    values = values.index_select(1, tensor_core_perm_inv(values.device))
    w_hat = values.reshape(k // TILE, n // TILE, TILE, TILE).permute(0, 2, 1, 3).reshape(k, n)
    return states.reshape(k // TILE, n // TILE, SEQ), w_hat


def ldlq(
    w_rot: torch.Tensor,
    l_u: torch.Tensor | None,
    K: int,
    codebook: int | str,
    buf_size_k: int = 128,
    *,
    encoder: TileEncoder | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LDLQ-quantize ``w_rot`` fp32 ``[k, n]`` (rotated basis); returns (states [k/16, n/16, 256], Ŵ fp32).

    ``l_u`` is the unit-block-lower factor with zeroed diagonal blocks (``HessianInfo.l_u``); None
    means plain tile quantization. Feedback within a span of ``buf_size_k`` rows is applied block
    by block; contributions of finished spans are added to a running cache with one matmul per span.
    """
    K = check_k(K, "ldlq")
    cb = codebook_id(codebook, "ldlq")
    if w_rot.dim() != 2 or w_rot.shape[0] % TILE or w_rot.shape[1] % TILE:
        raise ValueError(f"ldlq: W must be [k, n] with k, n multiples of 16, got {tuple(w_rot.shape)}")
    if buf_size_k <= 0 or buf_size_k % TILE:
        raise ValueError(f"ldlq: buf_size_k={buf_size_k} must be a positive multiple of {TILE}")
    w = w_rot.to(torch.float32)
    if l_u is None:
        return plain_quantize(w, K, cb, encoder)
    k, n = w.shape
    if l_u.shape != (k, k):
        raise ValueError(
            f"ldlq: L_u has shape {tuple(l_u.shape)}, expected [{k}, {k}] for W {tuple(w.shape)}"
        )
    l_u = l_u.to(w.device, torch.float32)
    w_hat = torch.empty_like(w)
    err = torch.zeros_like(w)  # W - Ŵ of finished rows
    prod_cache = torch.zeros_like(w)  # Σ over finished spans of L_u[r, :]ᵀ E_r, per target row
    states = torch.empty(k // TILE, n // TILE, SEQ, dtype=torch.int32, device=w.device)
    for s1 in range(k, 0, -buf_size_k):
        s0 = max(0, s1 - buf_size_k)
        for b1 in range(s1, s0, -TILE):
            b0 = b1 - TILE
            target = w[b0:b1] + prod_cache[b0:b1]
            if b1 < s1:  # feedback from blocks already done inside this span
                target = target + l_u[b1:s1, b0:b1].T @ err[b1:s1]
            st, vals = encode(rows_to_tiles(target), K, cb, encoder)
            states[b0 // TILE] = st
            w_hat[b0:b1] = tiles_to_rows(vals)
            err[b0:b1] = w[b0:b1] - w_hat[b0:b1]
        if s0 > 0:
            prod_cache[:s0] += l_u[s0:s1, :s0].T @ err[s0:s1]
    return states, w_hat
