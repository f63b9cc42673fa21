"""Multi-head attention with grouped/multi-query KV heads, over the dispatcher's backends.

The module projects q/k/v, optionally RMS-normalises q and k per head, applies RoPE, and hands
the packed-layout tensors (:mod:`exl3_core.attention.spec`) to whichever backend the dispatcher
picks for the call's *static* :class:`AttnSpec`. With a cache, the new keys/values are written
through the cache layer first (one scatter by ``slot_mapping``) and the backend reads the pages.
Nothing here reads a tensor back to the host.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from exl3_core import ops, settings
from exl3_core.attention.dispatch import get_dispatcher
from exl3_core.attention.spec import AttnArgs, AttnSpec, device_cc
from exl3_core.nn.module import ForwardState, LoadContext, Module
from exl3_core.nn.norm import DeferredNorm, RMSNorm, add_residual_ss
from exl3_core.nn.rope import RotaryEmbedding
from exl3_core.quant.exl3.linear import (
    QKVEpilogue,
    linear_residual,
    project_group,
    qkv_epilogue_ok,
    residual_fusable,
)


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
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm_keys is not None:
            self.q_norm = RMSNorm(f"{prefix}.{qk_norm_keys[0]}", head_dim, norm_eps, offset=norm_offset)
            self.k_norm = RMSNorm(f"{prefix}.{qk_norm_keys[1]}", head_dim, norm_eps, offset=norm_offset)
        self.declare_slots("q_proj", "k_proj", "v_proj", "o_proj")
        self._specs: dict[tuple[Any, ...], AttnSpec] = {}

    # -- loading --------------------------------------------------------------------------------
    def load_weights(self, ctx: LoadContext) -> None:
        qk, kk, vk, ok = self.proj_keys
        h, nq, nkv = self.hidden_size, self.num_heads, self.num_kv_heads
        self.attach_loaded("q_proj", ctx.linear(qk, h, nq * self.head_dim, bias=self.qkv_bias))  # type: ignore[arg-type]
        self.attach_loaded("k_proj", ctx.linear(kk, h, nkv * self.head_dim, bias=self.qkv_bias))  # type: ignore[arg-type]
        self.attach_loaded("v_proj", ctx.linear(vk, h, nkv * self.head_dim_v, bias=self.qkv_bias))  # type: ignore[arg-type]
        self.attach_loaded("o_proj", ctx.linear(ok, nq * self.head_dim_v, h, bias=self.o_bias))  # type: ignore[arg-type]
        self._specs.clear()

    # -- static dispatch ------------------------------------------------------------------------
    def attn_spec(self, dtype: torch.dtype, device: torch.device, cache_view: str | None, phase: str) -> AttnSpec:
        """The static spec for a call: built from Python values only, memoised (no host sync)."""
        key = (dtype, device, cache_view, phase)
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = AttnSpec(
                head_dim=self.head_dim, num_q_heads=self.num_heads, num_kv_heads=self.num_kv_heads, dtype=dtype,
                cache=cache_view, phase=phase,  # type: ignore[arg-type]
                causal=True, window=self.window, softcap=self.softcap, varlen=True, device_type=device.type,
                device_cc=device_cc(device), head_dim_v=None if self.head_dim_v == self.head_dim else self.head_dim_v,
            )
        return spec

    # -- forward --------------------------------------------------------------------------------
    def project_qkv(self, x: torch.Tensor | DeferredNorm, state: ForwardState, rotate: bool = True,
                    epilogue: QKVEpilogue | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` -> q ``[T, Hq, D]``, k ``[T, Hkv, D]``, v ``[T, Hkv, Dv]`` (normed; rotated
        unless ``rotate`` is False; with ``epilogue`` the projection launch itself rotates and writes
        the cache)."""
        # one launch when they can share it
        q, k, v = project_group(x, (self.q_proj, self.k_proj, self.v_proj), epilogue=epilogue)
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim_v)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None and rotate:
            q, k = self.rope.rotate_qk(q, k, *self._cos_sin(state))  # fresh projection outputs: ours to rotate in place
        return q, k, v

    def _cos_sin(self, state: ForwardState) -> tuple[torch.Tensor, torch.Tensor]:
        rope = self.rope
        assert rope is not None
        return state.memoize(("rope", id(rope)), lambda: rope.cos_sin(state.meta.positions))

    def forward(self, x: torch.Tensor, state: ForwardState, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, hidden]``; with ``rows`` (int64 indices) only those rows' outputs, ``[len(rows), hidden]``:
        every row still attends and writes its keys and values, but o_proj runs on the kept rows alone."""
        o = self.attend(x, state)
        return self.o_proj(o if rows is None else o.index_select(0, rows))

    def forward_residual(self, x: torch.Tensor | DeferredNorm, state: ForwardState, residual: torch.Tensor,
                         ss: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)`` with each row's sum of squares of the result added into ``ss`` (fp32,
        zero before): at decode sizes o_proj adds the residual in its epilogue and the next linear
        normalises with ``ss`` (:class:`DeferredNorm`), so no norm kernel runs in between."""
        o = self.attend(x, state)
        if residual_fusable(self.o_proj, o, residual):
            return linear_residual(self.o_proj, o, residual, ss)  # type: ignore[arg-type]
        return add_residual_ss(residual, self.o_proj(o), ss)

    def attend(self, x: torch.Tensor | DeferredNorm, state: ForwardState) -> torch.Tensor:
        """Attention up to o_proj's input ``[T, Hq * Dv]``."""
        meta = state.meta
        layer = state.cache_layer(self.cache_index)
        own_qkv = type(self).project_qkv is Attention.project_qkv  # a subclass's may not take rotate=False
        ep = self._qkv_epilogue(x, layer, state) if own_qkv else None
        # else RoPE and the cache write as one kernel where the cache layer offers it (CUDA)
        write_rotated = getattr(layer, "write_rotated", None) if self.rope is not None and ep is None else None
        fuse = write_rotated is not None and own_qkv and ops.fused_enabled(meta.positions)
        # unrotated where RoPE comes later: in q/k/v's own launch (ep) or with the cache write (fuse); the
        # keywords only then (both need own_qkv)
        q, k, v = self.project_qkv(x, state, rotate=False, epilogue=ep) if ep is not None or fuse \
            else self.project_qkv(x, state)
        if layer is None:
            return self._dispatch(q, k, v, None, state)
        if meta.slot_mapping is None or meta.page_table is None:
            raise ValueError("forward with a cache needs BatchMeta.slot_mapping and page_table")
        if fuse:
            assert write_rotated is not None and self.rope is not None
            write_rotated(q, k, v, meta.slot_mapping, *self._cos_sin(state), self.rope.rotary_dim,
                          self.rope.interleaved)
        elif ep is None:  # (with ep, the q/k/v launch wrote them)
            layer.write(k, v, meta.slot_mapping)
        c = layer.attn_tensors()[0].dtype
        if not (q.dtype == torch.bfloat16 and c == torch.float16):
            return self._dispatch(q, k, v, layer, state)
        # bf16 activations beside an fp16 cache (a bf16 prefill: StandardDecoder._prefill_dtype)
        if meta.fresh_single_sequence:
            return self._dispatch(q, k, v, None, state)  # one fresh sequence: its keys are these rows alone
        return self._dispatch(q.to(c), k.to(c), v.to(c), layer, state).to(q.dtype)  # else in the cache's dtype

    def _dispatch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any,
                  state: ForwardState) -> torch.Tensor:
        """The selected backend's attention of ``q`` over ``layer``'s cache (its new rows already written),
        or with ``layer`` None over ``k``/``v`` alone; ``[T, Hq * Dv]``."""
        meta = state.meta
        k_cache, v_cache = layer.attn_tensors() if layer is not None else (None, None)
        spec = self.attn_spec(q.dtype, q.device, layer.views()[0] if layer is not None else None, meta.phase)
        args = AttnArgs(spec=spec, q=q, cu_seqlens_q=meta.cu_seqlens_q, seq_lens_k=meta.seq_lens_k,
                        max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k, scale=self.scale,
                        k=k, v=v, k_cache=k_cache, v_cache=v_cache,
                        page_table=meta.page_table if layer is not None else None)
        backend = get_dispatcher(state.plugins).select(spec, state.allowed_backends)
        return backend.forward(args).reshape(q.shape[0], self.num_heads * self.head_dim_v)

    def _qkv_epilogue(self, x: torch.Tensor | DeferredNorm, layer: Any, state: ForwardState) -> QKVEpilogue | None:
        """RoPE and the KV write for q/k/v's epilogue, where the linears, the rotary and the cache allow it."""
        rope, meta = self.rope, state.meta
        if (rope is None or layer is None or self.q_norm is not None or meta.slot_mapping is None
                or not settings.get().qkv_epilogue):
            return None
        caches = getattr(layer, "epilogue_caches", None)
        kv = caches() if caches is not None else None
        layers = (self.q_proj, self.k_proj, self.v_proj)
        if kv is None or not qkv_epilogue_ok(x, layers, self.head_dim, rope.rotary_dim):
            return None
        k_cache, v_cache = kv
        if (k_cache.shape[2:].numel() != self.k_proj.out_features or v_cache.shape[2:].numel() != self.v_proj.out_features
                or k_cache.device != meta.slot_mapping.device):
            return None
        cos, sin = self._cos_sin(state)
        if cos.dtype != torch.float32 or sin.dtype != torch.float32:
            return None
        return QKVEpilogue(cos, sin, rope.interleaved, meta.slot_mapping, k_cache, v_cache)

    #: the forward that :meth:`forward_residual` computes (a subclass overriding ``forward`` alone
    #: does not get the residual path: exl3_core.archkit.decoder checks this)
    residual_forward_of: ClassVar[Any] = forward

    def extra_repr(self) -> str:
        return f"{self.prefix}: heads={self.num_heads}/{self.num_kv_heads}, head_dim={self.head_dim}, " \
               f"window={self.window}, softcap={self.softcap}"
