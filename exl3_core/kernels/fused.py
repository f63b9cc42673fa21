"""Fused elementwise kernels: residual add + RMSNorm, gated activations, in-place RoPE on q and k.

Each replaces a chain of 3-7 small torch kernels per call (casts, pow, mean, rsqrt, muls, adds)
by one launch; at b=1 decode those kernels cost their fixed start/drain time each, not bandwidth.
Math is fp32, inputs and outputs in the activation dtype. References: ``exl3_core/reference/fused.py``.
Imported lazily by :mod:`exl3_core.ops` (this module needs Triton).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from exl3_core.kernels.codes import ACT_CODES
from exl3_core.kernels.counters import arrival_counters
from exl3_core.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_opts

# -- RMSNorm (+ residual add) -----------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    X, R, W, Out, ResOut,
    stride_x, stride_r, stride_o, stride_ro,
    N, eps, offset,
    HAS_RES: tl.constexpr, HAS_W: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # launched as a programmatic dependent: wait for the producer of X, let the next start
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        s = (x + r).to(ResOut.dtype.element_ty)  # the stream's dtype, as the unfused `x = x + h`
        tl.store(ResOut + row * stride_ro + cols, s, mask=ok)
        x = s.to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    if HAS_W:
        y = y * (tl.load(W + cols, mask=ok, other=0.0).to(tl.float32) + offset)
    tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, N]`` with a unit last stride (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm_warps(block: int) -> int:
    return 1 if block <= 512 else (4 if block <= 4096 else 8)


def rms_norm_residual(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                      offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rms_norm(residual + x), residual + x)`` in one pass; with ``residual=None`` a plain RMSNorm
    (second item None)."""
    N = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o2 = out.view(-1, N)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"rms_norm_residual: residual {tuple(residual.shape)} and x {tuple(x.shape)} differ")
        r2 = _rows(residual)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ro2 = res_out.view(-1, N)
    else:
        r2, res_out, ro2 = x2, None, o2
    w = weight.contiguous() if weight is not None else x2  # placeholder pointer when absent
    block = triton.next_power_of_2(N)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, w, o2, ro2, x2.stride(0), r2.stride(0), o2.stride(0), ro2.stride(0),
            N, float(eps), float(offset),
            HAS_RES=residual is not None, HAS_W=weight is not None, BLOCK_N=block,
            num_warps=_norm_warps(block), **launch_opts(x2),
        )
    return out, res_out


# -- gated activations ----------------------------------------------------------------------------


@triton.jit
def _act_mul_kernel(G, U, Out, stride_g, stride_u, stride_o, N, ACT: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    if PDL:  # see _rms_norm_kernel
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    g = tl.load(G + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    if ACT == 0:
        a = g * tl.sigmoid(g)
    else:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2/pi)
        a = g * tl.sigmoid(2.0 * inner)  # 0.5 (1 + tanh(t)) == sigmoid(2t)
    tl.store(Out + row * stride_o + cols, (a * u).to(Out.dtype.element_ty), mask=ok)


def act_mul(act: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` for ``act`` in :data:`exl3_core.ops.ACT_CODES`; ``gate``/``up`` ``[..., I]`` of one
    shape."""
    if gate.shape != up.shape:
        raise ValueError(f"act_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    N = gate.shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    o2 = out.view(-1, N)
    block = min(2048, triton.next_power_of_2(N))
    if g2.shape[0]:
        _act_mul_kernel[(g2.shape[0], triton.cdiv(N, block))](
            g2, u2, o2, g2.stride(0), u2.stride(0), o2.stride(0), N, ACT=ACT_CODES[act], BLOCK=block,
            num_warps=4 if block >= 1024 else 2, **launch_opts(g2),
        )
    return out


# -- RoPE on q and k, in place ----------------------------------------------------------------------


@triton.jit
def _rope_heads(X, t, stride_t, stride_h, H, c, s, i,
                HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    ok = (h[:, None] < H) & (i[None, :] < HALF)
    if INTERLEAVED:  # pairs (2i, 2i+1)
        o1 = 2 * i
        o2 = 2 * i + 1
    else:  # halves (i, i + r/2)
        o1 = i
        o2 = i + HALF
    base = X + t * stride_t + h[:, None] * stride_h
    x1 = tl.load(base + o1[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + o2[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(base + o1[None, :], (x1 * c - x2 * s).to(X.dtype.element_ty), mask=ok)
    tl.store(base + o2[None, :], (x2 * c + x1 * s).to(X.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(
    Q, K, Cos, Sin,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
    HQ, HK,
    HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # see _rms_norm_kernel
        gdc_wait()
        gdc_launch_dependents()
    # one program per token: the cos/sin row is loaded once for every q and k head
    _rope_token(Q, K, Cos, Sin, tl.program_id(0).to(tl.int64), stride_qt, stride_qh, stride_kt, stride_kh,
                stride_ct, stride_st, HQ, HK, HALF, INTERLEAVED, BLOCK_HQ, BLOCK_HK, BLOCK_R)


@triton.jit
def _rope_token(Q, K, Cos, Sin, t, stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st, HQ, HK,
                HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                BLOCK_R: tl.constexpr):
    i = tl.arange(0, BLOCK_R)
    c = tl.load(Cos + t * stride_ct + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    s = tl.load(Sin + t * stride_st + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    _rope_heads(Q, t, stride_qt, stride_qh, HQ, c, s, i, HALF, INTERLEAVED, BLOCK_HQ, BLOCK_R)
    _rope_heads(K, t, stride_kt, stride_kh, HK, c, s, i, HALF, INTERLEAVED, BLOCK_HK, BLOCK_R)


def _check_rope(op: str, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes and strides for RoPE on q and k; cos/sin with a unit last stride."""
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 3 or t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be [T, H, D] with a contiguous last dim, got "
                             f"{tuple(t.shape)} strides {t.stride()}")
    T = q.shape[0]
    half = rotary_dim // 2
    if cos.shape != (T, half) or sin.shape != (T, half) or k.shape[0] != T:
        raise ValueError(f"{op}: cos/sin must be [{T}, {half}] for {T} tokens, got "
                         f"{tuple(cos.shape)}/{tuple(sin.shape)} (k has {k.shape[0]} tokens)")
    return (cos if cos.stride(-1) == 1 else cos.contiguous()), (sin if sin.stride(-1) == 1 else sin.contiguous())


def rope_apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
               interleaved: bool) -> None:
    """Rotate the first ``rotary_dim`` channels of ``q [T, Hq, D]`` and ``k [T, Hk, D]`` in place (one
    launch); ``cos``/``sin`` ``[T, rotary_dim/2]``. q and k need a unit stride on their last dim."""
    cos, sin = _check_rope("rope_apply", q, k, cos, sin, rotary_dim)
    T, half = q.shape[0], rotary_dim // 2
    if T == 0:
        return
    _rope_kernel[(T,)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        q.shape[1], k.shape[1],
        HALF=half, INTERLEAVED=interleaved, BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]), BLOCK_R=triton.next_power_of_2(max(half, 1)),
        num_warps=4 if q.shape[1] * half >= 1024 else 2, **launch_opts(q),
    )


# -- paged KV-cache write ---------------------------------------------------------------------------


@triton.jit
def _kv_write_kernel(
    K, V, KC, VC, Slots,
    stride_kt, stride_kh, stride_vt, stride_vh,
    HK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # see _rms_norm_kernel
        gdc_wait()
        gdc_launch_dependents()
    # one program per token: its k and v rows go to one cache slot
    _kv_token(K, V, KC, VC, Slots, tl.program_id(0).to(tl.int64), stride_kt, stride_kh, stride_vt, stride_vh,
              HK, D, DV, BLOCK_H, BLOCK_D, BLOCK_DV)


@triton.jit
def _kv_token(K, V, KC, VC, Slots, t, stride_kt, stride_kh, stride_vt, stride_vh,
              HK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr):
    slot = tl.load(Slots + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = (h < HK) & (d < D)
    x = tl.load(K + t * stride_kt + h * stride_kh + d, mask=ok, other=0.0)
    tl.store(KC + slot * (HK * D) + h * D + d, x.to(KC.dtype.element_ty), mask=ok)
    dv = tl.arange(0, BLOCK_DV)[None, :]
    okv = (h < HK) & (dv < DV)
    y = tl.load(V + t * stride_vt + h * stride_vh + dv, mask=okv, other=0.0)
    tl.store(VC + slot * (HK * DV) + h * DV + dv, y.to(VC.dtype.element_ty), mask=okv)


def _check_kv(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    T, hk, d = k.shape
    dv = v.shape[-1]
    if v.shape[:2] != (T, hk) or k_cache.shape[2:] != (hk, d) or v_cache.shape[2:] != (hk, dv):
        raise ValueError(f"{op}: k {tuple(k.shape)}, v {tuple(v.shape)} do not fit the caches "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if slot_mapping.shape != (T,):
        raise ValueError(f"{op}: slot_mapping {tuple(slot_mapping.shape)} needs one slot per token ({T})")


def kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """``k [T, Hk, D]``/``v [T, Hk, Dv]`` (unit last stride) into contiguous paged caches
    ``[pages, page_size, Hk, D(v)]`` at the flat slots ``slot_mapping [T]``, in one launch."""
    _check_kv("kv_write", k_cache, v_cache, k, v, slot_mapping)
    T, hk, d = k.shape
    dv = v.shape[-1]
    if T == 0:
        return
    _kv_write_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HK=hk, D=d, DV=dv, BLOCK_H=triton.next_power_of_2(hk), BLOCK_D=triton.next_power_of_2(d),
        BLOCK_DV=triton.next_power_of_2(dv), num_warps=4 if hk * max(d, dv) >= 1024 else 2,
        **launch_opts(k_cache),
    )


# -- RoPE and the paged KV-cache write in one launch ------------------------------------------------


@triton.jit
def _rope_kv_kernel(
    Q, K, V, KC, VC, Slots, Cos, Sin,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    HQ, HK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # see _rms_norm_kernel
        gdc_wait()
        gdc_launch_dependents()
    # one program per token: rotate its q and k heads in place, then copy k (rotated) and v to its slot
    t = tl.program_id(0).to(tl.int64)
    _rope_token(Q, K, Cos, Sin, t, stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st, HQ, HK,
                HALF, INTERLEAVED, BLOCK_HQ, BLOCK_HK, BLOCK_R)
    tl.debug_barrier()  # the rotated k stored above is read back below by other threads of the program
    _kv_token(K, V, KC, VC, Slots, t, stride_kt, stride_kh, stride_vt, stride_vh, HK, D, DV, BLOCK_HK, BLOCK_D,
              BLOCK_DV)


def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                  interleaved: bool) -> None:
    """:func:`rope_apply` then :func:`kv_write` in one launch (same arguments and checks as the two)."""
    cos, sin = _check_rope("rope_kv_write", q, k, cos, sin, rotary_dim)
    if v.dim() != 3 or v.stride(-1) != 1:
        raise ValueError(f"rope_kv_write: v must be [T, H, D] with a contiguous last dim, got {tuple(v.shape)} "
                         f"strides {v.stride()}")
    _check_kv("rope_kv_write", k_cache, v_cache, k, v, slot_mapping)
    T, hk, d = k.shape
    dv, half = v.shape[-1], rotary_dim // 2
    if T == 0:
        return
    _rope_kv_kernel[(T,)](
        q, k, v, k_cache, v_cache, slot_mapping, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        q.shape[1], HK=hk, D=d, DV=dv,
        HALF=half, INTERLEAVED=interleaved, BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
        BLOCK_HK=triton.next_power_of_2(hk), BLOCK_R=triton.next_power_of_2(max(half, 1)),
        BLOCK_D=triton.next_power_of_2(d), BLOCK_DV=triton.next_power_of_2(dv),
        num_warps=4 if q.shape[1] * half >= 1024 else 2, **launch_opts(q),
    )


# -- the decode step's first kernels: embedding lookup with row sums, RoPE tables -------------------


@triton.jit
def _rope_row(Pos, InvFreq, Cos, Sin, t, HALF, factor, HAS_FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    # cos/sin of position t times every inverse frequency, fp32, into row t. tl.cos/tl.sin lower to
    # libdevice's precise __nv_cosf/__nv_sinf (checked in the PTX): the arguments reach 1e5 rad and
    # more at long contexts, where the approximate instructions lose their accuracy.
    i = tl.arange(0, BLOCK)
    ok = i < HALF
    f = tl.load(Pos + t).to(tl.float32) * tl.load(InvFreq + i, mask=ok, other=0.0)
    c = tl.cos(f)
    s = tl.sin(f)
    if HAS_FACTOR:
        c = c * factor
        s = s * factor
    tl.store(Cos + t * HALF + i, c, mask=ok)
    tl.store(Sin + t * HALF + i, s, mask=ok)


@triton.jit
def _carry_rows(Ids, Carry, Src, S, i, ok):
    # Ids[i] = int64(Src[Carry[i]]) where ok and 0 <= Carry[i] < S, other rows keep their id; returns
    # (take, the carried ids): the one rule of _carry_ids_kernel and _embed_ss_kernel's HAS_CARRY
    c = tl.load(Carry + i, mask=ok, other=-1)
    take = ok & (c >= 0) & (c < S)
    v = tl.load(Src + tl.where(take, c, 0), mask=take, other=0.0).to(tl.int64)
    tl.store(Ids + i, v, mask=take)
    return take, v


@triton.jit
def _embed_ss_kernel(Ids, W, H, SS, Carry, Src, S, Pos, InvFreq, Cos, Sin, HALF, rfactor,
                     stride_w, stride_wc, stride_h, N, V, rows, SS_N, scale,
                     HAS_SCALE: tl.constexpr, HAS_CARRY: tl.constexpr, HAS_ROPE: tl.constexpr,
                     HAS_RFACTOR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Z: tl.constexpr, BLOCK_R: tl.constexpr,
                     PDL: tl.constexpr):
    # program r: h[r] = W[ids[r]] (* scale, rounded once to h's dtype) and SS[r] = Σ h[r]² in fp32;
    # SS[rows:] zeroed, a BLOCK_Z stride per program (the sums the linears after it add into).
    # HAS_CARRY: first ids[r] = int64(Src[Carry[r]]) where 0 <= Carry[r] < S (_carry_rows).
    # HAS_ROPE: also row r of the RoPE tables (_rope_row, as _rope_tables_kernel)
    if PDL:  # see _rms_norm_kernel
        gdc_wait()
        gdc_launch_dependents()
    r = tl.program_id(0)
    if HAS_ROPE:
        _rope_row(Pos, InvFreq, Cos, Sin, r.to(tl.int64), HALF, rfactor, HAS_RFACTOR, BLOCK_R)
    idx = tl.load(Ids + r).to(tl.int64)
    if HAS_CARRY:  # the step's ids as carry_ids leaves them
        take, carried = _carry_rows(Ids, Carry, Src, S, r, r < rows)
        idx = tl.where(take, carried, idx)
    idx = tl.minimum(tl.maximum(idx, 0), V - 1)  # ids are checked at enqueue; never read outside the table
    cols = tl.arange(0, BLOCK_N)
    x = tl.load(W + idx * stride_w + cols * stride_wc, mask=cols < N, other=0.0)
    if HAS_SCALE:
        x = (x.to(tl.float32) * scale).to(H.dtype.element_ty)
    tl.store(H + r.to(tl.int64) * stride_h + cols, x, mask=cols < N)
    xf = x.to(tl.float32)
    tl.store(SS + r, tl.sum(xf * xf, 0))
    z = tl.arange(0, BLOCK_Z)
    for start in range(rows + r * BLOCK_Z, SS_N, rows * BLOCK_Z):
        tl.store(SS + start + z, 0.0, mask=start + z < SS_N)


def embed_ss(ids: torch.Tensor, weight: torch.Tensor, scale: float | None, ss_slots: int,
             carry: tuple[torch.Tensor, torch.Tensor] | None = None,
             rope: tuple[torch.Tensor, torch.Tensor, float] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(h, ss, cos, sin)``: ``h = weight[ids] (* scale)`` ``[T, N]`` and fp32 ``ss [ss_slots, T]`` whose
    first row holds ``h``'s row sums of squares (a deferred norm's input) and the rest zeros, in one launch.
    ``carry = (carry, src)``: the rows' ids are first carried over as :func:`carry_ids` does. ``rope =
    (positions [T], inv_freq [half], factor)``: the same launch also writes :func:`rope_tables`' fp32
    ``cos, sin [T, half]`` (else None). Operands checked by :mod:`exl3_core.ops`."""
    if ids.dim() != 1 or weight.dim() != 2 or ss_slots < 1:
        raise ValueError(f"embed_ss: want ids [T], weight [V, N] and ss_slots >= 1; got {tuple(ids.shape)}, "
                         f"{tuple(weight.shape)}, {ss_slots}")
    w = weight  # read in place whatever its layout: a copy here would copy the whole table every step
    T, (V, N) = ids.shape[0], w.shape
    h = torch.empty((T, N), dtype=w.dtype, device=w.device)
    ss = torch.empty((ss_slots, T), dtype=torch.float32, device=w.device)
    cos = sin = None
    if rope is not None:
        pos, inv, rfactor = rope[0], rope[1].contiguous(), float(rope[2])
        cos = torch.empty((T, inv.shape[0]), dtype=torch.float32, device=w.device)
        sin = torch.empty((T, inv.shape[0]), dtype=torch.float32, device=w.device)
    else:
        pos, inv, rfactor = ids, ss, 1.0  # placeholder pointers when absent
    if T == 0:
        return h, ss, cos, sin
    block_n = triton.next_power_of_2(N)
    c, src = carry if carry is not None else (ids, ids)
    half = inv.shape[0] if rope is not None else 1
    _embed_ss_kernel[(T,)](
        ids, w, h, ss, c, src, src.shape[0], pos, inv, cos if cos is not None else ss, sin if sin is not None else ss,
        half, rfactor, w.stride(0), w.stride(1), h.stride(0), N, V, T, ss_slots * T,
        float(scale if scale is not None else 1.0), HAS_SCALE=scale is not None, HAS_CARRY=carry is not None,
        HAS_ROPE=rope is not None, HAS_RFACTOR=rfactor != 1.0, BLOCK_N=block_n, BLOCK_Z=256,
        BLOCK_R=triton.next_power_of_2(half), num_warps=_norm_warps(block_n), **launch_opts(h),
    )
    return h, ss, cos, sin


@triton.jit
def _rope_tables_kernel(Pos, InvFreq, Cos, Sin, HALF, factor,
                        HAS_FACTOR: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # program t: row t of the tables (_rope_row)
    if PDL:  # see _rms_norm_kernel
        gdc_wait()
        gdc_launch_dependents()
    _rope_row(Pos, InvFreq, Cos, Sin, tl.program_id(0).to(tl.int64), HALF, factor, HAS_FACTOR, BLOCK)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor,
                factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` ``[T, half]`` of ``positions [T] * inv_freq [half]`` (times ``factor``), one launch."""
    if positions.dim() != 1 or inv_freq.dim() != 1 or inv_freq.dtype != torch.float32:
        raise ValueError(f"rope_tables: want positions [T] and fp32 inv_freq [half]; got {tuple(positions.shape)}, "
                         f"{tuple(inv_freq.shape)} {inv_freq.dtype}")
    T, half = positions.shape[0], inv_freq.shape[0]
    inv = inv_freq.contiguous()
    cos = torch.empty((T, half), dtype=torch.float32, device=inv.device)
    sin = torch.empty((T, half), dtype=torch.float32, device=inv.device)
    if T == 0 or half == 0:
        return cos, sin
    _rope_tables_kernel[(T,)](
        positions, inv, cos, sin, half, float(factor), HAS_FACTOR=factor != 1.0,
        BLOCK=triton.next_power_of_2(half), num_warps=1, **launch_opts(cos),
    )
    return cos, sin


# -- greedy pick of a decode step: argmax and the "row has a finite logit, no NaN/+inf" flag --------


@triton.jit
def _greedy_pack_kernel(X, Count, PartM, PartI, PartF, Out, stride_x, V, B, P,
                        BLOCK: tl.constexpr, P_BLOCK: tl.constexpr, PDL: tl.constexpr):
    # grid (rows, P): each program reduces BLOCK logits of its row to (max, its first index, flags);
    # the row's last program to arrive combines the P partials and writes Out [2, rows] (float64).
    if PDL:  # see _rms_norm_kernel
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    cols = p * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    x = tl.load(X + row * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
    nan = x != x
    bad = nan | (x == float("inf"))  # NaN or +inf: a numeric fault, never a valid pick
    flags = tl.max(((tl.abs(x) < float("inf")) & ok).to(tl.int32), 0) + 2 * tl.max(bad.to(tl.int32), 0)
    x = tl.where(nan, float("-inf"), x)  # a NaN row is flagged; its id is not used
    m = tl.max(x, 0)
    first = tl.min(tl.where(x == m, cols, 2147483647), 0)  # first occurrence, as torch.argmax
    first = tl.where(m == float("-inf"), p * BLOCK, first)  # all -inf: this block's first column
    slot = row * P + p
    tl.store(PartM + slot, m)
    tl.store(PartI + slot, first)
    tl.store(PartF + slot, flags)
    tl.debug_barrier()  # every thread's partial stores precede the release below
    done = tl.atomic_add(Count + row, 1, sem="acq_rel")
    if done == P - 1:
        ps = tl.arange(0, P_BLOCK)
        pok = ps < P
        pm = tl.load(PartM + row * P + ps, mask=pok, other=float("-inf"), cache_modifier=".cg")
        pi = tl.load(PartI + row * P + ps, mask=pok, other=2147483647, cache_modifier=".cg")
        pf = tl.load(PartF + row * P + ps, mask=pok, other=0, cache_modifier=".cg")
        mm = tl.max(pm, 0)
        idx = tl.min(tl.where(pm == mm, pi, 2147483647), 0)  # partials in column order: the first wins
        finite = tl.max(pf & 1, 0)
        anynan = tl.max(pf & 2, 0)
        tl.store(Out + row, idx.to(tl.float64))
        tl.store(Out + B + row, ((finite > 0) & (anynan == 0)).to(tl.float64))
        tl.store(Count + row, 0)  # clean for the next call (a replayed graph reuses the buffer)


_GREEDY_BLOCK = 4096


def greedy_pack(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float64 ``[2, B]``: ``logits [B, V]``'s argmax (first maximum) and "has a finite logit and no
    NaN or +inf" flag per row, in one launch (the reference's argmax, isfinite/isnan reductions, casts and
    stack were ~10 kernels and ~80 us per decode step at V = 128256 on an H200). ``out``: a contiguous
    float64 ``[2, B]`` to write instead of a new tensor (checked by :func:`exl3_core.ops.greedy_pack`)."""
    if logits.dim() != 2:
        raise ValueError(f"greedy_pack: logits must be [B, V], got shape {tuple(logits.shape)}")
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    B, V = x.shape
    if out is None:
        out = torch.empty((2, B), dtype=torch.float64, device=x.device)
    if B == 0:
        return out
    P = triton.cdiv(V, _GREEDY_BLOCK)
    part_m = torch.empty((B, P), dtype=torch.float32, device=x.device)
    part_i = torch.empty((B, P), dtype=torch.int32, device=x.device)
    part_f = torch.empty((B, P), dtype=torch.int32, device=x.device)
    _greedy_pack_kernel[(B, P)](
        x, arrival_counters("greedy_pack", x.device, B), part_m, part_i, part_f, out, x.stride(0), V, B, P,
        BLOCK=_GREEDY_BLOCK, P_BLOCK=max(16, triton.next_power_of_2(P)), num_warps=8, **launch_opts(out),
    )
    return out


# -- a decode step's input ids carried over from the previous step's greedy ids, on the device ------


@triton.jit
def _carry_ids_kernel(Ids, Carry, Src, B, S, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # one program: Ids[i] = int64(Src[Carry[i]]) where 0 <= Carry[i] < S; other rows keep their id
    if PDL:  # see _rms_norm_kernel
        gdc_wait()
        gdc_launch_dependents()
    i = tl.arange(0, BLOCK)
    _carry_rows(Ids, Carry, Src, S, i, i < B)


def carry_ids(ids: torch.Tensor, carry: torch.Tensor, src: torch.Tensor) -> None:
    """In place: ``ids[i] = int64(src[carry[i]])`` where ``0 <= carry[i] < len(src)`` (checked by
    :func:`exl3_core.ops.carry_ids`), one launch."""
    B = ids.shape[0]
    if B == 0:
        return
    _carry_ids_kernel[(1,)](ids, carry, src, B, src.shape[0], BLOCK=max(16, triton.next_power_of_2(B)),
                            num_warps=1, **launch_opts(ids))
