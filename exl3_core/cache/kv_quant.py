"""Quantized paged cache layers (variant ``"quant"``, format spec 6): 2-8 bit keys and values, each side
its own width, read in place by the attention kernels.

Per token, keys (after RoPE) and values are flattened over the layer's KV heads and stored in groups
of 32 channels: ``bits`` int32 code words and an fp16 scale per group (:mod:`exl3_core.reference.kv_quant`).
``Cache(model, n, variant="quant", k_bits=4, v_bits=4)`` builds them; the latent (MLA) kind quantizes the
latent and keeps the rotary key in the model's dtype.

Recent rows (:mod:`exl3_core.reference.kv_recent`): a side of fewer than 8 bits keeps the low bits of each
sequence's newest ``recent`` positions (default 64) in a ring per sequence, so attention reads them at 8 bits;
``recent=0`` turns it off, ``recent_seqs`` (default 256) bounds the sequences that keep them at once. A forward
keeps them only when its batch names ring slots (:attr:`~exl3_core.archkit.batch.BatchMeta.ring_slots`, which
the generator assigns); other forwards read and write the pages alone.

Stores: on CUDA one Triton launch per step quantizes the step's rows straight into their slots
(RoPE included through :meth:`~KVQuantLayer.write_rotated`), with no fp16 copy of any page; elsewhere the
torch reference. Attention reads the view ``"kv/quant"`` (``"mla/quant"``): the code words as
``k_cache``/``v_cache`` and :class:`~exl3_core.attention.spec.QuantPages` beside them; a backend that
cannot read it declines, and :func:`exl3_core.cache.readable.check_readable` reports that before anything
is allocated.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from exl3_core import ops
from exl3_core.attention.spec import QuantPages, RecentRows
from exl3_core.cache.layer import CacheLayer, CacheStep
from exl3_core.reference import kv_quant as ref
from exl3_core.reference import kv_recent
from exl3_core.reference.kv_recent import RecentWrite

if TYPE_CHECKING:
    from types import ModuleType


Impl = Literal["auto", "triton", "torch"]
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def _kernels() -> ModuleType:
    from exl3_core.kernels import kv_quant

    return kv_quant


def _triton(impl: Impl, t: torch.Tensor) -> bool:
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl={impl!r}; expected 'auto', 'triton' or 'torch'")
    return impl == "triton" or (impl == "auto" and ops.fused_enabled(t))


def _check_dims(cls: str, head_dim: int, head_dim_v: int | None, quantized: str) -> None:
    dims = {"head_dim": head_dim} if head_dim_v is None else {"head_dim": head_dim, "head_dim_v": head_dim_v}
    bad = {n: d for n, d in dims.items() if d % ref.GROUP}
    if bad:
        raise ValueError(f"cache variant 'quant' ({cls}): the model's {quantized} width {bad} is not a multiple of "
                         f"{ref.GROUP}, the quantization group; use the 'fp16' cache variant (no --cache-bits) for "
                         f"this model")


#: the sequences whose recent rows a quantized cache keeps at once, by default
RECENT_SEQS = 256


def _bits(cls: str, options: dict[str, object], latent: bool) -> tuple[int, int]:
    """``(k_bits, v_bits)`` of a quantized layer's options (default 4 each), checked; a latent cache has one width."""
    unknown = sorted(set(options) - ({"k_bits", "v_bits"} if latent else {"k_bits", "v_bits", "recent", "recent_seqs"}))
    if unknown:
        hint = " (a latent cache keeps no recent rows: leave --cache-recent out)" if latent and "recent" in unknown else ""
        raise ValueError(f"cache variant 'quant' ({cls}) takes k_bits and v_bits{'' if latent else ', recent and recent_seqs'}"
                         f", not {unknown}{hint}")
    k = ref.check_bits("k_bits", options.get("k_bits", 4))
    if latent:
        v = options.get("v_bits")
        if v is not None and v != k:
            raise ValueError(f"k_bits={k}, v_bits={v}: a latent (MLA) cache stores one latent for keys and values, so "
                             f"it has one bit width; give the same value for both (--cache-bits {k})")
        return k, k
    return k, ref.check_bits("v_bits", options.get("v_bits", 4))


def _recent(cls: str, options: dict[str, object]) -> tuple[int, int]:
    """``(window, ring slots)`` of a quantized layer's options: the window 0 when both sides are 8-bit (nothing to
    refine) or ``recent=0``."""
    k, v = _bits(cls, options, latent=False)
    window = options.get("recent", kv_recent.WINDOW)
    seqs = options.get("recent_seqs", RECENT_SEQS)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0 or window & (window - 1):
        raise ValueError(f"recent={window!r}: the recent rows kept per sequence must be 0 (none) or a power of two, "
                         f"e.g. {kv_recent.WINDOW}")
    if isinstance(seqs, bool) or not isinstance(seqs, int) or seqs < 1:
        raise ValueError(f"recent_seqs={seqs!r}: the sequences keeping recent rows at once must be a positive int "
                         f"(at least the generator's max_batch_size)")
    return (0 if min(k, v) == 8 else window), seqs


def _read_rows(codes: torch.Tensor, scales: torch.Tensor, bits: int, slot_mapping: torch.Tensor,
               like: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    """The tokens at ``slot_mapping`` dequantized, shaped and typed as ``like``: one launch on CUDA."""
    if _triton(impl, like):  # ``like`` gives only the shape and dtype: a strided q/k/v split serves too
        return _kernels().read_rows(codes, scales, bits, slot_mapping, like)
    idx = slot_mapping.long()
    w = codes.view(-1, codes.shape[-1]).index_select(0, idx)
    s = scales.view(-1, scales.shape[-1]).index_select(0, idx)
    return ref.dequantize(w, s, bits).view(like.shape).to(like.dtype)


def _ring_slots(seqs: int, num_pages: int) -> int:
    """Ring slots of a layer: slot 0 the scratch slot padded batch rows write, then one per sequence that can hold a
    page at once (at most ``seqs``)."""
    return min(seqs, num_pages) + 1


class KVQuantLayer(CacheLayer):
    """Keys and values as code words ``[pages, page_size, Hkv * D / 32 * bits]`` (int32) and scales
    ``[pages, page_size, Hkv * D / 32]`` (fp16), per side. Options ``k_bits``, ``v_bits`` (2..8, default 4)."""

    kind: ClassVar[str] = "kv"
    variant: ClassVar[str] = "quant"

    def __init__(self, *, k_bits: int = 4, v_bits: int = 4, recent: int = kv_recent.WINDOW,
                 recent_seqs: int = RECENT_SEQS, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        opts = {"k_bits": k_bits, "v_bits": v_bits, "recent": recent, "recent_seqs": recent_seqs}
        self.check_options(self.num_kv_heads, self.head_dim, self.head_dim_v, **opts)
        self.k_bits, self.v_bits = k_bits, v_bits
        if self.dtype not in _FLOAT:
            raise ValueError(f"KVQuantLayer: dtype {self.dtype} is not a float dtype (use fp16, bf16 or fp32)")
        ngk = self.num_kv_heads * self.head_dim // ref.GROUP
        ngv = self.num_kv_heads * self.head_dim_v // ref.GROUP
        pages = (self.num_pages, self.page_size)
        self.k_codes = torch.zeros((*pages, ngk * k_bits), dtype=torch.int32, device=self.device)
        self.k_scales = torch.zeros((*pages, ngk), dtype=torch.float16, device=self.device)
        self.v_codes = torch.zeros((*pages, ngv * v_bits), dtype=torch.int32, device=self.device)
        self.v_scales = torch.zeros((*pages, ngv), dtype=torch.float16, device=self.device)
        self.window, seqs = _recent(type(self).__name__, opts)
        #: ring slots (the last one the scratch slot padded batch rows write to)
        self.ring_slots = _ring_slots(seqs, self.num_pages) if self.window else 0
        self.k_extra = kv_recent.extra_bits(k_bits) if self.window else 0
        self.v_extra = kv_recent.extra_bits(v_bits) if self.window else 0
        ring = (self.ring_slots, self.window)
        self.k_ring = torch.zeros((*ring, ngk * self.k_extra), dtype=torch.int32, device=self.device) \
            if self.k_extra else None
        self.v_ring = torch.zeros((*ring, ngv * self.v_extra), dtype=torch.int32, device=self.device) \
            if self.v_extra else None
        self.tags = torch.full(ring, -1, dtype=torch.int32, device=self.device)
        # the forward's rows' low bits; grown on demand, earlier buffers kept (a captured graph may hold them)
        self._rows: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
        self._step: CacheStep | None = None

    def _rows_for(self, n: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Row buffers of at least ``n`` rows."""
        if not self._rows or (self._rows[-1][0] if self.k_extra else self._rows[-1][1]).shape[0] < n:  # type: ignore[union-attr]
            size = max(64, 1 << (n - 1).bit_length())
            self._rows.append(tuple(  # type: ignore[arg-type]
                torch.zeros((size, self.num_kv_heads * d // ref.GROUP * extra), dtype=torch.int32, device=self.device)
                if extra else None for d, extra in ((self.head_dim, self.k_extra), (self.head_dim_v, self.v_extra))))
        return self._rows[-1]

    def bind_step(self, step: CacheStep | None) -> None:
        self._step = step if self.window and step is not None and step.ring_slots is not None else None

    def clear_ring(self, slot: int) -> None:
        # a reused prefix's positions are never written by the new sequence: the earlier one's rows must not match
        if self.window:
            self.tags[slot].fill_(-1)

    def uniform_reads(self) -> bool:
        return self._step is None  # with recent rows each query reads its own window at 8 bits

    def _recent_write(self, n: int) -> RecentWrite | None:
        step = self._step
        if step is None:
            return None
        k_rows, v_rows = self._rows_for(n)
        direct = step.rows_per_seq == 1  # one row per sequence: token t is sequence t, the ring written at once
        return RecentWrite(k_rows, v_rows, self.k_ring, self.v_ring, self.tags, step.positions if direct else None,
                           step.ring_slots if direct else None)

    def _recent_rows(self) -> RecentRows | None:
        return None if self._step is None else self._recent_rows_of(self._step)

    def _recent_rows_of(self, step: CacheStep) -> RecentRows:
        assert step.ring_slots is not None
        k_rows, v_rows = self._rows_for(step.positions.shape[0])
        return RecentRows(self.k_ring, self.v_ring, self.tags, k_rows, v_rows, step.ring_slots, self.window)

    def after_attention(self) -> None:
        step = self._step
        self._step = None  # unbound: a later write without a step of its own keeps no recent rows
        if step is None or step.rows_per_seq == 1:  # a one-row step's store wrote the ring
            return
        recent = self._recent_rows_of(step)
        assert recent is not None
        if _triton("auto", self.k_codes):
            _kernels().ring_update(recent, step.positions, step.cu_seqlens_q, step.seq_lens_k)
        else:
            kv_recent.ring_update(recent, step.positions, step.cu_seqlens_q, step.seq_lens_k)

    @classmethod
    def check_options(cls, num_kv_heads: int, head_dim: int, head_dim_v: int | None, **layer_kwargs: object) -> None:
        _recent(cls.__name__, layer_kwargs)
        _check_dims(cls.__name__, head_dim, head_dim_v, "key/value head")

    @classmethod
    def ring_slots(cls, num_pages: int, **layer_kwargs: object) -> int:
        window, seqs = _recent(cls.__name__, layer_kwargs)
        return _ring_slots(seqs, num_pages) if window else 0

    @classmethod
    def fixed_bytes(cls, num_kv_heads: int, head_dim: int, head_dim_v: int | None, dtype: torch.dtype,
                    num_pages: int, **layer_kwargs: object) -> int:
        """The recent rows' rings and tags (the forward's row buffers, a chunk's worth, are not counted)."""
        window, seqs = _recent(cls.__name__, layer_kwargs)
        if not window:
            return 0
        k_bits, v_bits = _bits(cls.__name__, layer_kwargs, latent=False)
        dv = head_dim if head_dim_v is None else head_dim_v
        low = (num_kv_heads * head_dim // ref.GROUP * kv_recent.extra_bits(k_bits)
               + num_kv_heads * dv // ref.GROUP * kv_recent.extra_bits(v_bits))
        return _ring_slots(seqs, num_pages) * window * (low + 1) * 4

    @classmethod
    def bytes_per_token(cls, num_kv_heads: int, head_dim: int, head_dim_v: int | None, dtype: torch.dtype,
                        **layer_kwargs: object) -> int:
        cls.check_options(num_kv_heads, head_dim, head_dim_v, **layer_kwargs)
        k_bits, v_bits = _bits(cls.__name__, layer_kwargs, latent=False)
        dv = head_dim if head_dim_v is None else head_dim_v
        return (num_kv_heads * head_dim // ref.GROUP * ref.bytes_per_value_group(k_bits)
                + num_kv_heads * dv // ref.GROUP * ref.bytes_per_value_group(v_bits))

    def views(self) -> tuple[str, ...]:
        return ("kv/quant",)

    def write(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor, *,
              impl: Impl = "auto") -> None:
        if v is None:
            raise ValueError("KVQuantLayer.write: v is None; a 'kv' cache stores values (latent caches use kind 'mla')")
        recent = self._recent_write(k.shape[0])
        if _triton(impl, k) and k.stride(-1) == 1 and v.stride(-1) == 1:
            _kernels().quant_write(k, v, slot_mapping, self.k_codes, self.k_scales, self.v_codes, self.v_scales,
                                   self.k_bits, self.v_bits, recent=recent)
            return
        if recent is None:
            ref.quant_write(self.k_codes, self.k_scales, k, slot_mapping, self.k_bits)
            ref.quant_write(self.v_codes, self.v_scales, v, slot_mapping, self.v_bits)
            return
        kv_recent.quant_write(self.k_codes, self.k_scales, k, slot_mapping, self.k_bits, recent.k_rows, self.k_ring,
                              recent)
        kv_recent.quant_write(self.v_codes, self.v_scales, v, slot_mapping, self.v_bits, recent.v_rows, self.v_ring,
                              recent)

    def write_rotated(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, interleaved: bool, *,
                      impl: Impl = "auto") -> None:
        """RoPE on q and k in place, then k and v quantized into their slots: one launch on CUDA."""
        if _triton(impl, q) and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1:
            _kernels().rope_quant_write(q, k, v, slot_mapping, cos, sin, rotary_dim, interleaved, self.k_codes,
                                        self.k_scales, self.v_codes, self.v_scales, self.k_bits, self.v_bits,
                                        recent=self._recent_write(k.shape[0]))
            return
        ops.rope_apply(q, k, cos, sin, rotary_dim, interleaved, impl="torch" if impl == "torch" else "auto")
        self.write(k, v, slot_mapping, impl=impl)

    def stored(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor, *,
               impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
        assert v is not None
        return (_read_rows(self.k_codes, self.k_scales, self.k_bits, slot_mapping, k, impl),
                _read_rows(self.v_codes, self.v_scales, self.v_bits, slot_mapping, v, impl))

    def attn_view(self, view: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        if view not in self.views():
            raise ValueError(f"KVQuantLayer offers views {self.views()}, not {view!r}")
        return self.k_codes, self.v_codes

    def attn_quant(self, view: str) -> QuantPages | None:
        if view not in self.views():
            raise ValueError(f"KVQuantLayer offers views {self.views()}, not {view!r}")
        return QuantPages(self.k_scales, self.v_scales, self.k_bits, self.v_bits, recent=self._recent_rows())

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``[pages, page_size, Hkv, D(v)]`` keys and values as stored (for tests and inspection)."""
        shape = (self.num_pages, self.page_size, self.num_kv_heads)
        return (ref.dequantize(self.k_codes, self.k_scales, self.k_bits).view(*shape, self.head_dim),
                ref.dequantize(self.v_codes, self.v_scales, self.v_bits).view(*shape, self.head_dim_v))

    def copy_page(self, src: int, dst: int) -> None:
        for t in (self.k_codes, self.k_scales, self.v_codes, self.v_scales):
            t[dst].copy_(t[src])

    def storage_size(self) -> int:
        ts = [self.k_codes, self.k_scales, self.v_codes, self.v_scales, self.tags if self.window else None,
              self.k_ring, self.v_ring]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


class MLAQuantLayer(CacheLayer):
    """The latent (MLA) cache quantized: the latent (``head_dim_v`` channels) as code words and scales, the
    rotary key (the remaining ``head_dim - head_dim_v`` channels) in the model's dtype. The latent serves as
    keys and values alike, so it has one bit width: ``k_bits`` (``v_bits``, if given, must equal it)."""

    kind: ClassVar[str] = "mla"
    variant: ClassVar[str] = "quant"

    def __init__(self, *, k_bits: int = 4, v_bits: int | None = None, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.check_options(self.num_kv_heads, self.head_dim, self.head_dim_v, k_bits=k_bits, v_bits=v_bits)
        if self.dtype not in _FLOAT:
            raise ValueError(f"MLAQuantLayer: dtype {self.dtype} is not a float dtype (use fp16, bf16 or fp32)")
        self.bits = k_bits
        ng = self.head_dim_v // ref.GROUP
        pages = (self.num_pages, self.page_size)
        self.codes = torch.zeros((*pages, ng * k_bits), dtype=torch.int32, device=self.device)
        self.scales = torch.zeros((*pages, ng), dtype=torch.float16, device=self.device)
        self.rope = torch.zeros((*pages, self.head_dim - self.head_dim_v), dtype=self.dtype, device=self.device)

    @classmethod
    def check_options(cls, num_kv_heads: int, head_dim: int, head_dim_v: int | None, **layer_kwargs: object) -> None:
        _bits(cls.__name__, layer_kwargs, latent=True)
        if num_kv_heads != 1:
            raise ValueError(f"MLAQuantLayer: num_kv_heads={num_kv_heads}; a latent cache holds one shared head")
        dv = head_dim if head_dim_v is None else head_dim_v
        if not 0 < dv < head_dim:
            raise ValueError(f"MLAQuantLayer: head_dim_v={dv} (latent width) must be in 1..head_dim-1={head_dim - 1} "
                             f"(latent + rope width)")
        _check_dims(cls.__name__, dv, None, "latent")

    @classmethod
    def bytes_per_token(cls, num_kv_heads: int, head_dim: int, head_dim_v: int | None, dtype: torch.dtype,
                        **layer_kwargs: object) -> int:
        cls.check_options(num_kv_heads, head_dim, head_dim_v, **layer_kwargs)
        k_bits, _ = _bits(cls.__name__, layer_kwargs, latent=True)
        dv = head_dim if head_dim_v is None else head_dim_v
        return dv // ref.GROUP * ref.bytes_per_value_group(k_bits) + (head_dim - dv) * dtype.itemsize

    def views(self) -> tuple[str, ...]:
        return ("mla/quant",)

    def write(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor, *,
              impl: Impl = "auto") -> None:
        """``k [T, 1, head_dim]`` (latent then rotary key); ``v`` must be None (values live in ``k``)."""
        if v is not None:
            raise ValueError("MLAQuantLayer.write: v must be None; values are the first head_dim_v channels of k")
        L = self.head_dim_v
        if _triton(impl, k) and k.stride(-1) == 1:
            _kernels().quant_write(k, None, slot_mapping, self.codes, self.scales, None, None, self.bits, self.bits,
                                   k_channels=L)
        else:
            ref.quant_write(self.codes, self.scales, k[:, :, :L], slot_mapping, self.bits)
        self.rope.view(-1, self.rope.shape[-1]).index_copy_(0, slot_mapping, k[:, 0, L:].to(self.dtype))

    def stored(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor, *,
               impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
        L = self.head_dim_v
        latent = _read_rows(self.codes, self.scales, self.bits, slot_mapping, k[:, :, :L], impl)
        rope = self.rope.view(-1, self.rope.shape[-1]).index_select(0, slot_mapping.long())
        return torch.cat([latent, rope[:, None].to(k.dtype)], dim=-1), v

    def attn_view(self, view: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        if view not in self.views():
            raise ValueError(f"MLAQuantLayer offers views {self.views()}, not {view!r}")
        return self.codes, None

    def attn_quant(self, view: str) -> QuantPages | None:
        if view not in self.views():
            raise ValueError(f"MLAQuantLayer offers views {self.views()}, not {view!r}")
        return QuantPages(self.scales, None, self.bits, self.bits, self.rope)

    def copy_page(self, src: int, dst: int) -> None:
        for t in (self.codes, self.scales, self.rope):
            t[dst].copy_(t[src])

    def storage_size(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.rope))
