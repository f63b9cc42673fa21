"""Weight regularisation before trellis quantization: signs, channel scales, Hadamards, global scale.

Format spec 5.3. The result satisfies ``W ≈ diag(su)·BD_k·W_rot·BD_n·diag(sv)`` exactly (before
quantization), so storing ``suh = fp16(su)``, ``svh = fp16(sv)`` and the trellis of ``W_rot`` gives
the reader's algebra of spec 4.2.
"""

from __future__ import annotations

import math

import torch

from exl3_core.quant.exl3.codebook import CODEBOOK_SCALE_3INST
from exl3_core.quant.exl3.hadamard import had_blockwise
from exl3_core.quant.exl3.hessian import HessianInfo, sign_pattern
from exl3_core.quant.exl3.ldlq import TileEncoder, codebook_id, encode, lut32
from exl3_core.quant.exl3.trellis import check_k, tiles_from_matrix

OUT_SCALE_MODES = ("always", "never", "auto")
ZERO_SCALE = 0.1  # scale given to all-zero rows/columns so nothing divides by zero
EPS = 1e-10
SKEW_FRACTION = 0.15  # "auto": apply out scales when the top k/50 input channels hold < 15% of sqrt(diag H)
SCALE_STEP = 0.1  # relative spacing of the global-scale candidates
MAX_WALK = 24  # downhill steps before the search settles for the lowest point seen
SAMPLE_CAP = 128  # tiles the global-scale search encodes per candidate
EXT_SHARE = 16
G_MIN = 0.01


def rotate(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Blockwise H128/sqrt(128) along ``dim`` of a 2-D fp32 matrix (``BD_k·x`` for 0, ``x·BD_n`` for 1).

    Same math as ``had_blockwise``, but always on the contiguous last dim: a strided batched
    matmul (what ``dim=0`` on a row-major matrix becomes) is up to ~300x slower on CPU.
    """
    if dim in (0, -2):
        return had_blockwise(x.T.contiguous(), dim=-1).T
    return had_blockwise(x.contiguous(), dim=-1)


def use_out_scales(mode: str, hinfo: HessianInfo | None) -> bool:
    """Whether output-channel scales are applied for ``mode`` (``always``/``never``/``auto``).

    ``auto`` applies them when the input is not skewed: sorting sqrt(diag H) descending, the top
    ``k//50`` entries sum to less than 15% of the total. Without Hessian statistics it applies them.
    """
    if mode not in OUT_SCALE_MODES:
        raise ValueError(f"out_scales={mode!r} is invalid; use one of {OUT_SCALE_MODES}")
    if mode != "auto":
        return mode == "always"
    if hinfo is None or hinfo.diag is None:
        return True
    d = hinfo.diag.clamp_min(0).sqrt().sort(descending=True).values
    total = float(d.sum())
    if total <= 0:
        return True
    return float(d[: max(1, d.numel() // 50)].sum()) < SKEW_FRACTION * total


def sample_scale_tiles(w_rot: torch.Tensor, cap: int | None = SAMPLE_CAP) -> torch.Tensor:
    """Tiles ``[S, 256]`` (sequence order) for the global-scale search.

    A wrapped diagonal of the tile grid, 3 tiles wide, plus the ``max(8, 3·max(tk, tn)//16)``
    highest- and lowest-RMS tiles. ``cap`` bounds S: the extremes keep at most half of it, the
    diagonal is thinned evenly to the rest (a wide head's full diagonal would cost most of a
    second pass, and the scale only needs a few tens of thousands of weights to be located).
    """
    tiles = tiles_from_matrix(w_rot)  # [tk, tn, 256]
    tk, tn, _ = tiles.shape
    flat = tiles.reshape(tk * tn, 256)
    m = max(tk, tn)
    i = torch.arange(m)
    diag = torch.cat([(i % tk) * tn + (i + d) % tn for d in range(3)]).unique()
    n_ext = min(max(8, 3 * m // 16), flat.shape[0])
    if cap is not None:
        n_ext = min(n_ext, max(1, cap // EXT_SHARE))
    rms = flat.pow(2).mean(dim=1)
    ext = torch.cat([rms.topk(n_ext).indices, (-rms).topk(n_ext).indices]).unique().cpu()
    diag = diag[~torch.isin(diag, ext)]
    if cap is not None and diag.numel() + ext.numel() > cap:
        keep = max(0, cap - ext.numel())
        diag = diag[torch.linspace(0, diag.numel() - 1, keep).round().long().unique()] if keep else diag[:0]
    return flat[torch.cat([diag, ext]).to(flat.device)]


def _scale_errors(
    tiles: torch.Tensor, scales: list[float], K: int, cb: int, encoder: TileEncoder | None
) -> list[float]:
    """mean((Q(g·t)/g − t)²) per candidate g, all candidates in one encoder call."""
    g = torch.tensor(scales, dtype=torch.float32, device=tiles.device)
    batch = (tiles.unsqueeze(0) * g.view(-1, 1, 1)).reshape(-1, 256)
    _, vals = encode(batch, K, cb, encoder)
    q = vals.view(len(scales), *tiles.shape) / g.view(-1, 1, 1)
    return ((q - tiles.unsqueeze(0)) ** 2).mean(dim=(1, 2)).double().tolist()


def _parabola_vertex(x: list[float], y: list[float]) -> float | None:
    """Vertex of the parabola through three points, or None if it does not open upwards."""
    (x0, x1, x2), (y0, y1, y2) = x, y
    den = (x1 - x0) * (y1 - y2) - (x1 - x2) * (y1 - y0)
    num = (x1 - x0) ** 2 * (y1 - y2) - (x1 - x2) ** 2 * (y1 - y0)
    if den == 0:
        return None
    # a convex parabola through a lowest middle point has den < 0 with this sign convention
    v = x1 - 0.5 * num / den
    return v if math.isfinite(v) else None


def codebook_rms(codebook: int) -> float:
    """RMS of a codebook's values over all 65536 states."""
    return float(lut32(codebook).double().pow(2).mean().sqrt())


def search_global_scale(
    tiles: torch.Tensor, K: int, codebook: int, encoder: TileEncoder | None = None
) -> tuple[float, float]:
    """Global scale g minimising the sampled tiles' quantization MSE; returns (g, best sampled MSE).

    The tiles' quantization MSE is a smooth, single-valley function of g, so the search brackets
    the valley and fits a parabola instead of scanning a grid: it starts at the scale that gives the
    tiles the codebook's RMS, evaluates it and its neighbours ``STEP`` (relative) apart, walks
    downhill one step at a time until the lowest point has a higher one on each side, and returns
    the vertex of the parabola through those three (clamped to their interval and to g >= 0.01).
    Every candidate is scored on the same tiles, so differences between candidates are not masked
    by sampling noise. Typically 3-4 encoder passes over the sample.
    """
    if tiles.shape[0] == 0 or float(tiles.abs().max()) == 0.0:
        return 1.0, 0.0
    rms = float(tiles.double().pow(2).mean().sqrt())
    g0 = max(G_MIN, codebook_rms(codebook) / rms)
    step = SCALE_STEP * g0
    pts = [max(G_MIN, g0 - step), g0, g0 + step]
    errs = _scale_errors(tiles, pts, K, codebook, encoder)
    for _ in range(MAX_WALK):
        j = min(range(3), key=errs.__getitem__)
        if j == 1 or (j == 0 and pts[0] <= G_MIN):
            break
        if j == 2:
            new = pts[2] + step
            pts, errs = [pts[1], pts[2], new], [errs[1], errs[2], *_scale_errors(tiles, [new], K, codebook, encoder)]
        else:
            new = max(G_MIN, pts[0] - step)
            pts, errs = [new, pts[0], pts[1]], [*_scale_errors(tiles, [new], K, codebook, encoder), errs[0], errs[1]]
    j = min(range(3), key=errs.__getitem__)
    g, e = pts[j], errs[j]
    if j == 1:
        v = _parabola_vertex(pts, errs)
        if v is not None:
            g = min(max(v, pts[0], G_MIN), pts[2])
    return float(g), float(e)


def regularize(
    w: torch.Tensor,
    hinfo: HessianInfo,
    *,
    out_scales: str = "always",
    codebook: int | str = "mul1",
    K: int,
    seed: int = 0,
    encoder: TileEncoder | None = None,
    g_sample_cap: int | None = SAMPLE_CAP,
    name: str = "linear",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Regularise ``w`` fp32 ``[k, n]`` (``(in, out)``, padded); returns (W_rot, su, sv, g).

    Spec 5.3: random output signs (from ``seed``) and optional output-channel RMS scales, the
    output-side Hadamard, input-row RMS scales with the codebook constant and the shared input
    signs ``hinfo.su0``, the input-side Hadamard and finally the global scale g found with the real
    tile encoder. ``su``/``sv`` are fp32 with ``W = diag(su)·BD_k·W_rot·BD_n·diag(sv)`` (for columns
    that are entirely zero ``sv`` is 0 instead).
    """
    K = check_k(K, name)
    cb = codebook_id(codebook, name)
    if w.dim() != 2:
        raise ValueError(f"{name}: regularize needs a 2-D [k, n] weight, got shape {tuple(w.shape)}")
    k, n = w.shape
    if k != hinfo.k:
        raise ValueError(
            f"{name}: weight has {k} (padded) input rows but the Hessian is for {hinfo.k} inputs"
        )
    if k % 128 or n % 128:
        raise ValueError(f"{name}: weight [{k}, {n}] must be zero-padded to multiples of 128 in both dims")
    w = w.to(torch.float32).clone()

    sv0 = sign_pattern(n, seed + 0x5EED).to(w.device)  # own stream so q/k/v (same seed) still differ from su0
    zero_cols = w.abs().amax(dim=0) == 0
    if use_out_scales(out_scales, hinfo):
        col_rms = w.pow(2).mean(dim=0).sqrt()
        # the mean runs over all (padded) columns, zeros included, as the reference quantizer does
        mean = float(col_rms.mean()) if bool((~zero_cols).any()) else 1.0
        s_out = torch.where(zero_cols, torch.full_like(col_rms, ZERO_SCALE), col_rms / mean)
        sv = sv0 * s_out + EPS
    else:
        sv = sv0.clone()
    w /= sv
    sv[zero_cols] = 0.0
    w = rotate(w, 1)

    row_rms = w.pow(2).mean(dim=1).sqrt()
    s_in = torch.where(row_rms == 0, torch.full_like(row_rms, ZERO_SCALE), row_rms)
    su = hinfo.su0.to(w.device) * s_in / (-CODEBOOK_SCALE_3INST) + EPS
    w /= su[:, None]
    w = rotate(w, 0)

    g, _ = search_global_scale(sample_scale_tiles(w, g_sample_cap), K, cb, encoder)
    return w * g, su / g, sv, g
