"""Cache layer contract: paged storage for one attention layer.

Storage is paged: a page table row maps a sequence's token ``i`` to ``(page_table[b, i // page_size],
i % page_size)``. Writing new tokens uses a flat ``slot_mapping`` (``page * page_size + offset``) so it
is one scatter with no host sync.

A layer type decides three things through this contract:

* **how a step's keys and values are stored**: :meth:`CacheLayer.write` (required), and, where the
  storage allows it, :meth:`CacheLayer.write_rotated` (RoPE applied on the way in, one kernel) and
  :meth:`CacheLayer.fused_write_target` (tensors a projection kernel may store rotated rows into
  directly, in its epilogue); the execution plan asks, and says which it took;
* **how attention reads it**: :meth:`CacheLayer.views` names the layouts it can hand out, native
  first (what attention backends see in ``AttnSpec.cache``), :meth:`CacheLayer.attn_view` hands one
  out; the dispatcher tries (backend, view) pairs, native view first;
* **how much it costs**: :meth:`CacheLayer.bytes_per_token`, exact, for memory planning (and
  :meth:`CacheLayer.fixed_bytes` for storage that is not per token).

A forward binds its :class:`CacheStep` to each layer before using it (:meth:`CacheLayer.bind_step`), and
calls :meth:`CacheLayer.after_attention` once the layer's attention has read it: a layer that keeps
per-sequence state beside its pages (a quantized layer's recent rows) uses both; others ignore them.

Layer options (``Cache(..., **layer_kwargs)``, e.g. ``k_bits=4``) reach the constructor, and
:meth:`CacheLayer.check_options` and :meth:`CacheLayer.bytes_per_token` before any allocation.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Protocol

import torch

from exl3_core import ops
from exl3_core.attention.spec import QuantPages

#: the name unquantized storage in a float dtype goes by, in layer views ("kv/fp16") and reports
DTYPE_VIEWS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


class CacheStep(NamedTuple):
    """What a layer may need of a forward beyond the slots it writes: the rows' positions and sequences."""

    positions: torch.Tensor  # int64 [T]
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    seq_lens_k: torch.Tensor  # int32 [B], keys after this forward
    #: int32 [B]: each sequence's ring slot for per-sequence state (None: the forward names none, and a layer
    #: keeps no per-sequence state for it)
    ring_slots: torch.Tensor | None
    #: rows of every sequence when all are equal (a decode step: 1, or k), else 0
    rows_per_seq: int


@dataclass(frozen=True)
class FusedKVTarget:
    """Paged fp16 ``k``/``v`` tensors ``[pages, page_size, heads, dim]`` (contiguous) that a kernel may
    store a step's rotated keys and values into at their flat slots, bypassing :meth:`CacheLayer.write`:
    a layer offers them only when its :meth:`~CacheLayer.write` stores exactly that."""

    k: torch.Tensor
    v: torch.Tensor


class CacheLayer(ABC):
    """One layer's paged cache. Subclasses are registered through ``exl3_cache_layer_types``."""

    #: what an attention module stores ("kv", "mla", ...)
    kind: ClassVar[str]
    #: storage variant ("fp16", "quant", ...)
    variant: ClassVar[str]

    def __init__(self, *, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 head_dim_v: int | None, dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.dtype = dtype
        self.device = torch.device(device)

    def bind_step(self, step: CacheStep | None) -> None:
        """The forward about to write and read this layer (None: a forward without a step, e.g. a test's)."""

    def after_attention(self) -> None:
        """The bound forward's attention has read this layer (per-sequence state may now move); unbinds it."""

    def clear_ring(self, slot: int) -> None:
        """Forget what ring slot ``slot`` of the per-sequence state holds: a new sequence takes it."""

    def uniform_reads(self) -> bool:
        """Whether every query of the bound forward reads a stored row alike (as :meth:`stored` returns it), so that a
        fresh sequence may attend to its own rows without the cache."""
        return True

    @classmethod
    def ring_slots(cls, num_pages: int, **layer_kwargs: object) -> int:
        """Slots of per-sequence state this layer type keeps with these options (slot 0 a scratch slot); 0: none."""
        return 0

    @classmethod
    def fixed_bytes(cls, num_kv_heads: int, head_dim: int, head_dim_v: int | None, dtype: torch.dtype,
                    num_pages: int, **layer_kwargs: object) -> int:
        """Bytes this layer allocates beyond :meth:`bytes_per_token` times its slots (none for plain layers)."""
        return 0

    @abstractmethod
    def views(self) -> tuple[str, ...]:
        """Cache views this layer can hand to attention, native first (e.g. ("kv/fp16",))."""

    @abstractmethod
    def write(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
        """Store new tokens: ``k [T, H, D]``, ``v [T, H, Dv]`` (None for latent caches) at slots."""

    @abstractmethod
    def attn_view(self, view: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(k_cache, v_cache)`` in the layout :mod:`exl3_core.attention.spec` describes for ``view`` (one
        of :meth:`views`), for :class:`~exl3_core.attention.AttnArgs` (v None for latent caches). A
        non-native view may be a temporary conversion; it must be graph-capturable (no host sync)."""

    @abstractmethod
    def copy_page(self, src: int, dst: int) -> None:
        """Copy one page's contents (copy-on-write of a shared prefix page)."""

    @abstractmethod
    def storage_size(self) -> int:
        """Bytes of device memory this layer holds."""

    def write_rotated(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, interleaved: bool) -> None:
        """Rotate ``q`` and ``k`` in place by RoPE (fp32 tables ``[T, rotary_dim/2]``), then store ``k``
        and ``v``. Layers whose storage allows it override this with one kernel."""
        ops.rope_apply(q, k, cos, sin, rotary_dim, interleaved)
        self.write(k, v, slot_mapping)

    def stored(self, k: torch.Tensor, v: torch.Tensor | None,
               slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This step's keys and values (already written at ``slot_mapping``) as a read of the cache returns them,
        in their own dtype: attention that takes them without the cache (a fresh sequence's own rows) must see
        what later steps will read. Layers that store them exactly return them as given."""
        return k, v

    def fused_write_target(self) -> FusedKVTarget | None:
        """Tensors a projection kernel may store rotated fp16 rows into directly (see
        :class:`FusedKVTarget`), or None: this layer's storage is something else."""
        return None

    def attn_quant(self, view: str) -> QuantPages | None:
        """For a quantized view (see :mod:`exl3_core.attention.spec`): the scales and bit widths beside the
        code words :meth:`attn_view` hands out; None for float views."""
        return None

    def attn_tensors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The native view's tensors (:meth:`attn_view` of ``views()[0]``)."""
        return self.attn_view(self.views()[0])

    @classmethod
    def check_options(cls, num_kv_heads: int, head_dim: int, head_dim_v: int | None, **layer_kwargs: object) -> None:
        """Raise ValueError (naming the option and the fix) when this layer type cannot store the geometry
        with these options; called by :class:`~exl3_core.cache.Cache` before anything is allocated. The
        plain layers take no options."""
        if layer_kwargs:
            raise ValueError(f"cache variant {cls.variant!r} takes no options, got {sorted(layer_kwargs)} (options "
                             f"such as k_bits/v_bits belong to variant='quant')")

    @classmethod
    def bytes_per_token(cls, num_kv_heads: int, head_dim: int, head_dim_v: int | None, dtype: torch.dtype,
                        **layer_kwargs: object) -> int:
        """Bytes one cached token costs with these options (used for memory planning before allocation)."""
        dv = head_dim if head_dim_v is None else head_dim_v
        return num_kv_heads * (head_dim + dv) * torch.empty((), dtype=dtype).element_size()


class CacheLayers(Protocol):
    """What a forward reads of a cache: its per-layer storage (``exl3_core.cache.Cache`` has it)."""

    @property
    def layers(self) -> Sequence[CacheLayer]: ...
