"""Multi-head latent attention: keys and values are rebuilt from one shared compressed latent.

Per token the projections produce a latent ``c`` (``kv_lora_rank`` channels, RMS-normed) and a
single decoupled rotary key ``k_r`` (``rope_dim`` channels, shared by all heads). Head h's key
is ``[W_uk[h] c, k_r]`` and its value ``W_uv[h] c``, with ``W_uk``/``W_uv`` the two halves of
``kv_b_proj``. Because ``q_n . (W_uk c) = (W_uk^T q_n) . c``, the query's no-rope part can be
*absorbed* through ``W_uk`` into latent space. Attention then runs as MQA with one kv head of
width ``kv_lora_rank + rope_dim`` whose values are its first ``kv_lora_rank`` channels, and
``W_uv`` is applied to the per-head attention output afterwards. The cache therefore holds
``[c, k_r]`` only (the ``"mla"`` cache kind), and every path (with or without a cache) uses this
absorbed form; :meth:`LatentAttention.forward_expanded` keeps the textbook form as an oracle.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from exl3_core.archkit.config import RopeSettings
from exl3_core.attention.dispatch import get_dispatcher
from exl3_core.attention.spec import AttnArgs, AttnSpec, CacheView, CallShape, device_cc, sm_count, view_facts
from exl3_core.cache.geometry import LayerGeometry
from exl3_core.nn.adapters import row_map
from exl3_core.nn.linear import shard_linear
from exl3_core.nn.module import ForwardState, LoadContext, Module
from exl3_core.nn.norm import RMSNorm
from exl3_core.nn.rope import RotaryEmbedding
from exl3_core.nn.shard import HeadShard, LinearShard


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature multiplier ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def latent_softmax_scale(qk_head_dim: int, rope: RopeSettings | None) -> float:
    """Softmax scale of latent attention: ``qk_head_dim**-0.5``, times ``yarn_mscale(factor,
    mscale_all_dim)**2`` when a scaled RoPE sets ``mscale_all_dim`` (the scale grows with the
    context-extension factor; the rotary ``attention_factor`` is applied separately by the rope)."""
    scale = qk_head_dim ** -0.5
    if rope is not None and rope.type != "default" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale *= m * m
    return scale


def dense_weight(linear: torch.nn.Module, in_features: int, dtype: torch.dtype,
                 device: torch.device | str) -> torch.Tensor:
    """The matrix ``W [in, out]`` (fp32) a linear module applies (``y = x @ W + b``), whatever its storage.

    Probing with the identity works for every linear implementation (plain, padded, quantized:
    the result is exactly what its forward computes for ``dtype`` inputs), so no layout is assumed.
    """
    with torch.no_grad():
        eye = torch.eye(in_features, dtype=dtype, device=device)
        return linear(eye).float() - linear(torch.zeros_like(eye[:1])).float()


class LatentAttention(Module):
    """Latent attention over the packed batch layout (see :mod:`exl3_core.attention.spec`).

    Checkpoint sub-keys under ``prefix``: ``q_proj`` (or the low-rank ``q_a_proj``,
    ``q_a_layernorm``, ``q_b_proj``), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
    ``o_proj``; rename through ``keys``.

    :param num_heads: query heads.
    :param q_lora_rank: rank of the low-rank query, or None for a full ``q_proj``.
    :param kv_lora_rank: latent width L.
    :param qk_nope_head_dim: per-head query/key channels without rotary embedding.
    :param qk_rope_head_dim: rotary channels (one key shared by all heads, per-head query).
    :param v_head_dim: per-head value channels.
    :param rope: rotary embedding over ``qk_rope_head_dim`` channels (shared between layers).
    :param scale: softmax scale (see :func:`latent_softmax_scale`).
    :param latent_norm_eps: epsilon of the q/kv latent norms.
    :param bias: bias on the two down-projections and ``o_proj`` (None: use if present).
    """

    cache_kind: ClassVar[str] = "mla"
    #: one shared "head" in the cache: the latent plus the rotary key
    num_kv_heads: int = 1

    KEYS: ClassVar[dict[str, str]] = {
        "q_proj": "q_proj", "q_a_proj": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b_proj": "q_b_proj",
        "kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b_proj": "kv_b_proj",
        "o_proj": "o_proj",
    }

    def __init__(self, *, prefix: str, layer_idx: int, hidden_size: int, num_heads: int, q_lora_rank: int | None,
                 kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 rope: RotaryEmbedding, scale: float, latent_norm_eps: float = 1e-6, bias: bool | None = False,
                 keys: dict[str, str] | None = None) -> None:
        super().__init__()
        if rope.rotary_dim != qk_rope_head_dim:
            raise ValueError(f"layer {layer_idx}: the rotary embedding rotates {rope.rotary_dim} channels but "
                             f"qk_rope_head_dim={qk_rope_head_dim}; build it with head_dim=qk_rope_head_dim")
        self.prefix = prefix
        self.layer_idx = layer_idx
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.nope_dim = qk_nope_head_dim
        self.rope_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.rope = rope
        self.scale = scale
        self.bias = bias
        self.keys = {k: f"{prefix}.{v}" for k, v in {**self.KEYS, **(keys or {})}.items()}
        #: index into ``cache.layers``; assigned by the model in attention-layer order
        self.cache_index: int | None = None
        #: this rank's query heads under tensor parallelism (None: all); the latent is every rank's
        self.shard: HeadShard | None = None
        self.q_a_norm: RMSNorm | None = None
        if q_lora_rank is not None:
            self.q_a_norm = RMSNorm(self.keys["q_a_norm"], q_lora_rank, latent_norm_eps)
        self.kv_a_norm = RMSNorm(self.keys["kv_a_norm"], kv_lora_rank, latent_norm_eps)
        self.declare_slots("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj")
        # slots filled by load_weights (declared for type checkers; None until loaded)
        self.q_proj: torch.nn.Module | None
        self.q_a_proj: torch.nn.Module | None
        self.q_b_proj: torch.nn.Module | None
        self.kv_a_proj: torch.nn.Module | None
        self.kv_b_proj: torch.nn.Module | None
        self.o_proj: torch.nn.Module | None
        # W_uk/W_uv are derived from kv_b_proj at load (and rebuilt if the activation dtype or
        # device changes); non-persistent buffers so unload_weights() drops them
        self.w_uk: torch.Tensor | None  # [H, nope, L]: q_latent = q_nope @ w_uk
        self.w_uv: torch.Tensor | None  # [H, L, v]:    out_h = o_latent @ w_uv
        self.register_buffer("w_uk", None, persistent=False)
        self.register_buffer("w_uv", None, persistent=False)
        self._specs: dict[tuple[Any, ...], AttnSpec] = {}

    def cache_geometry(self) -> LayerGeometry:
        """One shared head per token: the latent and the rotary key."""
        return LayerGeometry(self.cache_kind, 1, self.head_dim, self.head_dim_v)

    @property
    def head_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def local_heads(self) -> int:
        """The query heads this module computes (all of them unless sharded)."""
        return self.num_heads if self.shard is None else self.shard.num_q_heads

    @property
    def head_dim_v(self) -> int:
        return self.kv_lora_rank

    # -- loading --------------------------------------------------------------------------------
    def load_weights(self, ctx: LoadContext) -> None:
        k, h, H = self.keys, self.hidden_size, self.num_heads
        qk = self.nope_dim + self.rope_dim
        if self.q_lora_rank is None:
            self.attach_loaded("q_proj", ctx.linear(k["q_proj"], h, H * qk, bias=False))  # type: ignore[arg-type]
        else:
            self.attach_loaded("q_a_proj", ctx.linear(k["q_a_proj"], h, self.q_lora_rank, bias=self.bias))  # type: ignore[arg-type]
            self.attach_loaded("q_b_proj", ctx.linear(k["q_b_proj"], self.q_lora_rank, H * qk, bias=False))  # type: ignore[arg-type]
        self.attach_loaded("kv_a_proj", ctx.linear(k["kv_a_proj"], h, self.kv_lora_rank + self.rope_dim,  # type: ignore[arg-type]
                                                   bias=self.bias))
        self.attach_loaded("kv_b_proj", ctx.linear(k["kv_b_proj"], self.kv_lora_rank,  # type: ignore[arg-type]
                                                   H * (self.nope_dim + self.v_head_dim), bias=False))
        self.attach_loaded("o_proj", ctx.linear(k["o_proj"], H * self.v_head_dim, h, bias=self.bias))  # type: ignore[arg-type]
        self.shard = None
        self.absorb(ctx.dtype, ctx.device)
        self._specs.clear()

    def apply_shard(self, shard: HeadShard) -> None:
        """Keep only ``shard``'s query heads: their rows of the query and ``kv_b_proj`` (column cuts), their
        inputs of o_proj (a row cut, whose partial sums :meth:`forward` reduces). The latent's down-projection
        and the cache row stay whole on every rank. Call after loading."""
        r, w, a, b = shard.rank, shard.world, shard.q_start, shard.q_stop
        qk, kvb, v = self.nope_dim + self.rope_dim, self.nope_dim + self.v_head_dim, self.v_head_dim

        def cut(name: str, kind: str, per_head: int) -> None:
            m = getattr(self, name)
            if m is not None:
                self.attach_loaded(name, shard_linear(m, LinearShard(kind, r, w, a * per_head, b * per_head)))  # type: ignore[arg-type]

        cut("q_proj", "column", qk)
        cut("q_b_proj", "column", qk)
        cut("kv_b_proj", "column", kvb)
        cut("o_proj", "row", v)
        self.shard = shard
        assert self.kv_b_proj is not None and self.w_uk is not None
        self.absorb(self.w_uk.dtype, self.w_uk.device)
        self._specs.clear()

    def adapter_refusals(self) -> dict[str, str]:
        """Linears of this module that cannot carry an adapter (key -> why): ``kv_b_proj`` is folded into
        ``W_uk``/``W_uv`` at load and never runs as a linear, so a delta on it would never be added."""
        if self.kv_b_proj is None:
            return {}
        return {str(getattr(self.kv_b_proj, "key", "kv_b_proj")): "it is absorbed into the attention's latent "
                "projections at load and never runs as a linear"}

    def absorb(self, dtype: torch.dtype, device: torch.device | str) -> None:
        """Materialise ``W_uk``/``W_uv`` from ``kv_b_proj`` for ``dtype`` activations. Done once per
        load, so a quantized ``kv_b_proj`` is reconstructed once, never per token."""
        assert self.kv_b_proj is not None, f"{self.prefix}: not loaded"
        H, L, n, v = self.local_heads, self.kv_lora_rank, self.nope_dim, self.v_head_dim
        w = dense_weight(self.kv_b_proj, L, dtype, device).view(L, H, n + v)
        self.w_uk = w[..., :n].permute(1, 2, 0).contiguous().to(dtype)  # [H, n, L]
        self.w_uv = w[..., n:].permute(1, 0, 2).contiguous().to(dtype)  # [H, L, v]

    # -- forward --------------------------------------------------------------------------------
    def attn_spec(self, dtype: torch.dtype, device: torch.device, cache_view: str | None,
                  shape: CallShape, layer: CacheView | None = None) -> AttnSpec:
        """The static spec (MQA over the latent), memoised per (dtype, device, view, call shape, view facts)."""
        bits, page_size, recent = view_facts(layer, cache_view)
        key = (dtype, device, cache_view, shape, bits, page_size, recent)
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = AttnSpec(
                head_dim=self.head_dim, num_q_heads=self.local_heads, num_kv_heads=1, dtype=dtype, cache=cache_view,
                phase=shape.phase, causal=True, varlen=True, device_type=device.type,
                device_cc=device_cc(device), head_dim_v=self.kv_lora_rank, max_keys=shape.max_keys,
                num_seqs=shape.num_seqs, q_per_seq=shape.q_per_seq, sm_count=sm_count(device), kv_bits=bits,
                page_size=page_size, recent=recent)
        return spec

    def project(self, x: torch.Tensor, state: ForwardState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q_nope [T, H, n], q_rope [T, H, r], kv [T, 1, L + r])``: kv is the cache row
        (normed latent, then the rotated shared key)."""
        T = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_norm is not None and self.q_a_proj is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(T, self.local_heads, self.nope_dim + self.rope_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        assert self.kv_a_proj is not None
        latent, k_rope = self.kv_a_proj(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_norm(latent)
        rope = self.rope
        cos, sin = state.memoize(("rope", id(rope)), lambda: rope.cos_sin(state.meta.positions))
        q_rope = rope.rotate(q_rope, cos, sin)
        k_rope = rope.rotate(k_rope.reshape(T, 1, self.rope_dim), cos, sin)
        kv = torch.cat([latent.view(T, 1, self.kv_lora_rank), k_rope.to(latent.dtype)], dim=-1)
        return q_nope, q_rope, kv

    def forward(self, x: torch.Tensor, state: ForwardState, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, hidden]`` (packed batch) -> ``[T, hidden]``; writes this step's latents to the cache. With
        ``rows`` (int64 indices) only those rows' outputs: the value up-projection and o_proj skip the others."""
        meta = state.meta
        T, dt = x.shape[0], x.dtype
        if self.w_uk is None or self.w_uk.dtype != dt or self.w_uk.device != x.device:
            self.absorb(dt, x.device)
        assert self.w_uk is not None and self.w_uv is not None and self.o_proj is not None
        q_nope, q_rope, kv = self.project(x, state)
        # absorb: per head, q_nope . (W_uk c) == (q_nope W_uk) . c, so queries move to latent space
        q_latent = torch.einsum("thn,hnl->thl", q_nope.to(dt), self.w_uk)
        q = torch.cat([q_latent, q_rope.to(dt)], dim=-1)
        kv = kv.to(dt)
        layer = state.cache_layer(self.cache_index)
        shape = meta.call_shape()
        dispatcher = get_dispatcher(state.plugins)
        common = {"q": q, "cu_seqlens_q": meta.cu_seqlens_q, "seq_lens_k": meta.seq_lens_k,
                  "max_seqlen_q": meta.max_seqlen_q, "max_seqlen_k": meta.max_seqlen_k, "scale": self.scale}
        if layer is not None:
            layer.write(kv, None, state.slots())
        if layer is None or meta.fresh_single_sequence:  # a fresh sequence's keys are its own rows, as stored
            if layer is not None:
                kv, _ = layer.stored(kv, None, state.slots())
            spec = self.attn_spec(dt, x.device, None, shape)
            backend = dispatcher.select(spec, state.allowed_backends)
            args = AttnArgs(spec=spec, k=kv, v=kv[..., : self.kv_lora_rank], **common)
        else:
            backend, view = dispatcher.select_view(lambda v: self.attn_spec(dt, x.device, v, shape, layer),
                                                   layer.views(), state.allowed_backends)
            k_cache, _ = layer.attn_view(view)
            spec = self.attn_spec(dt, x.device, view, shape, layer)
            args = AttnArgs(spec=spec, k_cache=k_cache, v_cache=None, page_table=meta.page_table,
                            quant=layer.attn_quant(view), **common)
        o_latent = backend.forward(args)  # [T, H, L]
        if rows is not None:
            o_latent, T = o_latent.index_select(0, rows), rows.shape[0]
        o = torch.einsum("thl,hlv->thv", o_latent.to(dt), self.w_uv)
        with row_map(rows):  # o_proj's input rows are the step's rows ``rows``
            return self.project_out(o.reshape(T, self.local_heads * self.v_head_dim), state)

    def project_out(self, o: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """o_proj, summed over the tensor-parallel group when this rank holds a share of the heads."""
        assert self.o_proj is not None
        y = self.o_proj(o)
        return state.all_reduce(y) if self.shard is not None else y

    def forward_expanded(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """Cache-less textbook form (per-head keys and values through ``kv_b_proj``): a test oracle."""
        meta = state.meta
        T, H = x.shape[0], self.local_heads
        assert self.kv_b_proj is not None and self.o_proj is not None
        q_nope, q_rope, kv = self.project(x, state)
        kvb = self.kv_b_proj(kv[:, 0, : self.kv_lora_rank]).view(T, H, self.nope_dim + self.v_head_dim)
        k_nope, v = kvb.split([self.nope_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, kv[:, :, self.kv_lora_rank:].expand(T, H, self.rope_dim).to(k_nope.dtype)], dim=-1)
        q = torch.cat([q_nope, q_rope.to(q_nope.dtype)], dim=-1)
        spec = AttnSpec(head_dim=self.nope_dim + self.rope_dim, num_q_heads=H, num_kv_heads=H, dtype=x.dtype,
                        device_type=x.device.type, head_dim_v=self.v_head_dim)
        args = AttnArgs(spec=spec, q=q, cu_seqlens_q=meta.cu_seqlens_q, seq_lens_k=meta.seq_lens_k,
                        max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k, scale=self.scale,
                        k=k, v=v.contiguous())
        o = get_dispatcher(state.plugins).select(spec, state.allowed_backends).forward(args)
        return self.project_out(o.reshape(T, H * self.v_head_dim), state)

    def extra_repr(self) -> str:
        return f"{self.prefix}: heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, " \
               f"kv_lora_rank={self.kv_lora_rank}, rope_dim={self.rope_dim}, v_head_dim={self.v_head_dim}"
