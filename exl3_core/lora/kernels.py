"""Triton kernels of the per-row LoRA delta (the torch form is :meth:`LoraLinear._delta2`).

Two launches per adapted linear, both reading the step's choice from the device (the active-slot
count too, as a loop bound), so one captured graph serves every mix of adapters:

* **shrink**, grid ``(row blocks, slot capacity)``: program ``(m, u)`` computes
  ``xa[rows, u, :] = coef[rows, u] * scale[slot_u] * (x[rows] A[slot_u]ᵀ)`` for the active entry ``u``
  (programs past the active count, or whose adapter does not target this linear, do nothing);
* **expand**, grid ``(row blocks, output blocks)``: ``out = y + sum_u xa[rows, u, :] Bᵀ[slot_u]`` over the
  active entries, accumulated in fp32 and rounded once (``out`` may be ``y``: in place).

Each adapter's weights are read once per row block, whatever mix of adapters the rows use. Products
take the weights' dtype on the tensor cores (fp32 weights: exact fp32 products), accumulate in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from exl3_core.lora.linear import LoraStack
from exl3_core.lora.selection import Selection


@triton.jit
def _shrink_kernel(X, A, SLOTS, LOCAL, SCALE, COEF, ROWMAP, NACT, XA,
                   R, K, RANK, stride_x, stride_as, stride_ar, stride_coef, U,
                   HAS_MAP: tl.constexpr, IEEE: tl.constexpr,
                   BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    u = tl.program_id(1)
    n_act = tl.load(NACT)
    if u < n_act:
        slot = tl.load(SLOTS + u)
        s = tl.load(SCALE + slot)
        if s != 0.0:
            loc = tl.load(LOCAL + slot).to(tl.int64)
            rows = pid_m * BM + tl.arange(0, BM)
            rmask = rows < R
            rr = tl.arange(0, BR)
            rank_ok = rr < RANK
            acc = tl.zeros((BM, BR), dtype=tl.float32)
            for k0 in range(0, K, BK):
                kk = k0 + tl.arange(0, BK)
                kmask = kk < K
                x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + kk[None, :],
                            mask=rmask[:, None] & kmask[None, :], other=0.0)
                a = tl.load(A + loc * stride_as + rr[:, None] * stride_ar + kk[None, :],
                            mask=rank_ok[:, None] & kmask[None, :], other=0.0)
                if IEEE:
                    acc += tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
                else:
                    acc += tl.dot(x.to(a.dtype), tl.trans(a))
            if HAS_MAP:
                crow = tl.load(ROWMAP + rows, mask=rmask, other=0)
            else:
                crow = rows
            c = tl.load(COEF + crow.to(tl.int64) * stride_coef + u, mask=rmask, other=0.0)
            acc = acc * (c * s)[:, None]
            tl.store(XA + (rows[:, None].to(tl.int64) * U + u) * BR + rr[None, :], acc, mask=rmask[:, None])


@triton.jit
def _expand_kernel(XA, BT, SLOTS, LOCAL, SCALE, NACT, Y, OUT,
                   R, N, RANK, stride_bs, stride_br, stride_y, stride_o, U,
                   IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rmask = rows < R
    cmask = cols < N
    rr = tl.arange(0, BR)
    rank_ok = rr < RANK
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    n_act = tl.load(NACT)
    for u in range(n_act):
        slot = tl.load(SLOTS + u)
        s = tl.load(SCALE + slot)
        if s != 0.0:
            loc = tl.load(LOCAL + slot).to(tl.int64)
            xa = tl.load(XA + (rows[:, None].to(tl.int64) * U + u) * BR + rr[None, :], mask=rmask[:, None], other=0.0)
            bt = tl.load(BT + loc * stride_bs + rr[:, None] * stride_br + cols[None, :],
                         mask=rank_ok[:, None] & cmask[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(xa, bt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xa.to(bt.dtype), bt)
    m = rmask[:, None] & cmask[None, :]
    y = tl.load(Y + rows[:, None].to(tl.int64) * stride_y + cols[None, :], mask=m, other=0.0)
    tl.store(OUT + rows[:, None].to(tl.int64) * stride_o + cols[None, :], (y.to(tl.float32) + acc).to(OUT.dtype.element_ty),
             mask=m)


def _block_rank(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def lora_add(x2: torch.Tensor, y2: torch.Tensor, out2: torch.Tensor, stack: LoraStack, sel: Selection,
             rows: torch.Tensor | None) -> None:
    """``out2 = y2 + delta(x2)`` for ``x2 [n, in]``, ``y2``/``out2 [n, out]`` (unit last strides; ``out2`` may be
    ``y2``); ``rows``: the step rows of ``x2``'s rows (None: ``0..n-1``)."""
    n, k = x2.shape
    n_out = y2.shape[1]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    U = sel.capacity
    br = _block_rank(stack.rank)
    bm = 16 if n <= 16 else (32 if n <= 64 else 64)
    ieee = stack.a.dtype == torch.float32
    xa = torch.empty((n, U, br), dtype=torch.float32, device=x2.device)
    rowmap = rows if rows is not None else sel.slots  # any tensor: unread without HAS_MAP
    bk = 64 if br <= 32 else 32
    _shrink_kernel[(triton.cdiv(n, bm), U)](
        x2, stack.a, sel.slots, stack.local, stack.scale, sel.coef, rowmap, sel.active, xa,
        n, k, stack.rank, x2.stride(0), stack.a.stride(0), stack.a.stride(1), sel.coef.stride(0), U,
        HAS_MAP=rows is not None, IEEE=ieee, BM=bm, BR=br, BK=bk)
    bn = 64 if br <= 32 else 32
    _expand_kernel[(triton.cdiv(n, bm), triton.cdiv(n_out, bn))](
        xa, stack.bt, sel.slots, stack.local, stack.scale, sel.active, y2, out2,
        n, n_out, stack.rank, stack.bt.stride(0), stack.bt.stride(1), y2.stride(0), out2.stride(0), U,
        IEEE=ieee, BM=bm, BN=bn, BR=br)
