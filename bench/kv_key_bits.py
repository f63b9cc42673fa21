"""What a 4-bit key cache costs under other key schemes at the same storage, on the default model (CPU, fp32).

The cache under test is simulated: an fp32 cache whose writes store the keys and values as a scheme would
read them back, so every scheme runs through the same engine path as the unquantized reference, and the
figure is the mean KL divergence of the next-token distributions from the unquantized cache's (as
``exl3_core.eval.cache_kld``: 256-token chunks, the first chunk left out). Schemes:

* ``h32``: format spec 6 as the cache stores it (32-value groups, H32 rotation, fp16 max-abs scale);
* ``pairs``: no rotation; each RoPE pair of a KV head gets its own bit width (0..8), chosen once from
  calibration statistics to minimise the query-weighted key error E[(q·Δk)²] (greedy, per head, at
  ``bits + 1/2 - 16/D`` bits per channel, so that with one fp16 scale per token and head it stores as
  many bytes as ``h32``);
  values are scaled by each channel's calibration RMS and quantized on a per-token, per-head max-abs range.

With ``--window W`` (several allowed): ``windowW`` reads the last W positions before each query unquantized, as a
per-sequence fp16 ring of the newest keys and values beside the quantized pages would (KIVI's residual), at
K{bits}V{bits}, K{bits}V{bits-1} and K{bits-1}V{bits-1} with H32, and with the per-pair keys; the ring costs
W tokens of fp16 per sequence, not per token. ``--window-page P`` stops each window at the start of the query's
page of P tokens (a query then needs exact rows of its own page only, which a forked sequence never shares);
``--window-bits B`` stores the window's rows as format spec 6 does at B bits. At 4096 positions, K4V4 H32:
``--window 32`` 0.0072; ``--window 32 --window-page 256 --window-bits 8`` 0.0080 (W = 64: 0.0062); ``--window 16``
0.0110 and ``--window 8`` 0.0178 (with the per-pair keys 0.0046 and 0.0064). Kept beside the 4-bit rows, a window
costs capacity: per 4096-token sequence K4V4 holds 3.56x / (1 + W x row bytes / (4096 x 36)) of fp16's tokens,
3.46x for fp16 rows at W = 32, 3.51x at W = 16, 3.50x for 8-bit rows at W = 32. A window that is the query's own
aligned block of P positions (``--window P --window-page P``: the rows of a sequence's last block kept exact, the
block quantized when the sequence leaves it): K4V4 0.0093 at P = 64 and 0.0067 at P = 128 (K4V3 0.0130 / 0.0099,
K3V3 0.0395 / 0.0292).

With ``--channel G`` (several allowed): ``chanG`` quantizes keys per channel over each block of G positions (as
KIVI does): a symmetric max-abs grid with one fp16 scale per block and channel (H32's bytes at G = 32); ``asym`` an
fp16 minimum and range instead (half a bit more per value); ``kmean`` the calibration's channel means subtracted
first. The query's own block is read unquantized (its rows are not all written yet); ``h32 own blockG`` is H32 with
the same exact block. At 4096 positions, K4V4: chan32 0.0649, asym 0.0171, kmean 0.0351, h32 own block32 0.0155;
chan64 0.0582, asym 0.0168, kmean 0.0296, h32 own block64 0.0093. Per channel the keys' offsets bind (an asymmetric
range pays half a bit to fix them), and H32 with the same exact block stays ahead. With the own block of 64 stored
at 8 bits instead (``--window 64 --window-page 64 --window-bits 8``): K4V4 0.0095, K4V3 0.0130, K3V3 0.0408, the
per-pair keys 0.0042; a 4096-token sequence then holds 63 pages at K4V4 and one at K8V8, 3.51x the tokens of fp16
in the same bytes.

With ``--smooth``: ``ksmooth`` divides each key channel by sigma = (E[k^2] / E[q^2])^(1/4) (pair means) before
H32 and the reader would multiply the query by it (the scores are unchanged; the sigma that minimises
E[(q·Δk)^2] when the rotated error is even across a group); ``kvsmooth`` also values, by (E[v^2] / |o_proj
column|^2)^(1/4), the output multiplied back; ``kmean`` subtracts each key channel's calibration mean (free in
the softmax). At 4096 positions: K4V4 ksmooth 0.0499, kvsmooth 0.0530, kmean 0.0453 against h32's 0.0533 and
the per-pair widths' 0.0179: the rotated group's range, not the channels' scale, is what binds.

With ``--head-rotation``: ``hhead`` rotates each key head by the normalised Hadamard matrix of the whole head
dim before the H32 groups (and back after), spreading a head's outlier channels over all its groups. At 1024
positions: K4V16 0.113 against H32's 0.042 (K4V4 0.114 against 0.049): spread over the whole head, the outlier
pairs widen every group's range.

With ``--permute``: ``perm`` stores each key head with its RoPE pairs reordered by query-weighted calibration energy
(the hottest 16 pairs in the first group of 32, and so on; the reader would permute the query the same way), ``perm
H/C`` gives the hot group H bits and the cold one C. At 1024 positions: K4V4 perm 0.077 (kmean on top 0.059), perm
5/3 0.031, perm 6/2 0.035, against H32's 0.047 and the per-pair widths' 0.016: gathering the hot pairs widens the
range of the group the queries weight most, and group-sized widths are too coarse to make up for it.

With ``--per-layer``: ``k{bits} layerL`` quantizes the keys of layer L alone (H32; values and other layers exact).
At 1024 positions, K4: layer 10 0.0082, every other layer 0.0001-0.0022 (sum over the 30 layers 0.036, K4V4 in
every layer 0.047): the keys' error is spread over the layers, so widths per layer cannot reach 0.01 at K4V4's
bytes (8-bit keys in layer 10 alone would leave about 0.039).

With ``--more``: ``sinkN`` keeps the first N tokens unquantized; ``vwo`` gives values per-channel bit widths
the same way, weighted by E[v^2] times the squared norms of the o_proj columns each channel feeds (``vrms``: by
E[v^2] alone); ``k16`` leaves keys unquantized.

A pair's energy is the same at every position (RoPE rotates within the pair), so the allocation holds
across positions. Calibration: the first 1024 tokens of the built-in calibration text; evaluation: the
held-out text, as ``tests/e2e/test_kv_quant_quality.py``.

    python bench/kv_key_bits.py [--positions 4096] [--bits 4] [--more] [--permute] [--window 32 ...] [--channel 32 ...]
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "core"))

from smol_gguf import imported_model

import exl3_core.builtins.attn_torch_impl as torch_backend
import exl3_core.nn.rope as rope_mod
import exl3_core.reference.kv_quant as ref
from exl3_core import Config, Model, Tokenizer
from exl3_core.archkit.batch import BatchMeta
from exl3_core.attention.spec import AttnArgs
from exl3_core.cache import Cache
from exl3_core.cache.kv import KVCacheLayer
from exl3_core.convert.calibration import builtin_text
from exl3_core.eval.kld import kl_per_token
from exl3_core.plan import ExecutionPlan
from exl3_core.reference.attention import attention as reference_attention
from exl3_core.reference.attention import gather_paged

Scheme = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Tap:
    """Records each layer's rotated q and k, and rewrites k and v on their way into the cache; with a window, keeps
    each layer's unquantized k and v (``shadow``) for the reference attention to read the last positions from."""

    def __init__(self) -> None:
        self.scheme: Scheme | None = None
        self.record: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] | None = None  # q, k, v
        self.layer_of: dict[int, int] = {}
        self.last_q: torch.Tensor | None = None
        self.start = 0  # the running chunk's first position
        self.window = 0
        self.page = 0  # > 0: a window does not reach into an earlier page of this many tokens
        self.shadow_bits = 16  # < 16: the window's rows as format spec 6 stores them at this width
        self.keys_only = False  # the window holds keys only; values read from the cache
        self.shadow: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # layer -> k, v [positions, H, D]
        self.layer = 0  # the layer whose cache was written last (its attention follows)
        rope_cls = next(c for c in vars(rope_mod).values() if isinstance(c, type) and "rotate_qk" in vars(c))
        rotate, write = rope_cls.rotate_qk, KVCacheLayer.write
        tap = self

        def rotate_qk(self, q, k, cos, sin):  # type: ignore[no-untyped-def]
            q, k = rotate(self, q, k, cos, sin)
            tap.last_q = q
            return q, k

        def store(self, k, v, slot_mapping, **kw):  # type: ignore[no-untyped-def]
            i = tap.layer_of.setdefault(id(self), len(tap.layer_of))
            tap.layer = i
            if tap.shadow is not None:
                n = tap.start + k.shape[0]
                ks, vs = tap.shadow.get(i, (k.new_zeros((0, *k.shape[1:])).float(), v.new_zeros((0, *v.shape[1:])).float()))
                ke, ve = k.float(), v.float()
                if tap.shadow_bits < 16:
                    ke, ve = h32(ke, tap.shadow_bits), h32(ve, tap.shadow_bits)
                tap.shadow[i] = (torch.cat([ks[:tap.start], ke])[:n], torch.cat([vs[:tap.start], ve])[:n])
            if tap.record is not None and tap.last_q is not None:
                tap.record.setdefault(i, []).append((tap.last_q.detach().float().clone(), k.detach().float().clone(),
                                                     v.detach().float().clone()))
            if tap.scheme is not None:
                k2, v2 = tap.scheme(i, k, v)
                k, v = k2.to(k.dtype), v2.to(v.dtype)
            write(self, k, v, slot_mapping)

        rope_cls.rotate_qk, KVCacheLayer.write = rotate_qk, store
        torch_backend.attention = self.attention  # type: ignore[assignment]

    def attention(self, args: AttnArgs) -> torch.Tensor:
        """The reference attention; with a window, keys and values within ``window`` positions before each query
        read from ``shadow`` (unquantized), the rest from the cache (one sequence per call)."""
        if self.shadow is None or self.window <= 0 or args.page_table is None or args.k_cache is None:
            return reference_attention(args)
        assert args.v_cache is not None and args.seq_lens_k.numel() == 1
        nk, q = int(args.seq_lens_k[0]), args.q.float()
        nq = q.shape[0]
        group = args.spec.num_q_heads // args.spec.num_kv_heads
        kc, vc = (gather_paged(t, args.page_table[0], nk).float().repeat_interleave(group, 1)
                  for t in (args.k_cache, args.v_cache))
        ke, ve = (t[:nk].repeat_interleave(group, 1) for t in self.shadow[self.layer])
        if self.keys_only:
            ve = vc
        qpos = torch.arange(nk - nq, nk)[:, None]
        kpos = torch.arange(nk)[None, :]
        win = kpos > qpos - self.window
        if self.page > 0:
            win &= kpos // self.page == qpos // self.page
        win = win[None]
        s = torch.where(win, torch.einsum("qhd,khd->hqk", q, ke), torch.einsum("qhd,khd->hqk", q, kc)) * args.scale
        p = torch.softmax(s.masked_fill((kpos > qpos)[None], float("-inf")), -1)
        out = torch.einsum("hqk,khd->qhd", p * win, ve) + torch.einsum("hqk,khd->qhd", p * ~win, vc)
        return out.to(args.q.dtype)


def run(model: Model, plan: ExecutionPlan, tap: Tap, ids: torch.Tensor, schemes: dict[str, Scheme | None],
        chunk: int = 256, windows: dict[str, int] | None = None,
        pages: dict[str, int] | None = None) -> dict[str, tuple[float, float]]:
    """Mean KL and top-1 agreement of each scheme against the first (None: unquantized); ``windows``: scheme ->
    positions read unquantized before each query; ``pages``: scheme -> the page its window stops at (else
    ``tap.page``)."""
    windows, pages = windows or {}, pages or {}
    default_page = tap.page
    shadows: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {name: {} for name in windows}
    n = ids.shape[0]
    names = list(schemes)
    caches = [Cache(model, n) for _ in names]
    ps = caches[0].page_size
    tables = [torch.tensor([c.allocator.allocate(-(-n // ps))], dtype=torch.int32) for c in caches]
    kl = dict.fromkeys(names, 0.0)
    agree = dict.fromkeys(names, 0)
    counted = 0
    for start in range(0, n, chunk):
        toks = ids[start:start + chunk].tolist()
        rows = torch.arange(len(toks))
        out = {}
        tap.start = start
        for name, cache, table in zip(names, caches, tables, strict=True):
            tap.scheme, tap.layer_of = schemes[name], {}
            tap.window, tap.shadow, tap.page = windows.get(name, 0), shadows.get(name), pages.get(name, default_page)
            meta = BatchMeta.from_lists([toks], [start], device=model.device, page_table=table, page_size=ps,
                                        logits_indices=rows)
            out[name] = plan.forward(meta, cache).float()
        tap.scheme, tap.window, tap.shadow, tap.page = None, 0, None, default_page
        if start == 0:
            continue
        ref_logits = out[names[0]]
        for name in names[1:]:
            kl[name] += float(kl_per_token(ref_logits, out[name]).sum())
            agree[name] += int((ref_logits.argmax(-1) == out[name].argmax(-1)).sum())
        counted += len(toks)
    return {name: (kl[name] / counted, agree[name] / counted) for name in names[1:]}


def h32(x: torch.Tensor, bits: int) -> torch.Tensor:
    w, s = ref.quantize(x.reshape(x.shape[0], -1), bits)
    return ref.dequantize(w, s, bits).reshape(x.shape)


def pair_bits(weight: torch.Tensor, bits_per_channel: float) -> torch.Tensor:
    """Greedy bit widths ``[H, P]`` per RoPE pair minimising Σ weight·4^-b with Σ b = bits_per_channel · P."""
    b = torch.zeros(weight.shape, dtype=torch.long)
    for h in range(weight.shape[0]):
        for _ in range(round(bits_per_channel * weight.shape[1])):
            gain = weight[h] * 4.0 ** (-b[h].float()) * (b[h] < 8)
            b[h, int(gain.argmax())] += 1
    return b


def sink(tap: Tap, scheme: Scheme, n: int) -> Scheme:
    """``scheme`` with the first ``n`` positions of the text kept unquantized."""
    def run(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k2, v2 = scheme(i, k, v)
        if tap.start == 0:
            k2, v2 = k2.clone(), v2.clone()
            k2[:n], v2[:n] = k[:n], v[:n]
        return k2, v2
    return run


def channel_quant(x: torch.Tensor, bits: int, group: int, asym: bool = False) -> torch.Tensor:
    """``x [T, H, D]`` (T a multiple of ``group``, its first position one too) quantized per channel over each block
    of ``group`` positions: a symmetric max-abs midpoint grid with one fp16 scale (format spec 6's bytes when group
    is 32), or with ``asym`` an fp16 minimum and range (half a bit more per value)."""
    t, h, d = x.shape
    z = x.float().view(t // group, group, h, d)
    m = float(1 << (bits - 1))
    if asym:
        lo = z.amin(1, keepdim=True).half().float()
        rng = (z.amax(1, keepdim=True) - lo).half().float() + 1e-10
        code = torch.floor((z - lo) / rng * (2 * m)).clamp(0, 2 * m - 1)
        return ((code + 0.5) / (2 * m) * rng + lo).view(t, h, d)
    s = (z.abs().amax(1, keepdim=True) + 1e-10).half().float()
    code = torch.floor(z / s * m + m).clamp(0, 2 * m - 1)
    return ((code - m + 0.5) * s / m).view(t, h, d)


def pairs_quant(k: torch.Tensor, bits: torch.Tensor, rms: torch.Tensor) -> torch.Tensor:
    """``k [T, H, D]`` (half-split RoPE pairs c, c + D/2) at per-channel ``bits [H, D]``, scaled by ``rms``."""
    z = k.float() / rms
    s = z.abs().amax(-1, keepdim=True).to(torch.float16).float()  # the stored per-token, per-head scale
    levels = 2.0 ** bits.float()
    step = 2 * s / levels
    code = torch.minimum(torch.floor((z + s) / step).clamp_min(0), levels - 1)
    deq = ((code + 0.5) * step - s) * rms
    return torch.where(bits > 0, deq, torch.zeros_like(deq))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=4096)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--more", action="store_true", help="also the sink and value-allocation schemes")
    ap.add_argument("--smooth", action="store_true", help="also the channel-smoothed H32 schemes")
    ap.add_argument("--per-layer", action="store_true", help="also the keys of one layer at a time quantized")
    ap.add_argument("--head-rotation", action="store_true",
                    help="also keys rotated by a Hadamard over the whole head before H32")
    ap.add_argument("--permute", action="store_true",
                    help="also keys with their RoPE pairs reordered by calibration energy before the H32 groups")
    ap.add_argument("--window", type=int, action="append", default=[],
                    help="also read the last W positions unquantized (repeatable)")
    ap.add_argument("--window-page", type=int, default=0,
                    help="windows stop at the start of the query's page of this many tokens (0: they do not)")
    ap.add_argument("--channel", type=int, action="append", default=[],
                    help="also keys quantized per channel over blocks of this many positions, the query's own block "
                         "read unquantized (repeatable)")
    ap.add_argument("--window-keys-only", action="store_true",
                    help="windows hold keys only (values read from the quantized cache)")
    ap.add_argument("--window-bits", type=int, default=16,
                    help="the window's rows stored at this width (format spec 6) instead of unquantized")
    a = ap.parse_args()
    cfg = Config.from_directory(imported_model())
    model = Model.from_config(cfg)
    model.load("cpu", dtype=torch.float32)
    tok = Tokenizer.from_config(cfg)
    plan = ExecutionPlan(model)
    tap = Tap()
    tap.page, tap.shadow_bits, tap.keys_only = a.window_page, a.window_bits, a.window_keys_only

    tap.record = {}
    run(model, plan, tap, tok.encode(builtin_text("calibration"))[0][:1024], {"ref": None, "same": None})
    record, tap.record = tap.record, None
    alloc: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    v_wo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    v_rms: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    k_smooth: dict[int, torch.Tensor] = {}
    v_smooth: dict[int, torch.Tensor] = {}
    k_mean: dict[int, torch.Tensor] = {}
    k_perm: dict[int, torch.Tensor] = {}  # [hk, d]: the channel stored at each place, hottest pairs first
    for i, rows in record.items():
        rows = rows[: len(rows) // 2]  # the reference cache's writes (the second cache repeats them)
        q = torch.cat([r[0] for r in rows])
        k = torch.cat([r[1] for r in rows])
        hk, d = k.shape[1], k.shape[2]
        ek = k.pow(2).mean(0)
        eq = q.view(q.shape[0], hk, -1, d).pow(2).mean((0, 2))
        ekp, eqp = (ek[:, : d // 2] + ek[:, d // 2:]) / 2, (eq[:, : d // 2] + eq[:, d // 2:]) / 2
        per = a.bits + 16 / ref.GROUP - 16 / d  # h32's bytes: one fp16 scale per head
        b = pair_bits(ekp * eqp, per)
        alloc[i] = (torch.cat([b, b], -1), torch.cat([ekp, ekp], -1).sqrt())
        ev = torch.cat([r[2] for r in rows]).pow(2).mean(0)  # [hk, d]
        wo = model.layers[i].attn.o_proj.weight.float()  # [out, heads * d]
        wn = wo.pow(2).sum(0).view(hk, -1, d).sum(1)  # per kv channel, over the query heads it serves
        v_wo[i] = (pair_bits(ev * wn, per), ev.sqrt())
        v_rms[i] = (pair_bits(ev, per), ev.sqrt())
        k_smooth[i] = torch.cat([ekp / eqp, ekp / eqp], -1).clamp_min(1e-12) ** 0.25
        k_mean[i] = k.mean(0)
        order = (ekp * eqp).argsort(-1, descending=True)  # [hk, d/2] pairs by query-weighted energy
        per_group = ref.GROUP // 2  # pairs a group of 32 channels holds
        k_perm[i] = torch.stack([torch.cat([torch.cat([o[j:j + per_group], o[j:j + per_group] + d // 2])
                                            for j in range(0, d // 2, per_group)]) for o in order])
        v_smooth[i] = (ev / wn.clamp_min(1e-12)).clamp_min(1e-12) ** 0.25

    bits = a.bits
    pairs: Scheme = lambda i, k, v: (pairs_quant(k, *alloc[i]), h32(v, bits))
    schemes: dict[str, Scheme | None] = {
        "fp32": None,
        f"k{bits}v16 h32": lambda i, k, v: (h32(k, bits), v),
        f"k{bits}v16 pairs": lambda i, k, v: (pairs_quant(k, *alloc[i]), v),
        f"k{bits}v{bits} h32": lambda i, k, v: (h32(k, bits), h32(v, bits)),
        f"k{bits}v{bits} pairs+h32": pairs,
    }
    if a.more:
        schemes.update({f"k{bits}v{bits} pairs+h32 sink{n}": sink(tap, pairs, n) for n in (1, 4, 16)})
        schemes[f"k{bits}v{bits} h32 sink4"] = sink(tap, lambda i, k, v: (h32(k, bits), h32(v, bits)), 4)
        schemes[f"k{bits}v{bits} pairs+vwo"] = lambda i, k, v: (pairs_quant(k, *alloc[i]), pairs_quant(v, *v_wo[i]))
        schemes[f"k{bits}v{bits} pairs+vrms"] = lambda i, k, v: (pairs_quant(k, *alloc[i]), pairs_quant(v, *v_rms[i]))
        schemes[f"k16v{bits} vwo"] = lambda i, k, v: (k, pairs_quant(v, *v_wo[i]))
        schemes[f"k16v{bits} h32"] = lambda i, k, v: (k, h32(v, bits))
    if a.smooth:
        def smoothed(x: torch.Tensor, sigma: torch.Tensor, b: int) -> torch.Tensor:
            return h32(x.float() / sigma, b) * sigma
        schemes[f"k{bits}v16 h32 ksmooth"] = lambda i, k, v: (smoothed(k, k_smooth[i], bits), v)
        schemes[f"k{bits}v{bits} h32 ksmooth"] = lambda i, k, v: (smoothed(k, k_smooth[i], bits), h32(v, bits))
        schemes[f"k{bits}v{bits} h32 kvsmooth"] = lambda i, k, v: (smoothed(k, k_smooth[i], bits),
                                                                     smoothed(v, v_smooth[i], bits))
        schemes[f"k{bits}v{bits - 1} h32 kvsmooth"] = lambda i, k, v: (smoothed(k, k_smooth[i], bits),
                                                                         smoothed(v, v_smooth[i], bits - 1))
        schemes[f"k{bits}v{bits} h32 kmean"] = lambda i, k, v: (h32(k.float() - k_mean[i], bits) + k_mean[i],
                                                                  h32(v, bits))
    if a.permute:
        def permuted_split(x: torch.Tensor, perm: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor:
            # the head's groups of 32 (hottest first) at their own widths
            idx = perm[None].expand(x.shape[0], -1, -1)
            y = torch.gather(x.float(), 2, idx)
            parts = [h32(y[..., 32 * j:32 * (j + 1)].contiguous(), w) for j, w in enumerate(widths)]
            return torch.empty_like(y).scatter_(2, idx, torch.cat(parts, -1))

        def permuted(x: torch.Tensor, perm: torch.Tensor, b: int) -> torch.Tensor:
            return permuted_split(x, perm, (b,) * (x.shape[-1] // 32))
        for hot in (bits + 1, bits + 2):
            widths = (hot, 2 * bits - hot)
            schemes[f"k{bits}v{bits} perm {hot}/{2 * bits - hot}"] = lambda i, k, v, widths=widths: (
                permuted_split(k, k_perm[i], widths), h32(v, bits))
        schemes[f"k{bits}v16 perm"] = lambda i, k, v: (permuted(k, k_perm[i], bits), v)
        schemes[f"k{bits}v{bits} perm"] = lambda i, k, v: (permuted(k, k_perm[i], bits), h32(v, bits))
        schemes[f"k{bits}v{bits} perm kmean"] = lambda i, k, v: (
            permuted(k.float() - k_mean[i], k_perm[i], bits) + k_mean[i], h32(v, bits))
    if a.head_rotation:
        def head_rotated(x: torch.Tensor, b: int) -> torch.Tensor:
            d = x.shape[-1]
            hd = torch.ones(1, 1)
            while hd.shape[0] < d:  # Sylvester: H_2n = [[H, H], [H, -H]]
                hd = torch.cat([torch.cat([hd, hd], 1), torch.cat([hd, -hd], 1)], 0)
            hd = hd / d ** 0.5
            return h32(x.float() @ hd, b) @ hd.T
        schemes[f"k{bits}v16 hhead"] = lambda i, k, v: (head_rotated(k, bits), v)
        schemes[f"k{bits}v{bits} hhead+h32"] = lambda i, k, v: (head_rotated(k, bits), h32(v, bits))
    if a.per_layer:
        for layer in range(len(model.layers)):
            schemes[f"k{bits} layer{layer}"] = lambda i, k, v, layer=layer: (h32(k, bits) if i == layer else k, v)
    windows: dict[str, int] = {}
    for w in a.window:
        tag = f"window{w}" + (f" page{a.window_page}" if a.window_page else "") + \
            (f" {a.window_bits}bit" if a.window_bits < 16 else "") + (" keys" if a.window_keys_only else "")
        for kb, vb in ((bits, bits), (bits, bits - 1), (bits - 1, bits - 1)):
            name = f"k{kb}v{vb} h32 {tag}"
            schemes[name] = lambda i, k, v, kb=kb, vb=vb: (h32(k, kb), h32(v, vb))
            windows[name] = w
        schemes[f"k{bits}v{bits} pairs+h32 {tag}"] = pairs
        windows[f"k{bits}v{bits} pairs+h32 {tag}"] = w
    pages: dict[str, int] = {}
    for g in a.channel:
        for kb, vb in ((bits, bits), (bits, bits - 1)):
            for asym in (False, True):
                name = f"k{kb}v{vb} chan{g}{' asym' if asym else ''} own block"
                schemes[name] = lambda i, k, v, kb=kb, vb=vb, g=g, asym=asym: (channel_quant(k, kb, g, asym),
                                                                               h32(v, vb))
                windows[name], pages[name] = g, g
        name = f"k{bits}v{bits} chan{g} kmean own block"  # the calibration's channel means out: no bytes
        schemes[name] = lambda i, k, v, g=g: (channel_quant(k.float() - k_mean[i], bits, g) + k_mean[i], h32(v, bits))
        windows[name], pages[name] = g, g
        name = f"k{bits}v{bits} h32 own block{g}"
        schemes[name] = lambda i, k, v: (h32(k, bits), h32(v, bits))
        windows[name], pages[name] = g, g
    ids = tok.encode(builtin_text("eval"))[0][: a.positions + 256]
    for name, (kl, top1) in run(model, plan, tap, ids, schemes, windows=windows, pages=pages).items():
        print(f"{name:<20} KL {kl:.5f}  top-1 {top1:.4f}  ({a.positions} positions)")


if __name__ == "__main__":
    main()
