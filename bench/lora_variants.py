"""Candidate LoRA decode kernels, timed through ``exl3 bench --lora`` against the product's pair (GPU).

The product runs each group of adapted linears that read one input (q/k/v, gate/up, o, down) as two Triton
launches: a shrink split over the input features, then an expand (``exl3_core.lora.kernels``; at decode sizes
every active adapter in one product). At b=1 on the 8B shape that is 256 launches a step, and the step went
from 2.55 to 4.70 ms on an H100, so the launches, not the adapters' bytes (about 3% of the weights), bind. The candidates here, installed in place of
``exl3_core.lora.kernels.lora_add_group`` for one bench run:

* ``pair``: the product as it is (the baseline);
* ``fused``: at most ``--fused-max-rows`` rows (16) and inputs of at most ``--fused-max-in`` features (8192), one
  launch per group: each program of the expand's grid computes its own linear's shrink (the adapter's A read from L2 by
  every program of that linear) before its columns, so no second launch waits for the first; launched as a
  programmatic dependent (PDL) of the kernel before it, like the step's other Triton kernels. Wider inputs
  (down_proj) and more rows (where rows may use many adapters, each a full shrink per program) keep the pair;
* ``fused_nopdl``: the same without PDL, to tell the two gains apart.

    python bench/lora_variants.py --check                  # candidates against the torch form (CPU or GPU)
    python bench/lora_variants.py --variant fused [--shape 8b] [--json OUT]

The pipeline's ``loravar`` stage runs every variant in its own process on one device.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch
import triton
import triton.language as tl

import exl3_core.lora.kernels as K
from exl3_core.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_opts
from exl3_core.lora.selection import Selection
from exl3_core.lora.stack import LoraStack

_PAIR = K.lora_add_group


@triton.jit(do_not_specialize=["N0", "N1", "N2", "NB0", "NB1", "RK0", "RK1", "RK2", "sas0", "sas1", "sas2", "sar0",
                               "sar1", "sar2", "sbs0", "sbs1", "sbs2", "sbr0", "sbr1", "sbr2", "sy0", "sy1", "sy2",
                               "so0", "so1", "so2"])
def _fused_kernel(X, A0, A1, A2, B0, B1, B2, L0, L1, L2, S0, S1, S2, Y0, Y1, Y2, O0, O1, O2,
                  SLOTS, COEF, ROWMAP, NACT, R, KIN, N0, N1, N2, NB0, NB1, RK0, RK1, RK2,
                  sas0, sas1, sas2, sar0, sar1, sar2, sbs0, sbs1, sbs2, sbr0, sbr1, sbr2,
                  sy0, sy1, sy2, so0, so1, so2, stride_x, stride_coef,
                  NUM: tl.constexpr, HAS_MAP: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    # program n: output block n of the group's linears (the expand's grid); for each active adapter, the
    # shrink of all rows for this program's linear, then its columns of the expand
    pid_n = tl.program_id(0)
    nb = pid_n
    A, BT, LOC, SC, Y, OUT, N, RANK = A0, B0, L0, S0, Y0, O0, N0, RK0
    s_as, s_ar, s_bs, s_br, s_y, s_o = sas0, sar0, sbs0, sbr0, sy0, so0
    if NUM > 1:  # noqa: SIM102 - a compile-time test around a run-time one
        if pid_n >= NB0:
            nb = pid_n - NB0
            A, BT, LOC, SC, Y, OUT, N, RANK = A1, B1, L1, S1, Y1, O1, N1, RK1
            s_as, s_ar, s_bs, s_br, s_y, s_o = sas1, sar1, sbs1, sbr1, sy1, so1
    if NUM > 2:  # noqa: SIM102 - as above
        if pid_n >= NB0 + NB1:
            nb = pid_n - NB0 - NB1
            A, BT, LOC, SC, Y, OUT, N, RANK = A2, B2, L2, S2, Y2, O2, N2, RK2
            s_as, s_ar, s_bs, s_br, s_y, s_o = sas2, sar2, sbs2, sbr2, sy2, so2
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    rows = tl.arange(0, BM)
    rmask = rows < R
    cols = nb * BN + tl.arange(0, BN)
    cmask = cols < N
    rr = tl.arange(0, BR)
    rank_ok = rr < RANK
    if HAS_MAP:
        crow = tl.load(ROWMAP + rows, mask=rmask, other=0)
    else:
        crow = rows
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    n_act = tl.load(NACT)
    for u in range(n_act):
        slot = tl.load(SLOTS + u)
        s = tl.load(SC + slot)
        if s != 0.0:
            loc = tl.load(LOC + slot).to(tl.int64)
            xa = tl.zeros((BM, BR), dtype=tl.float32)
            for k0 in range(0, KIN, BK):
                kk = k0 + tl.arange(0, BK)
                kmask = kk < KIN
                x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + kk[None, :],
                            mask=rmask[:, None] & kmask[None, :], other=0.0)
                a = tl.load(A + loc * s_as + rr[:, None] * s_ar + kk[None, :],
                            mask=rank_ok[:, None] & kmask[None, :], other=0.0)
                if IEEE:
                    xa += tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
                else:
                    xa += tl.dot(x.to(a.dtype), tl.trans(a))
            c = tl.load(COEF + crow.to(tl.int64) * stride_coef + u, mask=rmask, other=0.0)
            xa = xa * (c * s)[:, None]
            bt = tl.load(BT + loc * s_bs + rr[:, None] * s_br + cols[None, :],
                         mask=rank_ok[:, None] & cmask[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(xa, bt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xa.to(bt.dtype), bt)
    m = rmask[:, None] & cmask[None, :]
    y = tl.load(Y + rows[:, None].to(tl.int64) * s_y + cols[None, :], mask=m, other=0.0)
    tl.store(OUT + rows[:, None].to(tl.int64) * s_o + cols[None, :], (y.to(tl.float32) + acc).to(OUT.dtype.element_ty),
             mask=m)


def fused_add_group(x2: torch.Tensor, ys: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                    stacks: Sequence[LoraStack], sel: Selection, rows: torch.Tensor | None, *, pdl: bool = True,
                    max_in: int = 8192, max_rows: int = 32) -> None:
    """``lora_add_group``'s contract; one launch up to ``max_rows`` rows (at most 32) and ``max_in`` input
    features, else the product's pair."""
    n, k = x2.shape
    num = len(stacks)
    if n > min(max_rows, 32) or k > max_in or not 1 <= num <= K.MAX_GROUP:
        _PAIR(x2, ys, outs, stacks, sel, rows)
        return
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    br = K._block_rank(max(s.rank for s in stacks))
    bm = 16 if n <= 16 else 32
    bn = 128 if br <= 32 else 64
    bk = 256 if br <= 32 else 128

    pad = K.pad_members
    widths = [y.shape[1] for y in ys]
    blocks = [triton.cdiv(w, bn) for w in widths]
    opts = launch_opts(outs[0]) if pdl else {"PDL": False}
    _fused_kernel[(sum(blocks),)](
        x2, *pad([s.a for s in stacks]), *pad([s.bt for s in stacks]), *pad([s.local for s in stacks]),
        *pad([s.scale for s in stacks]), *pad(list(ys)), *pad(list(outs)),
        sel.slots, sel.coef, rows if rows is not None else sel.slots, sel.active, n, k,
        *pad(widths), *(pad(blocks)[:2]), *pad([s.rank for s in stacks]),
        *pad([s.a.stride(0) for s in stacks]), *pad([s.a.stride(1) for s in stacks]),
        *pad([s.bt.stride(0) for s in stacks]), *pad([s.bt.stride(1) for s in stacks]),
        *pad([y.stride(0) for y in ys]), *pad([o.stride(0) for o in outs]), x2.stride(0), sel.coef.stride(0),
        NUM=num, HAS_MAP=rows is not None, IEEE=stacks[0].a.dtype == torch.float32, BM=bm, BN=bn, BR=br, BK=bk,
        num_stages=3, **opts)


def install(variant: str, max_in: int, max_rows: int) -> None:
    """Route every LoRA group launch of this process through ``variant`` (``a+b``: each where it applies, in order)."""
    if variant not in ("pair", "fused", "fused_nopdl"):
        raise SystemExit(f"unknown variant {variant!r}: pair, fused or fused_nopdl")
    fused = None if variant == "pair" else variant

    def group(x2, ys, outs, stacks, sel, rows):  # type: ignore[no-untyped-def]
        n, k = x2.shape
        if fused is not None and n <= min(max_rows, 32) and k <= max_in:
            fused_add_group(x2, ys, outs, stacks, sel, rows, pdl=fused == "fused", max_in=max_in, max_rows=max_rows)
        else:
            _PAIR(x2, ys, outs, stacks, sel, rows)

    K.lora_add_group = group


def check(device: torch.device) -> None:
    """Each candidate against the torch form on fresh random stacks, selections and row maps."""
    from exl3_core.lora.linear import LoraLinear
    from exl3_core.lora.stack import StackEntry
    from exl3_core.nn.adapters import row_map

    g = torch.Generator().manual_seed(0)
    cases = 0
    for dtype in (torch.float16, torch.float32):
        for rows in (1, 7, 16, 32):
            for widths, big in (((256,), 64), ((256, 64, 64), 64), ((256, 64, 64), 16), ((192, 320), 16)):
                n_in, cap = 512, 8  # rank 64 beside 8 slots: the product's expand iterates over the entries
                stacks, lins = [], []
                for j, w in enumerate(widths):
                    entries = [StackEntry(s, torch.randn(r, n_in, generator=g) / 16, torch.randn(r, w, generator=g) / 4,
                                          sc) for s, r, sc in ((0, 16, 2.0), (3, 8, 0.5), (5, big if j else 4, 0.125))]
                    stacks.append(LoraStack.build(entries, cap, device, dtype))
                sel = Selection(device, cap, rows=rows)
                sel.fill([({0: 1.0, 3: -0.75, 4: 2.0}, rows // 2), ({5: 1.5, 0: 0.25}, rows - rows // 2)])
                lins = [LoraLinear(f"x{j}", n_in, w, st, sel) for j, (w, st) in enumerate(zip(widths, stacks))]
                x = torch.randn(rows, n_in, generator=g).to(device, dtype)
                ys = [torch.randn(rows, w, generator=g).to(device, dtype) for w in widths]
                refs = [(y.float() + lin.delta(x)).to(dtype) for y, lin in zip(ys, lins)]
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                for name, run in (("fused", fused_add_group),):
                    outs = [torch.empty_like(y) for y in ys]
                    run(x, ys, outs, stacks, sel, None)
                    for o, r in zip(outs, refs):
                        err = float((o.float() - r.float()).abs().max() / r.float().abs().max())
                        assert err < tol, (name, dtype, rows, widths, err)
                idx = torch.randperm(rows, generator=g)[: max(1, rows // 3)].to(device)
                for name, run in (("fused", fused_add_group),):
                    with row_map(idx):
                        subs = [torch.empty_like(y[idx]) for y in ys]
                        run(x[idx], [y[idx] for y in ys], subs, stacks, sel, idx)
                    for sub, r in zip(subs, refs):
                        err = float((sub.float() - r[idx].float()).abs().max() / r[idx].float().abs().max())
                        assert err < tol, ("row map", name, dtype, rows, widths, err)
                cases += 1
    print(f"fused LoRA kernels equal the torch form: {cases} cases (rows 1-32, 1-3 linears, fp16/fp32, "
          f"row maps)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="pair")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--fused-max-in", type=int, default=8192, help="widest input a fused launch takes")
    ap.add_argument("--fused-max-rows", type=int, default=16, help="most rows a fused launch takes (32 at most)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.check:
        check(dev)
        return
    from exl3_core.bench.models import parse_shape
    from exl3_core.lora.bench import run_lora_bench

    install(a.variant, a.fused_max_in, a.fused_max_rows)
    out = run_lora_bench(parse_shape(a.shape), codebook="mul1", device=dev,
                         log=lambda s: print(f"[{a.variant}] {s}", flush=True))
    if a.json is not None:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
