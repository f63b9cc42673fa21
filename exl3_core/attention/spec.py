"""Static attention configuration (AttnSpec) and the per-call tensors (AttnArgs).

Layout contract shared by every backend (packed "varlen" layout, one row per token):

* ``q``: ``[T, num_q_heads, head_dim]`` for the T query tokens of all sequences in the batch,
  sequence b owning rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
* Without a cache (``spec.cache is None``): ``k``/``v`` are ``[T, num_kv_heads, head_dim(_v)]``,
  the same tokens as q (a full forward).
* With a paged cache: the new keys/values were already written into the cache by the cache
  layer; ``k_cache``/``v_cache`` are ``[num_pages, page_size, num_kv_heads, head_dim(_v)]`` and
  ``page_table[b, i]`` is the page holding tokens ``i*page_size ..`` of sequence b. ``k``/``v``
  may also be given then: the same new rows, packed like q (a backend may use them instead of the
  cache for a sequence with no earlier tokens, or ignore them).
  For ``"mla/*"`` caches ``v_cache`` is None: values are the first ``head_dim_v`` channels of
  the keys (the compressed latent), so per-token cache reads are the latent only.
* Quantized views (``"kv/quant"``, ``"mla/quant"``; format spec 6): ``k_cache``/``v_cache`` are the int32
  code words ``[num_pages, page_size, groups * bits]`` of each token's flattened keys/values (groups of
  32 channels over all its KV heads), and ``quant`` (:class:`QuantPages`) holds their fp16 scales, the
  bit widths and, for ``"mla/quant"``, the unquantized rotary keys (the last ``head_dim - head_dim_v``
  key channels); ``v_cache`` is None there as for ``"mla/*"``.
* ``seq_lens_k[b]``: keys visible to sequence b including its new tokens, so query i of
  sequence b sits at absolute position ``seq_lens_k[b] - q_len_b + i`` (causal masks use this).
* ``max_seqlen_q``/``max_seqlen_k``: host-side upper bounds, constant across CUDA-graph replays.
"""
from __future__ import annotations

from typing import Literal, NamedTuple, Protocol

import torch


class AttnSpec(NamedTuple):
    """Everything a backend needs to decide whether it can run a call; hashable, cached on."""

    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    dtype: torch.dtype
    cache: str | None = None  # None | "kv/fp16" | "mla/fp16" | ...
    phase: Literal["prefill", "decode"] = "prefill"
    causal: bool = True
    window: int | None = None
    softcap: float = 0.0
    has_sinks: bool = False
    varlen: bool = True
    non_causal_spans: bool = False
    device_type: str = "cpu"
    device_cc: tuple[int, int] = (0, 0)
    head_dim_v: int | None = None  # None: same as head_dim
    page_size: int | None = None  # tokens per cache page (None without a cache)
    #: static bound on any sequence's key count, rounded up to a power of two (0: unknown)
    max_keys: int = 0
    #: sequences in the call, rounded up to a power of two (0: unknown)
    num_seqs: int = 0
    #: query rows of every sequence when they are all equal and known statically (decode: 1; a
    #: multi-token decode step: its k), 0 when they vary (prefill, mixed steps)
    q_per_seq: int = 0
    #: streaming multiprocessors of the device (0 off CUDA)
    sm_count: int = 0
    #: code bits of a quantized view's keys and values (``QuantPages.k_bits``/``v_bits``); (0, 0) for other views
    kv_bits: tuple[int, int] = (0, 0)
    #: a quantized view's recent-row window (positions per sequence read at 8 bits, ``QuantPages.recent``); 0: none
    recent: int = 0

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v


class CallShape(NamedTuple):
    """The static shape of one attention call, from a batch's host-side bounds (see :class:`AttnSpec`)."""

    phase: Literal["prefill", "decode"]
    max_keys: int = 0
    num_seqs: int = 0
    q_per_seq: int = 0


def pow2_bucket(n: int) -> int:
    """``n`` rounded up to a power of two (0 stays 0), so specs stay few while bounds vary."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


class RecentRows(NamedTuple):
    """A quantized view's recent rows: the low code bits that make each sequence's newest positions read at 8
    bits, and the call's ring slot of each sequence (layout and reading rule: :mod:`exl3_core.reference.kv_recent`)."""

    k_ring: torch.Tensor | None  # int32 [slots, window, key groups * extra_k]; None when k_bits is 8
    v_ring: torch.Tensor | None  # int32 [slots, window, value groups * extra_v]; None when v_bits is 8
    tags: torch.Tensor  # int32 [slots, window]: the position each ring row holds, -1 for none
    k_rows: torch.Tensor | None  # int32 [rows, key groups * extra_k]: this forward's rows' low bits
    v_rows: torch.Tensor | None
    slots: torch.Tensor  # int32 [B]: each sequence's ring slot
    window: int

    @property
    def size(self) -> int:
        return self.tags.shape[1]



class QuantPages(NamedTuple):
    """What a quantized cache view adds to its code words (see the module docstring)."""

    k_scales: torch.Tensor  # fp16 [num_pages, page_size, key groups]
    v_scales: torch.Tensor | None  # fp16 [num_pages, page_size, value groups]; None for "mla/quant"
    k_bits: int
    v_bits: int
    rope: torch.Tensor | None = None  # "mla/quant": [num_pages, page_size, rope_dim] in the model's dtype
    recent: RecentRows | None = None  # "kv/quant" keeping recent rows at 8 bits, in a call that names ring slots


class CacheView(Protocol):
    """What a spec reads off the cache layer behind a view (a :class:`~exl3_core.cache.layer.CacheLayer`)."""

    page_size: int

    def attn_quant(self, view: str) -> QuantPages | None: ...


def view_facts(layer: CacheView | None, view: str | None) -> tuple[tuple[int, int], int | None, int]:
    """``(kv_bits, page_size, recent)`` of :class:`AttnSpec` for ``view`` of ``layer``; ``((0, 0), None, 0)``
    without a cache."""
    if layer is None or view is None:
        return (0, 0), None, 0
    quant = layer.attn_quant(view)
    if quant is None:
        return (0, 0), layer.page_size, 0
    return (quant.k_bits, quant.v_bits), layer.page_size, quant.recent.window if quant.recent is not None else 0


class AttnArgs(NamedTuple):
    """The tensors of one attention call (see the module docstring for layouts)."""

    spec: AttnSpec
    q: torch.Tensor
    cu_seqlens_q: torch.Tensor  # int32 [B+1]
    seq_lens_k: torch.Tensor  # int32 [B]
    max_seqlen_q: int
    max_seqlen_k: int
    scale: float
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    k_cache: torch.Tensor | None = None
    v_cache: torch.Tensor | None = None
    page_table: torch.Tensor | None = None  # int32 [B, max_pages]
    sinks: torch.Tensor | None = None  # [num_q_heads] attention-sink logits
    quant: QuantPages | None = None  # scales and bit widths of a quantized cache view


def device_cc(device: torch.device) -> tuple[int, int]:
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)
    return (0, 0)


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a host-side property, cached per device); 0 elsewhere."""
    if device.type != "cuda":
        return 0
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]
