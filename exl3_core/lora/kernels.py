"""Triton kernels of the per-row LoRA delta (the torch form is :meth:`LoraLinear._delta2`).

Two launches per group of 1-3 adapted linears that read the same input (q/k/v, gate/up, or one linear),
both reading the step's choice from the device (the active-slot count too, as a loop bound), so one
captured graph serves every mix of adapters:

* **shrink**, grid ``(row blocks, slot capacity, linears x input slices)``: program ``(m, u, g, s)`` computes
  the slice ``s`` part of ``xa[rows, g, u, :] = coef[rows, u] * scale_g[slot_u] * (x[rows] A_g[slot_u]ᵀ)`` for
  the active entry ``u`` (programs past the active count, or whose adapter does not target linear ``g``, do
  nothing). Row blocks of at most 32 rows (decode) cut the input into slices of one input block each
  (wider where :data:`MAX_SLICE_VALUES` caps their count), so the long reduction over the input features runs
  in parallel; each program reads its entry's tables and weights before it waits for the input's producer.
  The last of an entry's slice programs to arrive sums the slices in a fixed order (deterministic) into slice
  0, so the expand reads one partial per entry: read by every expand program, the slices would cost the expand
  a load per slice and program (at b=32 with eight adapters, 16 slices of 16 KB for each of q/k/v's 96 output
  blocks);
* **expand**, grid ``(row blocks, output blocks of every linear)``: ``out_g = y_g + sum_u xa[rows, g, u, :]
  Bᵀ_g[slot_u]`` over the active entries, accumulated in fp32 and rounded once (``out_g`` may be ``y_g``). Up to
  32 rows, where the slot capacity times the block rank is at most :data:`WIDE_MAX_VALUES`, every entry goes into
  one product (``[rows, capacity x rank] @ [capacity x rank, columns]``, inactive entries zero) instead of one
  dependent round of loads per adapter, which binds a decode batch that uses many adapters; otherwise the expand
  iterates over the active entries. Into a residual stream that the linear's launch has already added to (o,
  down), it also adds each row's change of the sum of squares, ``sum(out^2 - y^2)`` (fp32 atomics), to the sums
  the launch made for the deferred norm after it.

The shrink may form its input as it loads it (:class:`ShrinkInput`): a deferred RMSNorm of the residual stream
(q/k/v and gate/up after a pre-norm whose norm the base launch applies in its prologue) or a gated MLP's
``act(gate) * up`` (down), so the adapters add no launch that forms the input. The plan launches it after the
base linear, so that linear follows the kernel before it directly; where the linear adds its output to the residual
stream (o, down), the expand then adds the delta into the stream and moves the rows' sums of squares with it.

Each adapter's weights are read once per row block, whatever mix of adapters the rows use. Products
take the weights' dtype on the tensor cores (fp32 weights: exact fp32 products), accumulate in fp32.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from exl3_core.kernels.codes import ACT_CODES
from exl3_core.kernels.counters import arrival_counters
from exl3_core.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_opts
from exl3_core.lora.selection import Selection
from exl3_core.lora.stack import LoraStack
from exl3_core.nn.adapters import AdapterInput, GatedInput, NormedInput, norm_formable

#: linears one launch pair serves
MAX_GROUP = 3
#: the most partial values the last slice program of a shrink entry sums at once (slices x rows x rank): a register
#: budget
MAX_SLICE_VALUES = 16384
#: the most entries x block rank one expand product takes (a register budget); wider selections iterate
WIDE_MAX_VALUES = 256
#: the most rows the one-product expand takes: its [rows, entries x rank] operand stays within the registers
#: of a 32-row block (a 64-row block would hold twice as many)
WIDE_MAX_ROWS = 32


#: how the shrink forms its input from what it loads (the kernels' ``FORM``): as is, an RMSNorm of it (1), or
#: act(gate) times it (2)
FORM_PLAIN, FORM_NORM, FORM_GATED = 0, 1, 2


@triton.jit
def _form_input(x, GATE, NW, rows, kk, rmask, kmask, stride_g, inv, offset,
                FORM: tl.constexpr, HAS_W: tl.constexpr, ACT: tl.constexpr):
    # the input the plain modules would have formed, with their math and rounding (exl3_core.kernels.fused)
    if FORM == 1:  # FORM_NORM
        y = x.to(tl.float32) * inv[:, None]
        if HAS_W:
            y = y * (tl.load(NW + kk, mask=kmask, other=0.0).to(tl.float32) + offset)[None, :]
        x = y.to(x.dtype)
    elif FORM == 2:  # FORM_GATED
        g = tl.load(GATE + rows[:, None].to(tl.int64) * stride_g + kk[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        if ACT == 0:
            a = g * tl.sigmoid(g)
        else:
            a = g * tl.sigmoid(2.0 * (0.7978845608028654 * (g + 0.044715 * g * g * g)))
        x = (a * x.to(tl.float32)).to(x.dtype)
    return x


# scalars that differ per member are picked at run time: never specialized (a 1 would become a constant)
@triton.jit(do_not_specialize=["RK0", "RK1", "RK2", "sas0", "sas1", "sas2", "sar0", "sar1", "sar2", "KS", "SPLIT"])
def _shrink_kernel(X, GATE, SS, NW, A0, A1, A2, L0, L1, L2, S0, S1, S2, SLOTS, COEF, ROWMAP, XA, COUNT,
                   R, K, RK0, RK1, RK2, sas0, sas1, sas2, sar0, sar1, sar2, stride_x, stride_g, stride_coef, U, KS,
                   SPLIT, eps, offset,
                   NUM: tl.constexpr, HAS_MAP: tl.constexpr, IEEE: tl.constexpr, FORM: tl.constexpr,
                   HAS_W: tl.constexpr, ACT: tl.constexpr,
                   BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, KS_BLOCK: tl.constexpr,
                   PDL: tl.constexpr):
    pid_m = tl.program_id(0)
    u = tl.program_id(1)
    g = tl.program_id(2) // KS
    ks = tl.program_id(2) % KS
    # The step's choice and the adapters' weights are written before the step's launches, never by one of them:
    # read before waiting for the kernel before this one, so that only the input waits for it. Entries past the
    # active ones hold a sentinel slot whose scale is 0.
    slot = tl.load(SLOTS + u)
    A, LOC, SC, RANK, s_as, s_ar = A0, L0, S0, RK0, sas0, sar0
    if NUM > 1:  # noqa: SIM102 - a compile-time test around a run-time one (Triton has no mixed `and`)
        if g == 1:
            A, LOC, SC, RANK, s_as, s_ar = A1, L1, S1, RK1, sas1, sar1
    if NUM > 2:  # noqa: SIM102 - as above
        if g == 2:
            A, LOC, SC, RANK, s_as, s_ar = A2, L2, S2, RK2, sas2, sar2
    s = tl.load(SC + slot)
    live = s != 0.0
    loc = tl.load(LOC + slot).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < R
    rr = tl.arange(0, BR)
    rank_ok = rr < RANK
    k_lo = ks * SPLIT
    kk = k_lo + tl.arange(0, BK)
    kmask = kk < K
    a = tl.load(A + loc * s_as + rr[:, None] * s_ar + kk[None, :],
                mask=(rr < tl.where(live, RANK, 0))[:, None] & kmask[None, :], other=0.0)  # nothing where not live
    if not HAS_MAP:
        c = tl.load(COEF + rows.to(tl.int64) * stride_coef + u, mask=rows < tl.where(live, R, 0), other=0.0)
    if PDL:  # a programmatic dependent: let the next launch start its own prefetch, then wait for the input
        # every program waits, live or not: a grid whose programs all ended without waiting could complete before
        # the kernel before it, and the expand (which waits for this grid only) would then read that kernel's outputs
        # before they are written
        gdc_launch_dependents()
        gdc_wait()  # also before any store: the memory may be a buffer the kernel before still reads
    if live:
        if HAS_MAP:  # the row map may come from a kernel of this step
            crow = tl.load(ROWMAP + rows, mask=rmask, other=0)
            c = tl.load(COEF + crow.to(tl.int64) * stride_coef + u, mask=rmask, other=0.0)
        inv = tl.full((BM,), 1.0, tl.float32)
        if FORM == 1:  # FORM_NORM: each row's RMS scale, as the norm kernel's (exl3_core.kernels.fused)
            inv = tl.rsqrt(tl.load(SS + rows, mask=rmask, other=1.0) / K + eps)
        acc = tl.zeros((BM, BR), dtype=tl.float32)
        for k0 in range(k_lo, tl.minimum(k_lo + SPLIT, K), BK):
            if k0 != k_lo:  # the first block's weights are loaded above
                kk = k0 + tl.arange(0, BK)
                kmask = kk < K
                a = tl.load(A + loc * s_as + rr[:, None] * s_ar + kk[None, :],
                            mask=rank_ok[:, None] & kmask[None, :], other=0.0)
            x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + kk[None, :],
                        mask=rmask[:, None] & kmask[None, :], other=0.0)
            x = _form_input(x, GATE, NW, rows, kk, rmask, kmask, stride_g, inv, offset, FORM, HAS_W, ACT)
            if IEEE:
                acc += tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x.to(a.dtype), tl.trans(a))
        acc = acc * (c * s)[:, None]
        tl.store(XA + (((ks * R + rows[:, None].to(tl.int64)) * NUM + g) * U + u) * BR + rr[None, :], acc,
                 mask=rmask[:, None])
        if KS_BLOCK > 1:  # the entry's last slice program to arrive sums the slices into slice 0
            tl.debug_barrier()  # every thread's partial stores precede the release below
            cnt = COUNT + (pid_m * U + u) * NUM + g
            if tl.atomic_add(cnt, 1, sem="acq_rel") == KS - 1:
                # unrolled, so that every slice's load is in flight before the first add waits for one
                tot = tl.zeros((BM, BR), dtype=tl.float32)
                for sp in tl.static_range(KS_BLOCK):
                    ok = rmask & (rows * 0 + sp < KS)  # a tensor test: the interpreter's KS is a Python int
                    tot += tl.load(XA + (((sp * R + rows[:, None].to(tl.int64)) * NUM + g) * U + u) * BR + rr[None, :],
                                   mask=ok[:, None], other=0.0, cache_modifier=".cg")
                tl.store(XA + ((rows[:, None].to(tl.int64) * NUM + g) * U + u) * BR + rr[None, :], tot,
                         mask=rmask[:, None])
                tl.store(cnt, 0)  # clean for the next call (a replayed graph reuses the buffer)


@triton.jit
def _expand_wide(XA, bt, live, U, g, rows, rmask, rr,
                 NUM: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
                 UB: tl.constexpr):
    # sum_u xa[rows, g, u, :] Bᵀ[slot_u] as one product over [UB entries x BR] (bt: [UB, BR, BN], zero where an
    # entry is not live: past the active ones, or its adapter does not target this linear)
    uu = tl.arange(0, UB)
    m3 = rmask[:, None, None] & live[None, :, None]
    xa = tl.load(XA + ((rows[:, None, None].to(tl.int64) * NUM + g) * U + uu[None, :, None]) * BR + rr[None, None, :],
                 mask=m3, other=0.0)
    xa2 = tl.reshape(xa, (BM, UB * BR))
    bt2 = tl.reshape(bt, (UB * BR, BN))
    if IEEE:
        acc = tl.dot(xa2, bt2.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(xa2.to(bt2.dtype), bt2)
    return acc


@triton.jit(do_not_specialize=["N0", "N1", "N2", "NB0", "NB1", "RK0", "RK1", "RK2", "sbs0", "sbs1", "sbs2", "sbr0",
                               "sbr1", "sbr2", "sy0", "sy1", "sy2", "so0", "so1", "so2"])
def _expand_kernel(XA, B0, B1, B2, L0, L1, L2, S0, S1, S2, Y0, Y1, Y2, O0, O1, O2, SLOTS, NACT, SS,
                   R, N0, N1, N2, NB0, NB1, RK0, RK1, RK2, sbs0, sbs1, sbs2, sbr0, sbr1, sbr2,
                   sy0, sy1, sy2, so0, so1, so2, U,
                   NUM: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
                   UB: tl.constexpr, WIDE: tl.constexpr, HAS_SS: tl.constexpr, PDL: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = pid_n * 0
    nb = pid_n
    BT, LOC, SC, Y, OUT, N, RANK, s_bs, s_br, s_y, s_o = B0, L0, S0, Y0, O0, N0, RK0, sbs0, sbr0, sy0, so0
    if NUM > 1:  # noqa: SIM102 - a compile-time test around a run-time one (Triton has no mixed `and`)
        if pid_n >= NB0:
            g, nb = g + 1, pid_n - NB0
            BT, LOC, SC, Y, OUT, N, RANK, s_bs, s_br, s_y, s_o = B1, L1, S1, Y1, O1, N1, RK1, sbs1, sbr1, sy1, so1
    if NUM > 2:  # noqa: SIM102 - as above
        if pid_n >= NB0 + NB1:
            g, nb = g + 1, pid_n - NB0 - NB1
            BT, LOC, SC, Y, OUT, N, RANK, s_bs, s_br, s_y, s_o = B2, L2, S2, Y2, O2, N2, RK2, sbs2, sbr2, sy2, so2
    rows = pid_m * BM + tl.arange(0, BM)
    cols = nb * BN + tl.arange(0, BN)
    rmask = rows < R
    cmask = cols < N
    rr = tl.arange(0, BR)
    rank_ok = rr < RANK
    if WIDE:  # every entry's weights, read before waiting (the step's choice and the weights precede its launches)
        uu = tl.arange(0, UB)
        u_ok = uu < U
        slot = tl.load(SLOTS + uu, mask=u_ok, other=0)
        live = u_ok & (tl.load(SC + slot, mask=u_ok, other=0.0) != 0.0)
        loc = tl.load(LOC + slot, mask=live, other=0).to(tl.int64)
        bt = tl.load(BT + loc[:, None, None] * s_bs + rr[None, :, None] * s_br + cols[None, None, :],
                     mask=live[:, None, None] & rank_ok[None, :, None] & cmask[None, None, :], other=0.0)
    if PDL:  # the kernel after (an EXL3 linear) may start prefetching its weights; wait for the shrink's products
        gdc_launch_dependents()
        gdc_wait()
    if WIDE:
        acc = _expand_wide(XA, bt, live, U, g, rows, rmask, rr, NUM, IEEE, BM, BN, BR, UB)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        n_act = tl.load(NACT)
        for u in range(n_act):
            slot = tl.load(SLOTS + u)
            s = tl.load(SC + slot)
            if s != 0.0:
                loc = tl.load(LOC + slot).to(tl.int64)
                xa = tl.load(XA + ((rows[:, None].to(tl.int64) * NUM + g) * U + u) * BR + rr[None, :],
                             mask=rmask[:, None], other=0.0)
                bt = tl.load(BT + loc * s_bs + rr[:, None] * s_br + cols[None, :],
                             mask=rank_ok[:, None] & cmask[None, :], other=0.0)
                if IEEE:
                    acc += tl.dot(xa, bt.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(xa.to(bt.dtype), bt)
    m = rmask[:, None] & cmask[None, :]
    y = tl.load(Y + rows[:, None].to(tl.int64) * s_y + cols[None, :], mask=m, other=0.0)
    o = (y.to(tl.float32) + acc).to(OUT.dtype.element_ty)
    tl.store(OUT + rows[:, None].to(tl.int64) * s_o + cols[None, :], o, mask=m)
    if HAS_SS:  # the rows' sums of squares move by this block's sum(out^2 - y^2) (zero where masked)
        of, yf = o.to(tl.float32), y.to(tl.float32)
        tl.atomic_add(SS + rows, tl.sum(of * of - yf * yf, axis=1), mask=rmask, sem="relaxed")


def _block_rank(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def pad_members(items: list) -> list:
    """A group's per-member arguments for :data:`MAX_GROUP` slots: unused members repeat the first (never read:
    ``NUM`` says how many are real)."""
    return items + [items[0]] * (MAX_GROUP - len(items))


@dataclass(frozen=True)
class ShrinkInput:
    """What the shrink reads for the input rows ``[n, k]``: ``x2`` itself (``FORM_PLAIN``), or the tensors that
    form it inside the kernel: ``rms_norm(x2)`` from ``ss`` (fp32, the rows' sums of squares), ``weight`` (fp32
    ``[k]`` or None), ``eps`` and ``offset`` (``FORM_NORM``), or ``act(gate2) * x2`` (``FORM_GATED``, ``act`` a
    code of :data:`exl3_core.kernels.codes.ACT_CODES`). Tensors unit-strided on their last dim."""

    x2: torch.Tensor
    form: int = FORM_PLAIN
    gate2: torch.Tensor | None = None
    act: int = 0
    ss: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    eps: float = 0.0
    offset: float = 0.0

    @classmethod
    def of(cls, x: AdapterInput, k: int) -> ShrinkInput | None:
        """The shrink's reading of an adapter input of width ``k``, or None where the kernel cannot form it."""
        def rows(t: torch.Tensor) -> torch.Tensor:
            t2 = t.reshape(-1, k)
            return t2 if t2.stride(-1) == 1 else t2.contiguous()

        if isinstance(x, torch.Tensor):
            return cls(rows(x))
        if isinstance(x, NormedInput):
            w = x.weight
            ok = x.h.shape[-1] == k and norm_formable(x.h, x.ss, w)
            return cls(rows(x.h), FORM_NORM, ss=x.ss, weight=None if w is None else w.contiguous(), eps=float(x.eps),
                       offset=float(x.offset)) if ok else None
        if isinstance(x, GatedInput):
            ok = x.gate.shape == x.up.shape and x.up.shape[-1] == k and x.act in ACT_CODES
            return cls(rows(x.up), FORM_GATED, gate2=rows(x.gate), act=ACT_CODES[x.act]) if ok else None
        return None


@dataclass(frozen=True)
class Shrunk:
    """A shrink launch's result for :func:`lora_expand`: ``xa [slices, n, linears, capacity, BR]`` fp32, the sum in
    slice 0 (nothing where an entry is not active or its adapter does not target the linear)."""

    xa: torch.Tensor
    slices: int
    bm: int
    br: int
    stacks: tuple[LoraStack, ...]
    sel: Selection


def lora_shrink(inp: ShrinkInput, stacks: Sequence[LoraStack], sel: Selection, rows: torch.Tensor | None) -> Shrunk:
    """The shrink launch of :func:`lora_add_group` over 1 to :data:`MAX_GROUP` linears reading ``inp``.
    ``rows``: the step rows of the input's rows (None: ``0..n-1``)."""
    x2 = inp.x2
    n, k = x2.shape
    num = len(stacks)
    if not 1 <= num <= MAX_GROUP:
        raise ValueError(f"lora_shrink: {num} stacks (1 to {MAX_GROUP})")
    U = sel.capacity
    br = _block_rank(max(s.rank for s in stacks))
    bm = 16 if n <= 16 else (32 if n <= 64 else 64)
    # decode sizes: one wide input block per program where the expand's register budget allows (the shrink is
    # bound by the latency of its loads there); larger row counts keep one slice
    decode = bm <= 32
    bk = (256 if decode else 64) if br <= 32 else (128 if decode else 32)
    ks = min(triton.cdiv(k, bk), max(1, MAX_SLICE_VALUES // (bm * br))) if decode else 1
    split = triton.cdiv(triton.cdiv(k, ks), bk) * bk  # a whole number of input blocks per slice
    ks = triton.cdiv(k, split)
    xa = torch.empty((ks, n, num, U, br), dtype=torch.float32, device=x2.device)
    bm_blocks = triton.cdiv(n, bm)
    count = arrival_counters("lora_shrink", x2.device, bm_blocks * U * num) if ks > 1 else xa
    pad = pad_members
    rowmap = rows if rows is not None else sel.slots  # any tensor: unread without HAS_MAP
    gate = inp.gate2 if inp.gate2 is not None else x2  # placeholders where unread
    ss = inp.ss if inp.ss is not None else sel.coef
    nw = inp.weight if inp.weight is not None else sel.coef
    _shrink_kernel[(bm_blocks, U, num * ks)](
        x2, gate, ss, nw, *pad([s.a for s in stacks]), *pad([s.local for s in stacks]),
        *pad([s.scale for s in stacks]), sel.slots, sel.coef, rowmap, xa, count,
        n, k, *pad([s.rank for s in stacks]), *pad([s.a.stride(0) for s in stacks]),
        *pad([s.a.stride(1) for s in stacks]), x2.stride(0), gate.stride(0), sel.coef.stride(0), U, ks, split,
        inp.eps, inp.offset,
        NUM=num, HAS_MAP=rows is not None, IEEE=stacks[0].a.dtype == torch.float32, FORM=inp.form,
        HAS_W=inp.weight is not None, ACT=inp.act, BM=bm, BR=br, BK=bk,
        KS_BLOCK=triton.next_power_of_2(ks) if ks > 1 else 1, **launch_opts(xa))
    return Shrunk(xa, ks, bm, br, tuple(stacks), sel)


def sums_fit(ss: torch.Tensor, n: int) -> bool:
    """Whether ``ss`` can take :func:`lora_expand`'s sums of squares for ``n`` rows: fp32, one dim, unit-strided, at
    least ``n`` long."""
    return ss.dtype == torch.float32 and ss.dim() == 1 and ss.stride(0) == 1 and ss.shape[0] >= n


def lora_expand(sh: Shrunk, ys: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                ss: torch.Tensor | None = None) -> None:
    """The expand launch of :func:`lora_add_group`: ``outs[g] = ys[g] + delta_g`` from a shrink's ``xa``
    (``[n, out_g]``, unit last strides, one dtype; ``outs[g]`` may be ``ys[g]``). ``ss`` (one linear only; fp32,
    unit-strided, at least n): each row's ``sum(outs^2 - ys^2)`` is added to it."""
    num = len(sh.stacks)
    if len(ys) != num or len(outs) != num:
        raise ValueError(f"lora_expand: {num} stacks, {len(ys)} outputs, {len(outs)} targets")
    if ss is not None and (num != 1 or not sums_fit(ss, sh.xa.shape[1])):
        raise ValueError(f"lora_expand: ss must be fp32 [>= {sh.xa.shape[1]}] for one linear, got {num} linears, "
                         f"{ss.dtype} {tuple(ss.shape)}")
    n = sh.xa.shape[1]
    stacks, sel, br = sh.stacks, sh.sel, sh.br
    pad = pad_members
    ub = triton.next_power_of_2(max(sel.capacity, 1))
    wide = n <= WIDE_MAX_ROWS and ub * br <= WIDE_MAX_VALUES
    bn = 64 if wide or br <= 32 else 32
    widths = [y.shape[1] for y in ys]
    blocks = [triton.cdiv(w, bn) for w in widths]
    _expand_kernel[(triton.cdiv(n, sh.bm), sum(blocks))](
        sh.xa, *pad([s.bt for s in stacks]), *pad([s.local for s in stacks]), *pad([s.scale for s in stacks]),
        *pad(list(ys)), *pad(list(outs)), sel.slots, sel.active, ss if ss is not None else sel.coef,
        n, *pad(widths), *(pad(blocks)[:2]), *pad([s.rank for s in stacks]), *pad([s.bt.stride(0) for s in stacks]),
        *pad([s.bt.stride(1) for s in stacks]), *pad([y.stride(0) for y in ys]), *pad([o.stride(0) for o in outs]),
        sel.capacity, NUM=num, IEEE=stacks[0].a.dtype == torch.float32, BM=sh.bm, BN=bn, BR=br, UB=ub, WIDE=wide,
        HAS_SS=ss is not None, **launch_opts(outs[0]))


def lora_add_group(x: torch.Tensor | ShrinkInput, ys: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                   stacks: Sequence[LoraStack], sel: Selection, rows: torch.Tensor | None) -> None:
    """For each linear ``g`` of a group reading ``x`` (``[n, in]``, or a :class:`ShrinkInput`): ``outs[g] = ys[g] +
    delta_g(x)`` (``[n, out_g]``, unit last strides, one dtype; ``outs[g]`` may be ``ys[g]``). ``rows``: the step
    rows of ``x``'s rows (None: ``0..n-1``). 1 to :data:`MAX_GROUP` linears, two launches."""
    if len(ys) != len(stacks) or len(outs) != len(stacks):
        raise ValueError(f"lora_add_group: {len(stacks)} stacks, {len(ys)} outputs, {len(outs)} targets")
    inp = x if isinstance(x, ShrinkInput) else ShrinkInput(x if x.stride(-1) == 1 else x.contiguous())
    lora_expand(lora_shrink(inp, stacks, sel, rows), ys, outs)


def lora_add(x2: torch.Tensor | ShrinkInput, y2: torch.Tensor, out2: torch.Tensor, stack: LoraStack, sel: Selection,
             rows: torch.Tensor | None) -> None:
    """``out2 = y2 + delta(x2)`` for one linear (see :func:`lora_add_group`)."""
    lora_add_group(x2, [y2], [out2], [stack], sel, rows)
