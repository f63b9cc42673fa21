"""Pure-torch references of the fused elementwise ops in :mod:`exl3_core.ops`.

Each is the oracle of its Triton kernel (``exl3_core/kernels/fused.py``) and the fallback where
Triton cannot run. Math is fp32 whatever the activation dtype, with one rounding to the output
dtype at the end, except where the unfused model code rounds in between (the residual sum is
rounded to the stream's dtype before it is normalised, as ``x = x + h`` does).
"""
from __future__ import annotations

import math

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float = 0.0) -> torch.Tensor:
    """``x / rms(x) * (weight + offset)`` over the last dim, in fp32, returned in ``x.dtype``."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.float() + offset)
    return y.to(x.dtype)


def rms_norm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                      offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)``: the pre-norm block's residual add and the next norm.

    The new residual is rounded to ``x.dtype`` (the stream's dtype) before it is normalised.
    """
    new_residual = (residual.float() + x.float()).to(x.dtype)
    return rms_norm(new_residual, weight, eps, offset), new_residual


def _split(gate_up: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
           up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(gate_up, tuple):
        return gate_up
    if up is not None:
        return gate_up, up
    half = gate_up.shape[-1] // 2
    return gate_up[..., :half], gate_up[..., half:]


def silu_mul(gate_up: torch.Tensor | tuple[torch.Tensor, torch.Tensor], up: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up``; ``gate_up`` is ``[..., 2I]`` (gate first) or a ``(gate, up)`` pair."""
    g, u = _split(gate_up, up)
    gf = g.float()
    return (gf * torch.sigmoid(gf) * u.float()).to(g.dtype)


def gelu_tanh_mul(gate_up: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                  up: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` with ``gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    g, u = _split(gate_up, up)
    gf = g.float()
    inner = math.sqrt(2.0 / math.pi) * (gf + 0.044715 * gf * gf * gf)
    return (0.5 * gf * (1.0 + torch.tanh(inner)) * u.float()).to(g.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, interleaved: bool) -> None:
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]
    xr = x[..., :rotary_dim].float()
    if interleaved:  # pairs (2i, 2i+1)
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:  # halves (i, i + r/2)
        half = rotary_dim // 2
        x1, x2 = xr[..., :half], xr[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    x[..., :rotary_dim] = out.to(x.dtype)


def rope_apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
               interleaved: bool) -> None:
    """Rotate the first ``rotary_dim`` channels of ``q [T, Hq, D]`` and ``k [T, Hk, D]`` in place;
    ``cos``/``sin`` are ``[T, rotary_dim/2]`` (fp32)."""
    _rotate(q, cos, sin, rotary_dim, interleaved)
    _rotate(k, cos, sin, rotary_dim, interleaved)


def kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Paged KV-cache write: ``k_cache.view(-1, Hk, D)[slot_mapping[t]] = k[t]`` (and v), cast to the
    cache dtype. Caches ``[pages, page_size, Hk, D(v)]`` contiguous; ``k [T, Hk, D]``, ``v [T, Hk, Dv]``."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                  interleaved: bool) -> None:
    """:func:`rope_apply` on q and k (in place), then :func:`kv_write` of the rotated k and v."""
    rope_apply(q, k, cos, sin, rotary_dim, interleaved)
    kv_write(k_cache, v_cache, k, v, slot_mapping)


def greedy_pack(logits: torch.Tensor) -> torch.Tensor:
    """float64 ``[2, B]``: ``logits [B, V]``'s argmax and "has a finite logit and no NaN or +inf" flag
    per row (the same selection as :func:`~exl3_core.sampling.sampler.sample` with a greedy sampler;
    a flag of 0 is a numeric fault: nothing constrains a greedy row)."""
    x = logits.float()
    ids = x.argmax(-1)
    ok = torch.isfinite(x).any(-1) & ~(torch.isnan(x) | torch.isposinf(x)).any(-1)
    return torch.stack([ids.double(), ok.double()])


def carry_ids(ids: torch.Tensor, carry: torch.Tensor, src: torch.Tensor) -> None:
    """In place: ``ids[i] = int64(src[carry[i]])`` where ``0 <= carry[i] < len(src)``, else unchanged."""
    if src.shape[0] == 0:
        return
    take = (carry >= 0) & (carry < src.shape[0])  # no host read: this runs inside captured graphs too
    picked = src[carry.long().clamp(0, src.shape[0] - 1)].to(torch.int64)
    ids.copy_(torch.where(take, picked, ids))


def embed_ss(ids: torch.Tensor, weight: torch.Tensor, scale: float | None,
             ss_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight[ids] (* scale), ss)``: ``ss [ss_slots, T]`` fp32, row 0 the rows' sums of squares, the rest 0."""
    h = weight[ids]
    if scale is not None:
        h = (h.float() * scale).to(weight.dtype)
    ss = torch.zeros((ss_slots, ids.shape[0]), dtype=torch.float32, device=weight.device)
    ss[0] = h.float().pow(2).sum(-1)
    return h, ss


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor,
                factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` of ``positions[:, None] * inv_freq[None, :]``, times ``factor``."""
    f = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = f.cos(), f.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos, sin
