"""Multi-head attention with grouped/multi-query KV heads, over the dispatcher's backends.

The forward reads like the maths: project q/k/v, normalise q and k per head (optional), rotate
them (RoPE), store this step's keys and values through the cache layer, attend, project out.
Fused forms of the same steps (one launch for q/k/v, RoPE and the cache write in the projection's
epilogue, ...) are chosen by the execution plan (:mod:`exl3_core.plan`), which calls the pieces
defined here. Nothing here reads a tensor back to the host.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from exl3_core.attention.dispatch import get_dispatcher
from exl3_core.attention.spec import (
    AttnArgs,
    AttnSpec,
    CacheView,
    CallShape,
    QuantPages,
    device_cc,
    sm_count,
    view_facts,
)
from exl3_core.cache.geometry import LayerGeometry
from exl3_core.cache.layer import CacheLayer
from exl3_core.nn.linear import shard_linear
from exl3_core.nn.module import ForwardState, LoadContext, Module
from exl3_core.nn.norm import RMSNorm
from exl3_core.nn.rope import RotaryEmbedding
from exl3_core.nn.shard import HeadShard, LinearShard, ShardKind

if TYPE_CHECKING:
    from exl3_core.archkit.batch import BatchMeta


class Attention(Module):
    """GQA/MQA self-attention.

    :param prefix: checkpoint prefix of the projections, e.g. ``"model.layers.3.self_attn"``.
    :param layer_idx: index of the decoder layer (for messages and per-layer quirks).
    :param hidden_size: model width (input of q/k/v, output of o).
    :param num_heads: query heads.
    :param num_kv_heads: key/value heads (divides ``num_heads``; 1 = MQA).
    :param head_dim: per-head size of q and k (and v unless ``head_dim_v``).
    :param rope: the rotary embedding (shared between layers), or None for no positional rotation.
    :param proj_keys: sub-keys of the q, k, v, o projections under ``prefix``.
    :param qkv_bias: biases on q/k/v (None: use them if present).
    :param o_bias: bias on o.
    :param qk_norm_keys: sub-keys of per-head RMSNorms on q and k (applied before RoPE), or None.
    :param norm_eps: epsilon of those norms.
    :param norm_offset: weight offset of those norms (see :class:`RMSNorm`).
    :param window: sliding window (a key is visible if it is less than ``window`` tokens behind).
    :param softcap: tanh soft-capping of the scores (0 = off).
    :param scale: score scale, default ``head_dim ** -0.5``.
    """

    #: what this module stores in a cache layer (``CacheLayerSpec.kind``)
    cache_kind: ClassVar[str] = "kv"
    # filled by load_weights (EXL3 or dense, decided by the checkpoint)
    q_proj: torch.nn.Module
    k_proj: torch.nn.Module
    v_proj: torch.nn.Module
    o_proj: torch.nn.Module

    def __init__(self, *, prefix: str, layer_idx: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, rope: RotaryEmbedding | None,
                 proj_keys: tuple[str, str, str, str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
                 qkv_bias: bool | None = False, o_bias: bool | None = False,
                 qk_norm_keys: tuple[str, str] | None = None, norm_eps: float = 1e-6, norm_offset: float = 0.0,
                 window: int | None = None, softcap: float = 0.0, scale: float | None = None,
                 head_dim_v: int | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"layer {layer_idx}: num_attention_heads={num_heads} is not a multiple of "
                             f"num_key_value_heads={num_kv_heads} (config.json)")
        self.prefix = prefix
        self.layer_idx = layer_idx
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.rope = rope
        self.proj_keys = tuple(f"{prefix}.{k}" for k in proj_keys)
        self.qkv_bias = qkv_bias
        self.o_bias = o_bias
        self.window = window
        self.softcap = softcap
        self.scale = head_dim ** -0.5 if scale is None else scale
        #: index into ``cache.layers``; assigned by the model in attention-layer order
        self.cache_index: int | None = None
        #: this rank's share of the heads under tensor parallelism (None: all heads)
        self.shard: HeadShard | None = None
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm_keys is not None:
            self.q_norm = RMSNorm(f"{prefix}.{qk_norm_keys[0]}", head_dim, norm_eps, offset=norm_offset)
            self.k_norm = RMSNorm(f"{prefix}.{qk_norm_keys[1]}", head_dim, norm_eps, offset=norm_offset)
        self.declare_slots("q_proj", "k_proj", "v_proj", "o_proj")
        self._specs: dict[tuple[object, ...], AttnSpec] = {}

    # -- loading --------------------------------------------------------------------------------
    def load_weights(self, ctx: LoadContext) -> None:
        qk, kk, vk, ok = self.proj_keys
        h, nq, nkv = self.hidden_size, self.num_heads, self.num_kv_heads
        self.attach_loaded("q_proj", ctx.linear(qk, h, nq * self.head_dim, bias=self.qkv_bias))
        self.attach_loaded("k_proj", ctx.linear(kk, h, nkv * self.head_dim, bias=self.qkv_bias))
        self.attach_loaded("v_proj", ctx.linear(vk, h, nkv * self.head_dim_v, bias=self.qkv_bias))
        self.attach_loaded("o_proj", ctx.linear(ok, nq * self.head_dim_v, h, bias=self.o_bias))
        self.shard = None
        self._specs.clear()

    def apply_shard(self, shard: HeadShard) -> None:
        """Keep only ``shard``'s heads: q/k/v cut by output (their heads' features), o by input (a partial
        sum that :meth:`project_out` reduces). Call after loading, before attaching adapters."""
        r, w, d, dv = shard.rank, shard.world, self.head_dim, self.head_dim_v

        def cut(m: torch.nn.Module, kind: ShardKind, start: int, stop: int) -> torch.nn.Module:
            return shard_linear(m, LinearShard(kind, r, w, start, stop))

        self.attach_loaded("q_proj", cut(self.q_proj, "column", shard.q_start * d, shard.q_stop * d))
        self.attach_loaded("k_proj", cut(self.k_proj, "column", shard.kv_start * d, shard.kv_stop * d))
        self.attach_loaded("v_proj", cut(self.v_proj, "column", shard.kv_start * dv, shard.kv_stop * dv))
        self.attach_loaded("o_proj", cut(self.o_proj, "row", shard.q_start * dv, shard.q_stop * dv))
        self.shard = shard
        self._specs.clear()

    def cache_geometry(self) -> LayerGeometry:
        """Keys and values of this rank's KV heads."""
        return LayerGeometry(self.cache_kind, self.local_heads[1], self.head_dim, self.head_dim_v)

    # -- static dispatch ------------------------------------------------------------------------
    @property
    def local_heads(self) -> tuple[int, int]:
        """``(query heads, kv heads)`` this module computes (all of them unless sharded)."""
        if self.shard is None:
            return self.num_heads, self.num_kv_heads
        return self.shard.num_q_heads, self.shard.num_kv_heads

    def attn_spec(self, dtype: torch.dtype, device: torch.device, cache_view: str | None,
                  shape: CallShape, layer: CacheView | None = None) -> AttnSpec:
        """The static spec for a call: built from Python values only, memoised (no host sync)."""
        bits, page_size, recent = view_facts(layer, cache_view)
        key = (dtype, device, cache_view, shape, bits, page_size, recent)
        spec = self._specs.get(key)
        if spec is None:
            hq, hkv = self.local_heads
            spec = self._specs[key] = AttnSpec(
                head_dim=self.head_dim, num_q_heads=hq, num_kv_heads=hkv, dtype=dtype, cache=cache_view,
                phase=shape.phase, causal=True, window=self.window, softcap=self.softcap, varlen=True,
                device_type=device.type, device_cc=device_cc(device),
                head_dim_v=None if self.head_dim_v == self.head_dim else self.head_dim_v,
                max_keys=shape.max_keys, num_seqs=shape.num_seqs, q_per_seq=shape.q_per_seq,
                sm_count=sm_count(device), kv_bits=bits, page_size=page_size, recent=recent)
        return spec

    # -- forward --------------------------------------------------------------------------------
    def split_heads(self, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projection outputs ``[T, H * D]`` as ``[T, H, D]`` views."""
        hq, hkv = self.local_heads
        T = q.shape[0]
        return (q.view(T, hq, self.head_dim), k.view(T, hkv, self.head_dim), v.view(T, hkv, self.head_dim_v))

    def qk_normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm of q and k where the model has it."""
        if self.q_norm is not None and self.k_norm is not None:
            return self.q_norm(q), self.k_norm(k)
        return q, k

    def cos_sin(self, state: ForwardState) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables of this forward's positions, computed once per forward for every layer."""
        rope = self.rope
        assert rope is not None
        return state.memoize(("rope", id(rope)), lambda: rope.cos_sin(state.meta.positions))

    def forward(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``."""
        q, k, v = self.split_heads(self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q, k = self.qk_normed(q, k)
        if self.rope is not None:
            q, k = self.rope.rotate_qk(q, k, *self.cos_sin(state))
        layer = state.cache_layer(self.cache_index)
        if layer is not None:
            layer.write(k, v, state.slots())
        return self.project_out(self.attend(q, k, v, layer, state), state)

    def project_out(self, o: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """o_proj, summed over the tensor-parallel group when this rank holds a share of the heads."""
        y = self.o_proj(o)
        return state.all_reduce(y) if self.shard is not None else y

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: CacheLayer | None,
               state: ForwardState) -> torch.Tensor:
        """Attention of ``q`` over ``layer``'s cache (this step's keys and values already stored there),
        or over ``k``/``v`` alone when ``layer`` is None; ``[T, Hq * Dv]``.

        A fresh single sequence (no earlier tokens) attends to its own new rows without the cache, as the
        layer stores them (:meth:`~exl3_core.cache.layer.CacheLayer.stored`: a quantized cache's values, so
        that its output does not depend on how a prompt was chunked or batched). Activations in another dtype
        than the cache's (a bf16 prefill over an fp16 cache) attend in the cache's dtype."""
        meta = state.meta
        cache_layer = layer
        if layer is not None and meta.fresh_single_sequence and layer.uniform_reads():
            k, v = layer.stored(k, v, state.slots())
            assert v is not None
            layer = None
        out_dtype = q.dtype
        if layer is not None and q.dtype != layer.dtype:
            q, k, v = q.to(layer.dtype), k.to(layer.dtype), v.to(layer.dtype)
        shape = meta.call_shape()
        dispatcher = get_dispatcher(state.plugins)
        if layer is None:
            spec = self.attn_spec(q.dtype, q.device, None, shape)
            backend = dispatcher.select(spec, state.allowed_backends)
            args = self._args(spec, q, meta, k=k, v=v)
        else:
            backend, view = dispatcher.select_view(
                lambda view: self.attn_spec(q.dtype, q.device, view, shape, layer), layer.views(),
                state.allowed_backends)
            k_cache, v_cache = layer.attn_view(view)
            spec = self.attn_spec(q.dtype, q.device, view, shape, layer)
            args = self._args(spec, q, meta, k=k, v=v, k_cache=k_cache, v_cache=v_cache, page_table=meta.page_table,
                              quant=layer.attn_quant(view))
        hq, _ = self.local_heads
        out = backend.forward(args).reshape(q.shape[0], hq * self.head_dim_v).to(out_dtype)
        if cache_layer is not None:
            cache_layer.after_attention()
        return out

    def _args(self, spec: AttnSpec, q: torch.Tensor, meta: BatchMeta,
              **tensors: torch.Tensor | QuantPages | None) -> AttnArgs:
        return AttnArgs(spec=spec, q=q, cu_seqlens_q=meta.cu_seqlens_q, seq_lens_k=meta.seq_lens_k,
                        max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k, scale=self.scale, **tensors)

    def extra_repr(self) -> str:
        return f"{self.prefix}: heads={self.num_heads}/{self.num_kv_heads}, head_dim={self.head_dim}, " \
               f"window={self.window}, softcap={self.softcap}"
