"""Attention backend conformance suite (shipped so third-party backends can run it too).

For every registered backend and every :class:`AttnSpec` in a grid, a backend that accepts the
spec (``unsupported_reasons(spec) == []``) must match :func:`exl3_core.reference.attention` on
fresh random inputs: varlen batches, paged caches with shuffled page tables, GQA/MQA, odd head
dims, windows, soft-capping, the latent (MLA) layout and quantized caches (``"kv/quant"``,
``"mla/quant"``: random keys and values quantized by :mod:`exl3_core.reference.kv_quant`, whose
dequantized pages the reference attends over; with recent rows, :mod:`exl3_core.reference.kv_recent`'s low
bits in rings with some stale tags and in the forward's rows).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from exl3_core.attention.spec import AttnArgs, AttnSpec, QuantPages, RecentRows, device_cc, pow2_bucket, sm_count
from exl3_core.reference import kv_quant, kv_recent
from exl3_core.reference.attention import attention as reference_attention


@dataclasses.dataclass(frozen=True)
class Case:
    """One conformance case: a spec plus the batch shape it is exercised with. The spec's static call
    fields (key bound, sequences, queries per sequence, SM count) are filled from the shape, as the
    attention modules fill them from a batch."""

    spec: AttnSpec
    q_lens: tuple[int, ...]
    past_lens: tuple[int, ...] = ()  # cached tokens before the new ones (paged cases)
    bits: tuple[int, int] = (4, 4)  # key and value bits of a quantized view

    def __post_init__(self) -> None:
        s = self.spec
        lens = [p + n for p, n in zip(self.past_lens or [0] * len(self.q_lens), self.q_lens)]
        uniform = len(set(self.q_lens)) == 1
        dev = torch.device(s.device_type) if s.device_type != "cuda" else torch.device("cuda", 0)
        kv_bits = s.kv_bits  # a quantized view's widths as its cache layer states them (a latent's: the keys')
        if kv_bits == (0, 0) and (s.cache or "").endswith("/quant"):
            kv_bits = (self.bits[0], self.bits[0]) if s.cache.startswith("mla/") else self.bits
        if s.recent and s.cache != "kv/quant":
            raise ValueError(f"Case: recent rows need the 'kv/quant' view, not {s.cache!r}")
        filled = s._replace(
            max_keys=s.max_keys or pow2_bucket(max(lens)), num_seqs=s.num_seqs or pow2_bucket(len(self.q_lens)),
            q_per_seq=s.q_per_seq or (self.q_lens[0] if s.phase == "decode" and uniform else 0),
            sm_count=s.sm_count or (sm_count(dev) if dev.type == "cuda" and torch.cuda.is_available() else 0),
            kv_bits=kv_bits)
        object.__setattr__(self, "spec", filled)

    @property
    def page_size(self) -> int:
        return self.spec.page_size or 16

    @property
    def id(self) -> str:
        s = self.spec
        return (f"{s.cache or 'nocache'}-{s.phase}-d{s.head_dim}"
                f"{'' if s.head_dim_v is None else f'v{s.head_dim_v}'}-h{s.num_q_heads}x{s.num_kv_heads}"
                f"-q{'.'.join(map(str, self.q_lens))}-p{'.'.join(map(str, self.past_lens)) or 0}"
                f"{f'-w{s.window}' if s.window else ''}{f'-cap{s.softcap:g}' if s.softcap else ''}"
                f"{f'-qps{s.q_per_seq}' if s.q_per_seq else ''}"
                f"{f'-k{self.bits[0]}v{self.bits[1]}' if s.cache and s.cache.endswith('/quant') else ''}"
                f"{f'-r{s.recent}' if s.recent else ''}"
                f"-{str(s.dtype).split('.')[-1]}")


def default_cases(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                  small: bool = True) -> list[Case]:
    """The grid: small sizes for CPU/interpreter runs, larger ones when ``small`` is False."""
    dev = torch.device(device)
    base = {"dtype": dtype, "device_type": dev.type, "device_cc": device_cc(dev)}
    paged = {"page_size": 16}
    mul = 1 if small else 8
    cases = []
    for hd, hq, hkv in ((64, 4, 4), (80, 4, 2), (96, 6, 1), (128, 8, 2)):
        cases.append(Case(AttnSpec(head_dim=hd, num_q_heads=hq, num_kv_heads=hkv, **base), (5 * mul, 1, 17 * mul)))
        cases.append(Case(AttnSpec(head_dim=hd, num_q_heads=hq, num_kv_heads=hkv, cache="kv/fp16", **paged, **base),
                          (7 * mul, 3, 1), (0, 21 * mul, 40 * mul)))
        cases.append(Case(AttnSpec(head_dim=hd, num_q_heads=hq, num_kv_heads=hkv, cache="kv/fp16", phase="decode",
                                   **paged, **base), (1, 1, 1), (1, 33 * mul, 16 * mul)))
    # long enough for whole key chunks below the causal diagonal (kernels may skip masking there)
    cases.append(Case(AttnSpec(head_dim=64, num_q_heads=2, num_kv_heads=1, **base), (150 * mul, 37)))
    cases.append(Case(AttnSpec(head_dim=64, num_q_heads=4, num_kv_heads=2, cache="kv/fp16", **paged, **base),
                      (20 * mul, 70), (130 * mul, 0)))
    cases.append(Case(AttnSpec(head_dim=64, num_q_heads=4, num_kv_heads=2, window=8, **base), (29 * mul, 3)))
    cases.append(Case(AttnSpec(head_dim=64, num_q_heads=4, num_kv_heads=2, cache="kv/fp16", window=8, **paged, **base),
                      (9, 1), (30 * mul, 12)))
    cases.append(Case(AttnSpec(head_dim=64, num_q_heads=2, num_kv_heads=1, softcap=20.0, **base), (13 * mul,)))
    # latent cache: keys = [latent | rope], values = the latent (leading channels), one KV head
    cases.append(Case(AttnSpec(head_dim=96, head_dim_v=64, num_q_heads=4, num_kv_heads=1, cache="mla/fp16", **paged, **base),
                      (6, 1), (10 * mul, 31 * mul)))
    cases.append(Case(AttnSpec(head_dim=96, head_dim_v=64, num_q_heads=4, num_kv_heads=1, cache="mla/fp16",
                               phase="decode", **paged, **base), (1, 1), (5, 50 * mul)))
    # one fresh sequence without the cache (a fresh prompt's call), a short-bound decode batch, and a
    # multi-token decode step (speculative verification: several queries per sequence)
    cases.append(Case(AttnSpec(head_dim=128, num_q_heads=8, num_kv_heads=2, **base), (37 * mul,)))
    cases.append(Case(AttnSpec(head_dim=64, num_q_heads=8, num_kv_heads=2, cache="kv/fp16", phase="decode",
                               **paged, **base), (1, 1, 1, 1), (3, 40, 17, 90)))
    cases.append(Case(AttnSpec(head_dim=64, num_q_heads=8, num_kv_heads=2, cache="kv/fp16", phase="decode",
                               **paged, **base), (3, 3), (20, 45 * mul)))
    # quantized caches: prefill and decode, GQA, several bit widths (multi-plane codes among them)
    for hd, hq, hkv, bits in ((64, 4, 2, (4, 4)), (128, 8, 2, (8, 3)), (96, 6, 1, (2, 5))):
        cases.append(Case(AttnSpec(head_dim=hd, num_q_heads=hq, num_kv_heads=hkv, cache="kv/quant", **paged, **base),
                          (7 * mul, 3, 1), (0, 21 * mul, 40 * mul), bits))
        cases.append(Case(AttnSpec(head_dim=hd, num_q_heads=hq, num_kv_heads=hkv, cache="kv/quant", phase="decode",
                                   q_per_seq=1, **paged, **base), (1, 1, 1), (1, 33 * mul, 16 * mul), bits))
    cases.append(Case(AttnSpec(head_dim=64, num_q_heads=8, num_kv_heads=2, cache="kv/quant", phase="decode",
                               q_per_seq=3, **paged, **base), (3, 3), (20, 45 * mul), (4, 3)))
    cases.append(Case(AttnSpec(head_dim=64, num_q_heads=4, num_kv_heads=2, cache="kv/quant", window=8, **paged, **base),
                      (9, 1), (30 * mul, 12), (6, 7)))
    # quantized caches keeping recent rows at 8 bits (a window of 16 over pages of 16: chunks span several windows)
    recent = {"cache": "kv/quant", "recent": 16}
    for hd, hq, hkv, bits in ((64, 4, 2, (4, 4)), (128, 8, 2, (8, 3)), (96, 6, 1, (2, 5))):
        cases.append(Case(AttnSpec(head_dim=hd, num_q_heads=hq, num_kv_heads=hkv, **recent, **paged, **base),
                          (7 * mul, 3, 1, 40), (0, 21 * mul, 40 * mul, 25), bits))
        cases.append(Case(AttnSpec(head_dim=hd, num_q_heads=hq, num_kv_heads=hkv, phase="decode", q_per_seq=1,
                                   **recent, **paged, **base), (1, 1, 1), (1, 33 * mul, 16 * mul), bits))
    cases.append(Case(AttnSpec(head_dim=64, num_q_heads=8, num_kv_heads=2, phase="decode", q_per_seq=3, **recent,
                               **paged, **base), (3, 3), (20, 45 * mul), (4, 3)))
    cases.append(Case(AttnSpec(head_dim=96, head_dim_v=64, num_q_heads=4, num_kv_heads=1, cache="mla/quant", **paged,
                               **base), (6, 1), (10 * mul, 31 * mul), (5, 5)))
    cases.append(Case(AttnSpec(head_dim=96, head_dim_v=64, num_q_heads=4, num_kv_heads=1, cache="mla/quant",
                               phase="decode", q_per_seq=1, **paged, **base), (1, 1), (5, 50 * mul), (3, 3)))
    return cases


def make_args(case: Case, device: torch.device | str = "cpu", seed: int = 0) -> AttnArgs:
    """Random inputs for ``case``; paged caches get a shuffled page table and poisoned free pages."""
    g = torch.Generator().manual_seed(seed)
    s = case.spec
    dev = torch.device(device)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype=s.dtype, device=dev)

    q_lens = list(case.q_lens)
    T = sum(q_lens)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q = rnd(T, s.num_q_heads, s.head_dim)
    common: dict[str, Any] = {"spec": s, "q": q, "cu_seqlens_q": cu, "scale": s.head_dim ** -0.5, "max_seqlen_q": max(q_lens)}
    if s.cache is None:
        k, v = rnd(T, s.num_kv_heads, s.head_dim), rnd(T, s.num_kv_heads, s.v_dim)
        return AttnArgs(seq_lens_k=cu[1:] - cu[:-1], max_seqlen_k=max(q_lens), k=k, v=v, **common)
    past = list(case.past_lens) or [0] * len(q_lens)
    lens = [p + n for p, n in zip(past, q_lens)]
    ps = case.page_size
    need = [(n + ps - 1) // ps for n in lens]
    width = max(need)
    num_pages = sum(need) + 3
    perm = torch.randperm(num_pages, generator=g)
    table = torch.zeros((len(lens), width), dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[i:i + n].to(torch.int32)
        i += n
    latent = s.cache.startswith("mla/")
    k_cache = torch.full((num_pages, ps, s.num_kv_heads, s.head_dim), float("nan"), dtype=s.dtype, device=dev)
    v_cache = None if latent else torch.full((num_pages, ps, s.num_kv_heads, s.v_dim), float("nan"),
                                             dtype=s.dtype, device=dev)
    for b, n in enumerate(lens):  # fill exactly the slots each sequence owns; the rest stay NaN
        for t in range(n):
            page, off = int(table[b, t // ps]), t % ps
            k_cache[page, off] = rnd(s.num_kv_heads, s.head_dim)
            if v_cache is not None:
                v_cache[page, off] = rnd(s.num_kv_heads, s.v_dim)
    # the new tokens' keys/values as the layer passes them beside the cache (the rows it just wrote)
    slots = [(int(table[b, t // ps]), t % ps) for b, n in enumerate(lens) for t in range(past[b], n)]
    k_new = torch.stack([k_cache[p, o] for p, o in slots])
    v_new = k_new[..., :s.v_dim] if v_cache is None else torch.stack([v_cache[p, o] for p, o in slots])
    paged_args = {"seq_lens_k": torch.tensor(lens, dtype=torch.int32, device=dev), "max_seqlen_k": max(lens),
                  "page_table": table.to(dev), "k": k_new, "v": v_new}
    if s.cache.endswith("/quant"):
        quantized = _quantized(case, k_cache, v_cache)
        if s.recent:
            quantized["quant"] = quantized["quant"]._replace(
                recent=_recent_rows(case, k_cache, v_cache, table, past, lens, g, dev))
        return AttnArgs(**quantized, **paged_args, **common)
    return AttnArgs(k_cache=k_cache, v_cache=v_cache, **paged_args, **common)


def _quantized(case: Case, k_cache: torch.Tensor, v_cache: torch.Tensor | None) -> dict[str, Any]:
    """The quantized view of float pages (NaN in slots no sequence owns): code words of the pages with those
    slots zeroed, and NaN scales there, so a kernel reading an unowned slot yields NaN."""
    kb, vb = case.bits
    owned = ~torch.isnan(k_cache).flatten(2).any(-1)  # [pages, page_size]

    def quant(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        words, scales = kv_quant.quantize(torch.nan_to_num(x.flatten(2), nan=0.0), bits)
        return words, scales.masked_fill(~owned[..., None], float("nan"))

    if v_cache is None:  # latent: the first head_dim_v channels quantized, the rotary key as it is
        L = case.spec.v_dim
        words, scales = quant(k_cache[..., :L], kb)
        rope = k_cache[:, :, 0, L:].contiguous()
        return {"k_cache": words, "v_cache": None, "quant": QuantPages(scales, None, kb, kb, rope)}
    kw, ks = quant(k_cache, kb)
    vw, vs = quant(v_cache, vb)
    return {"k_cache": kw, "v_cache": vw, "quant": QuantPages(ks, vs, kb, vb)}


def _recent_rows(case: Case, k_cache: torch.Tensor, v_cache: torch.Tensor | None, table: torch.Tensor,
                 past: list[int], lens: list[int], g: torch.Generator, dev: torch.device) -> RecentRows:
    """Recent rows as a store and earlier forwards leave them: each sequence's forward rows in ``rows`` (and, for a
    one-row forward, in its ring), its earlier positions within the window in a ring slot of its own (shuffled),
    one in three of those with a stale tag (a rolled-back draft's position), and the other slots' rows random."""
    assert v_cache is not None
    kb, vb = case.bits
    window = case.spec.recent
    ps = case.page_size
    nseq = len(lens)
    slots = torch.randperm(nseq + 2, generator=g)[:nseq].to(torch.int32)
    sides = []
    for x, bits in ((k_cache, kb), (v_cache, vb)):
        extra = kv_recent.extra_bits(bits)
        if extra == 0:
            sides.append((None, None, None))
            continue
        width = x.shape[2] * x.shape[3] // kv_quant.GROUP * extra
        low = kv_recent.quantize_split(torch.nan_to_num(x.flatten(2).float(), nan=0.0), bits)[1]  # [pages, ps, W]
        ring = torch.randint(-2 ** 31, 2 ** 31 - 1, (nseq + 2, window, width), generator=g, dtype=torch.int32)
        rows = torch.randint(-2 ** 31, 2 ** 31 - 1, (sum(n - p for p, n in zip(past, lens)) + 3, width), generator=g,
                             dtype=torch.int32)
        sides.append((low, ring, rows))
    tags = torch.randint(-1, 4 * window, (nseq + 2, window), generator=g, dtype=torch.int32)
    t = 0
    for b in range(nseq):
        slot = int(slots[b])
        one_row = lens[b] - past[b] == 1
        for j in range(max(0, past[b] - window), lens[b]):
            page, off = int(table[b, j // ps]), j % ps
            fwd = j >= past[b]
            in_ring = not fwd or one_row
            stale = not fwd and (j + b) % 3 == 0
            for low, ring, rows in sides:
                if low is None:
                    continue
                if fwd:
                    rows[t + j - past[b]] = low[page, off]
                if in_ring:
                    ring[slot, j % window] = low[page, off]
            if in_ring:
                tags[slot, j % window] = j + window if stale else j
        t += lens[b] - past[b]
    (_, kr, krows), (_, vr, vrows) = sides
    return RecentRows(*(None if x is None else x.to(dev) for x in (kr, vr)), tags.to(dev),
                      *(None if x is None else x.to(dev) for x in (krows, vrows)), slots.to(dev), window)


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(dtype, 1e-2)


def check_backend(backend: Any, case: Case, device: torch.device | str = "cpu", seed: int = 0) -> float:
    """Run one case; returns the max abs error vs the reference (asserts it is within tolerance)."""
    args = make_args(case, device, seed)
    out = backend.forward(args)
    assert out is not None, f"{backend.name}.forward returned None"
    ref = reference_attention(args)
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    assert torch.isfinite(out).all(), f"{backend.name}: non-finite output for {case.id} (read a poisoned slot?)"
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= tolerance(case.spec.dtype) * max(1.0, scale), f"{backend.name} {case.id}: max err {err:.3g}"
    return err


def focus_recent(args: AttnArgs, beta: float = 2.0) -> AttnArgs:
    """``args`` (a quantized view with recent rows) with each sequence's first query aimed, head by head, at one or two
    keys of its kv head (the newest, the three before it, which include a stale ring row, the window's oldest, the
    first past it, two pairs) so that they hold nearly all its weight: random queries spread it so thin over a long
    sequence that whether the window is read at 8 bits would hide inside the tolerance."""
    spec, quant = args.spec, args.quant
    assert quant is not None
    window = quant.recent.window if quant.recent is not None else spec.recent
    group = spec.num_q_heads // spec.num_kv_heads
    q = args.q.clone()
    cu, lens = args.cu_seqlens_q.tolist(), args.seq_lens_k.tolist()
    for b, n in enumerate(lens):
        if cu[b + 1] == cu[b]:
            continue
        keys = kv_quant.gather_dequantized(args.k_cache, quant.k_scales, quant.k_bits, args.page_table[b], n,
                                           spec.num_kv_heads)
        targets = ((n - 1,), (n - 2,), (n - 3,), (n - 4,), (n - window,), (n - window - 1,), (n - 1, n - 2),
                   (n - 3, n - window))
        for h in range(spec.num_q_heads):
            aim = sum(torch.nn.functional.normalize(keys[min(max(j, 0), n - 1), h // group], dim=0)
                      for j in targets[h % len(targets)])
            q[cu[b], h] = (beta * math.sqrt(spec.head_dim) * torch.nn.functional.normalize(aim, dim=0)).to(q.dtype)
    return args._replace(q=q)
