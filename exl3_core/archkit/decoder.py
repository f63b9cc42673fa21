"""The standard pre-norm decoder: embedding -> N x (attention, MLP) -> norm -> head.

Most families are this shape with small differences; a plugin subclasses
:class:`StandardDecoderConfig` (tensor names, biases, q/k norm, RoPE layout, norm offsets) and
:class:`StandardDecoder` (only if a block differs: the ``make_*`` hooks swap the attention or MLP
of any layer, e.g. MLA attention or a mixture-of-experts MLP).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, ClassVar

import torch

from exl3_core import ops, settings
from exl3_core.archkit.batch import BatchMeta
from exl3_core.archkit.config import Config, ConfigError, RopeSettings, normalise_rope
from exl3_core.archkit.model import Model
from exl3_core.nn.attention import Attention
from exl3_core.nn.embedding import Embedding
from exl3_core.nn.mlp import GatedMLP
from exl3_core.nn.module import ForwardState, LoadContext, Module, WeightError
from exl3_core.nn.norm import DeferredNorm, RMSNorm
from exl3_core.nn.rope import RotaryEmbedding
from exl3_core.quant.exl3 import linear as exl3_linear
from exl3_core.quant.exl3.linear import project_group


class StandardDecoderConfig:
    """Typed architecture parameters, read from ``config.json`` by the base class.

    Class attributes are the per-family quirks a plugin overrides; instance attributes are read
    from the checkpoint's config in ``__init__`` (subclasses call ``super().__init__`` and read
    any extra key).
    """

    #: the HF ``architectures[0]`` this config describes (documentation / sanity checks)
    arch_string: ClassVar[str | None] = None

    # -- tensor names ({i} = layer index) ---------------------------------------------------------
    embed_key: ClassVar[str] = "model.embed_tokens"
    layer_key: ClassVar[str] = "model.layers.{i}"
    attn_key: ClassVar[str] = "self_attn"
    attn_proj_keys: ClassVar[tuple[str, str, str, str]] = ("q_proj", "k_proj", "v_proj", "o_proj")
    qk_norm_keys: ClassVar[tuple[str, str]] = ("q_norm", "k_norm")
    mlp_key: ClassVar[str] = "mlp"
    mlp_proj_keys: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")
    attn_norm_key: ClassVar[str] = "input_layernorm"
    mlp_norm_key: ClassVar[str] = "post_attention_layernorm"
    final_norm_key: ClassVar[str] = "model.norm"
    head_key: ClassVar[str] = "lm_head"

    # -- quirks -----------------------------------------------------------------------------------
    #: per-head RMSNorm on q and k before RoPE
    qk_norm: ClassVar[bool] = False
    #: biases on q/k/v and on o; None = config.json ``attention_bias``
    qkv_bias: ClassVar[bool | None] = None
    o_bias: ClassVar[bool | None] = None
    #: RoPE pairs adjacent channels (GPT-J style) instead of halves
    rope_interleaved: ClassVar[bool] = False
    #: added to every RMSNorm weight ("1 + w" checkpoints)
    norm_offset: ClassVar[float] = 0.0
    #: ``sliding_window`` applies to every layer when config.json has no ``layer_types``
    sliding_window_all_layers: ClassVar[bool] = False
    #: embedding output multiplied by sqrt(hidden_size)
    scale_embedding: ClassVar[bool] = False

    def __init__(self, config: Config) -> None:
        hf = config.hf
        self.source = config.directory / "config.json"
        self.vocab_size: int = self.require(hf.vocab_size, "vocab_size")
        self.hidden_size: int = self.require(hf.hidden_size, "hidden_size")
        self.intermediate_size: int = self.require(hf.intermediate_size, "intermediate_size")
        self.num_layers: int = self.require(hf.num_hidden_layers, "num_hidden_layers")
        self.num_heads: int = self.require(hf.num_attention_heads, "num_attention_heads")
        self.num_kv_heads: int = hf.num_key_value_heads or self.num_heads
        self.head_dim: int = hf.head_dim or self.hidden_size // self.num_heads
        self.rms_norm_eps: float = hf.rms_norm_eps
        self.hidden_act: str = hf.hidden_act
        self.tie_word_embeddings: bool = bool(hf.tie_word_embeddings)
        self.max_position_embeddings: int | None = hf.max_position_embeddings
        attention_bias = bool(hf.attention_bias)
        self.attn_qkv_bias: bool = attention_bias if self.qkv_bias is None else self.qkv_bias
        self.attn_o_bias: bool = attention_bias if self.o_bias is None else self.o_bias
        self.mlp_bias: bool = bool(hf.get("mlp_bias", False))
        self.sliding_window: int | None = hf.get("sliding_window")
        self.layer_types: list[str] | None = hf.get("layer_types")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"{self.source}: layer_types has {len(self.layer_types)} entries for "
                              f"num_hidden_layers={self.num_layers}")
        self.rope: RopeSettings = normalise_rope(config.raw, interleaved=self.rope_interleaved)

    def require(self, value: Any, key: str) -> Any:
        if value is None:
            raise ConfigError(f"{self.source} has no {key!r}, which this architecture needs")
        return value

    def layer_window(self, i: int) -> int | None:
        """Sliding-window size of layer ``i`` (None = full attention)."""
        if self.layer_types is not None:
            return self.sliding_window if self.layer_types[i] == "sliding_attention" else None
        return self.sliding_window if self.sliding_window_all_layers else None

    def layer_prefix(self, i: int) -> str:
        return self.layer_key.format(i=i)


def _fusable_norm(norm: torch.nn.Module) -> bool:
    # exactly RMSNorm (a subclass may change forward): its residual add can move into its kernel
    return type(norm) is RMSNorm


@functools.cache
def _takes_rows(cls: type) -> bool:
    # an attention module whose forward can skip its output projection for rows nobody reads
    try:
        return "rows" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


def attend_rows(attn: torch.nn.Module, x: torch.Tensor, state: ForwardState, rows: torch.Tensor) -> torch.Tensor:
    """``attn(x)[rows]``: every row attends (and writes its keys and values to the cache); a module whose
    forward takes ``rows`` (core Attention, LatentAttention) projects only the kept rows."""
    if _takes_rows(type(attn)):
        return attn(x, state, rows=rows)
    return attn(x, state).index_select(0, rows)


def _residual_capable(m: torch.nn.Module) -> bool:
    # has forward_residual, and the forward it mirrors is the one in use (not overridden alone)
    cls = type(m)
    return hasattr(cls, "forward_residual") and getattr(cls, "residual_forward_of", None) is cls.forward


class DecoderBlock(Module):
    """Pre-norm residual block: ``x += attn(norm(x)); x += mlp(norm(x))``.

    On CUDA each residual add is fused into the norm that follows it: the attention output's
    into ``mlp_norm`` here, the MLP output's into the next block's ``attn_norm`` (or the final
    norm) through :meth:`forward_chain`.
    """

    def __init__(self, attn_norm: torch.nn.Module, attn: torch.nn.Module, mlp_norm: torch.nn.Module,
                 mlp: torch.nn.Module) -> None:
        super().__init__()
        self.attn_norm = attn_norm
        self.attn = attn
        self.mlp_norm = mlp_norm
        self.mlp = mlp

    def forward(self, x: torch.Tensor, state: ForwardState, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, hidden]``; with ``rows`` (the last block, when only some rows' logits are wanted) only
        those rows leave the block: after the attention (all rows write the cache) the rest runs on them."""
        if ops.fused_enabled(x) and self.chainable():
            x, delta = self.forward_chain(x, None, state, rows)
            return x + delta
        if rows is None:
            x = x + self.attn(self.attn_norm(x), state)
        else:
            x = x.index_select(0, rows) + attend_rows(self.attn, self.attn_norm(x), state, rows)
        return x + self.mlp(self.mlp_norm(x))

    def chainable(self) -> bool:
        """Whether :meth:`forward_chain` computes this block (plain block, RMSNorm norms)."""
        return type(self).forward is DecoderBlock.forward and _fusable_norm(self.attn_norm) \
            and _fusable_norm(self.mlp_norm)

    def forward_chain(self, x: torch.Tensor, pending: torch.Tensor | None, state: ForwardState,
                      rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block on the residual stream ``x + pending`` with both residual adds fused into the
        norms after them; returns ``(stream before the MLP output, MLP output)``, the caller adds
        (or fuses) the second. With ``rows``, both hold only those rows (see :meth:`forward`)."""
        assert isinstance(self.attn_norm, RMSNorm) and isinstance(self.mlp_norm, RMSNorm)
        if pending is None:
            normed = self.attn_norm(x)
        else:
            normed, x = self.attn_norm.forward_residual(pending, x)
        if rows is None:
            a = self.attn(normed, state)
        else:
            a, x = attend_rows(self.attn, normed, state, rows), x.index_select(0, rows)
        normed, x = self.mlp_norm.forward_residual(a, x)
        return x, self.mlp(normed)

    def deferrable(self) -> bool:
        """Whether :meth:`forward_deferred` computes this block (a chainable block whose attention and
        MLP have ``forward_residual``)."""
        return self.chainable() and _residual_capable(self.attn) and _residual_capable(self.mlp)

    def forward_deferred(self, h: torch.Tensor, ss_in: torch.Tensor | None, state: ForwardState,
                         ss_attn: torch.Tensor, ss_mlp: torch.Tensor) -> torch.Tensor:
        """The block on the residual stream ``h`` with both norms deferred into the linears after them
        (decode sizes on CUDA): o_proj and down add the residual in their epilogues and sum each row's
        squares into ``ss_attn``/``ss_mlp`` (zero before), q/k/v and gate/up normalise in their
        prologues. ``ss_in``: ``h``'s sums (from the previous block's down projection, or for the first
        block from the embedding lookup, ``ops.embed_ss``), or None: the norm runs as a kernel. Returns
        the new residual stream."""
        x: torch.Tensor | DeferredNorm = self.attn_norm(h) if ss_in is None else DeferredNorm(h, self.attn_norm, ss_in)
        h = self.attn.forward_residual(x, state, h, ss_attn)
        return self.mlp.forward_residual(DeferredNorm(h, self.mlp_norm, ss_attn), h, ss_mlp)


class Head(Module):
    """Output projection; shares the embedding table when the checkpoint has no separate head.

    EXL3 checkpoints of tied models do store a separate (quantized) ``lm_head`` (format spec
    1.6), so the checkpoint, not ``tie_word_embeddings``, decides.
    """

    linear: torch.nn.Module

    def __init__(self, key: str, hidden_size: int, vocab_size: int, embedding: Embedding, tied: bool) -> None:
        super().__init__()
        self.key = key
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.tied = tied
        self._embedding = [embedding]  # a list: not registered twice as a child
        self.declare_slots("linear")

    def load_weights(self, ctx: LoadContext) -> None:
        from exl3_core.nn.linear import DenseLinear

        has_own = f"{self.key}.weight" in ctx.names or f"{self.key}.trellis" in ctx.names
        if has_own or not self.tied:
            self.attach_loaded("linear", ctx.linear(self.key, self.hidden_size, self.vocab_size, bias=False))  # type: ignore[arg-type]
            return
        emb = self._embedding[0].weight
        if emb is None:
            raise WeightError(f"{self.key}: tied to {self._embedding[0].key} which is not loaded yet")
        self.attach_loaded("linear", DenseLinear(emb, None, self.hidden_size, self.vocab_size, key=self.key))

    def forward(self, x: torch.Tensor | DeferredNorm) -> torch.Tensor:
        if isinstance(x, DeferredNorm):  # the final norm in the head's prologue where it can be
            return project_group(x, (self.linear,))[0]
        return self.linear(x)


class StandardDecoder(Model):
    """embedding -> blocks -> final norm -> head, with per-layer hooks for attention and MLP."""

    config_class: ClassVar[type[StandardDecoderConfig]] = StandardDecoderConfig  # type: ignore[assignment]

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.arch_config = c = self.config_class(config)
        # registration order = load order: the head may share the embedding, so it comes after
        self.embed = self.make_embedding()
        self.rope = self.make_rope()
        self.layers = torch.nn.ModuleList([self.make_block(i) for i in range(c.num_layers)])
        self.norm = self.make_norm(c.final_norm_key)
        self.head = self.make_head()
        self.attention_layers()  # assigns cache indices

    # -- hooks (override per family) --------------------------------------------------------------
    def make_embedding(self) -> Embedding:
        c = self.arch_config
        return Embedding(c.embed_key, c.vocab_size, c.hidden_size,
                         scale=c.hidden_size ** 0.5 if c.scale_embedding else None)

    def make_rope(self) -> RotaryEmbedding | None:
        c = self.arch_config
        return RotaryEmbedding(c.rope, c.head_dim)

    def make_norm(self, key: str, dim: int | None = None) -> torch.nn.Module:
        c = self.arch_config
        return RMSNorm(key, dim or c.hidden_size, c.rms_norm_eps, offset=c.norm_offset)

    def make_attention(self, layer_idx: int) -> torch.nn.Module:
        """The attention module of layer ``layer_idx`` (must expose ``cache_kind`` and take ``(x, state)``)."""
        c = self.arch_config
        return Attention(
            prefix=f"{c.layer_prefix(layer_idx)}.{c.attn_key}", layer_idx=layer_idx, hidden_size=c.hidden_size,
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rope=self.rope,
            proj_keys=c.attn_proj_keys, qkv_bias=c.attn_qkv_bias, o_bias=c.attn_o_bias,
            qk_norm_keys=c.qk_norm_keys if c.qk_norm else None, norm_eps=c.rms_norm_eps, norm_offset=c.norm_offset,
            window=c.layer_window(layer_idx),
        )

    def make_mlp(self, layer_idx: int) -> torch.nn.Module:
        """The feed-forward module of layer ``layer_idx`` (takes ``x [T, hidden]``, returns the same shape)."""
        c = self.arch_config
        p = f"{c.layer_prefix(layer_idx)}.{c.mlp_key}"
        g, u, d = c.mlp_proj_keys
        return GatedMLP(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, act=c.hidden_act,
                        gate_key=f"{p}.{g}", up_key=f"{p}.{u}", down_key=f"{p}.{d}", bias=c.mlp_bias)

    def make_block(self, layer_idx: int) -> torch.nn.Module:
        c = self.arch_config
        p = c.layer_prefix(layer_idx)
        return DecoderBlock(self.make_norm(f"{p}.{c.attn_norm_key}"), self.make_attention(layer_idx),
                            self.make_norm(f"{p}.{c.mlp_norm_key}"), self.make_mlp(layer_idx))

    def make_head(self) -> torch.nn.Module:
        c = self.arch_config
        return Head(c.head_key, c.hidden_size, c.vocab_size, self.embed, c.tie_word_embeddings)

    # -- forward ----------------------------------------------------------------------------------
    def forward_batch(self, meta: BatchMeta, cache: Any = None, *, fp32_logits: bool = True) -> torch.Tensor:
        logits = self._forward_batch(meta, cache)
        return logits.float() if fp32_logits else logits

    def _forward_batch(self, meta: BatchMeta, cache: Any) -> torch.Tensor:
        """The forward up to the head's output in its own dtype."""
        state = ForwardState(meta, cache, self.allowed_backends, self.plugins)
        w = getattr(self.embed, "weight", None)
        if (isinstance(w, torch.Tensor) and ops.fused_enabled(w) and type(self.embed).forward is Embedding.forward
                and self._chainable() and self._deferrable(meta.input_ids.shape[0], w.dtype)):
            # decode sizes: the lookup also carries the ids over (decode graphs), writes the first norm's row
            # sums, zeroes the others and computes the step's RoPE tables: one launch
            slots, rope = 2 * len(self.layers) + 1, self.rope
            if (isinstance(rope, RotaryEmbedding) and not rope.dynamic
                    and type(rope).cos_sin is RotaryEmbedding.cos_sin):
                h, ss, cos, sin = ops.step_start(meta.input_ids, w, self.embed.scale, slots, meta.positions,
                                                 rope.inv_freq, rope.attention_factor, carry=meta.carry)
                state.memoize(("rope", id(rope)), lambda: (cos, sin))  # the key Attention._cos_sin reads
            else:
                h, ss = ops.embed_ss(meta.input_ids, w, self.embed.scale, slots, carry=meta.carry)
            return self._forward_deferred(h, meta, state, ss)
        if meta.carry is not None:
            ops.carry_ids(meta.input_ids, *meta.carry)
        x = self.embed(meta.input_ids)
        head_dtype = x.dtype  # the head (and so the logits) stays in the model's dtype
        act = self._prefill_dtype(x, meta)
        if act is not None:
            x = x.to(act)
        if ops.fused_enabled(x) and self._chainable():
            return self._forward_chain(x, meta, state, head_dtype)
        rows, keep = self._last_rows(meta)
        for i, block in enumerate(self.layers):
            x = block(x, state, rows=rows) if rows is not None and i == len(self.layers) - 1 else block(x, state)
        if rows is not None:
            x = x[:keep]  # the last block kept only the rows that need logits
        elif meta.logits_indices is not None:
            x = x.index_select(0, meta.logits_indices)  # norm + head only for the rows that need logits
        return self.head(self.norm(x).to(head_dtype))

    def _prefill_dtype(self, x: torch.Tensor, meta: BatchMeta) -> torch.dtype | None:
        """bf16 where this forward runs with bf16 activations, else None (the model's dtype throughout).

        A fresh prompt's prefill on CUDA (one sequence, no cached prefix, at least
        ``GROUP_GEMM_MIN_ROWS`` tokens: every linear multiplies by its rebuilt W) runs its residual
        stream, norms, q/k/v, attention and MLP in bf16, and its W rebuilt in bf16, so every GEMM has
        bf16 operands: at the H200's 700 W cap cuBLAS's bf16 GEMMs draw less power than fp16 ones and
        sustained prefill runs faster (docs/performance.md, run 30). Keys and values are stored in the
        cache's dtype and the head runs in the model's, so the decode steps after it are unchanged.
        bf16 keeps 8 mantissa bits to fp16's 11, the precision HF models are usually run at; far
        below a 4-bpw weight's own error. ``EXL3_PREFILL_BF16=0`` turns it off. Only the plain blocks
        qualify (:class:`Attention`, :class:`GatedMLP` and EXL3 linears, their forwards not replaced):
        other modules keep fp16."""
        if not (settings.get().prefill_bf16 and x.dtype == torch.float16 and ops.fused_enabled(x)
                and meta.phase == "prefill" and x.shape[0] >= exl3_linear.GROUP_GEMM_MIN_ROWS
                and meta.fresh_single_sequence):
            return None
        return torch.bfloat16 if self._bf16_blocks() else None

    def _bf16_blocks(self) -> bool:
        """Whether every block can run in bf16 (see :meth:`_prefill_dtype`)."""
        lin = exl3_linear.EXL3Linear
        for b in self.layers:
            attn, mlp = getattr(b, "attn", None), getattr(b, "mlp", None)
            if not (isinstance(b, DecoderBlock) and isinstance(attn, Attention) and isinstance(mlp, GatedMLP)
                    and type(attn).attend is Attention.attend and type(attn).forward is Attention.forward
                    and type(attn).project_qkv is Attention.project_qkv and type(mlp).forward is GatedMLP.forward
                    and all(isinstance(m, lin) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                                                         mlp.gate, mlp.up, mlp.down))):
                return False
        return True

    def _last_rows(self, meta: BatchMeta) -> tuple[torch.Tensor | None, int]:
        """The rows the last block keeps, and how many of them are real: ``meta.logits_indices`` when
        fewer rows than the batch's need logits (a prefill wants its last token's) and the last block is
        a plain :class:`DecoderBlock`; else ``(None, 0)``. After its attention the last block then runs
        o_proj, the MLP, the final norm and the head on those rows alone: ~1/L of a long prefill's
        GEMMs. No row at all (a prompt's middle chunk) keeps one row, dropped after the stack, so no
        kernel sees an empty batch."""
        idx = meta.logits_indices
        last = self.layers[-1] if len(self.layers) else None
        if (idx is None or last is None or type(last).forward is not DecoderBlock.forward
                or type(last).forward_chain is not DecoderBlock.forward_chain
                or idx.shape[0] >= meta.input_ids.shape[0]):
            return None, 0
        if idx.shape[0] == 0:
            return meta.input_ids.new_zeros(1), 0
        return idx, idx.shape[0]

    @property
    def folds_carry(self) -> bool:
        """The forward applies ``meta.carry`` itself (inside the embedding lookup where it can), unless a
        subclass replaced the forward that does."""
        return (type(self).forward_batch is StandardDecoder.forward_batch
                and type(self)._forward_batch is StandardDecoder._forward_batch)

    def _chainable(self) -> bool:
        return all(isinstance(b, DecoderBlock) and b.chainable() for b in self.layers) and _fusable_norm(self.norm)

    def _forward_deferred(self, h: torch.Tensor, meta: BatchMeta, state: ForwardState,
                          ss: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward_batch` at decode sizes: the norms deferred into the linears that read them
        (:meth:`DecoderBlock.forward_deferred`), the final one into the head. ``ss``: fp32
        ``[2 * layers + 1, rows]``, row 0 ``h``'s row sums of squares (so the first norm is deferred
        too) and the rest zeros (``ops.embed_ss``); None: zeros here, the first norm runs as a kernel."""
        rows = h.shape[0]
        ss_in: torch.Tensor | None = None
        if ss is None:
            ss = torch.zeros((2 * len(self.layers) + 1, rows), dtype=torch.float32, device=h.device)
        else:
            ss_in = ss[0]
        # one fp32 slot of row sums per residual-producing linear (they add into it with atomics)
        for i, block in enumerate(self.layers):
            h = block.forward_deferred(h, ss_in, state, ss[2 * i + 1], ss[2 * i + 2])  # type: ignore[operator]
            ss_in = ss[2 * i + 2]
        norm = self.norm
        assert isinstance(norm, RMSNorm) and ss_in is not None
        if meta.logits_indices is not None:  # norm + head only for the rows that need logits
            return self.head(norm(h.index_select(0, meta.logits_indices)))
        return self.head(DeferredNorm(h, norm, ss_in))

    def _deferrable(self, rows: int, dtype: torch.dtype) -> bool:
        # up to the one-launch linear's rows (read at call time: benchmarks switch it)
        return (1 <= rows <= exl3_linear.FUSED_GROUP_MAX_ROWS and len(self.layers) > 0 and dtype == torch.float16
                and settings.get().deferred_norm and all(b.deferrable() for b in self.layers))  # type: ignore[operator]

    def _forward_chain(self, x: torch.Tensor, meta: BatchMeta, state: ForwardState,
                       head_dtype: torch.dtype | None = None) -> torch.Tensor:
        """:meth:`forward_batch` with every residual add fused into the norm after it (CUDA); the head's
        input cast to ``head_dtype`` (a bf16 prefill's)."""
        if self._deferrable(x.shape[0], x.dtype):
            return self._forward_deferred(x, meta, state)
        pending: torch.Tensor | None = None
        rows, keep = self._last_rows(meta)
        for i, block in enumerate(self.layers):
            if rows is not None and i == len(self.layers) - 1:  # _last_rows vetted this block's forward_chain
                x, pending = block.forward_chain(x, pending, state, rows)  # type: ignore[operator]
            else:  # a subclass's own forward_chain may not take rows
                x, pending = block.forward_chain(x, pending, state)  # type: ignore[operator]
        norm = self.norm
        assert isinstance(norm, RMSNorm)
        if pending is None:  # no layers
            normed = norm(x if meta.logits_indices is None else x.index_select(0, meta.logits_indices))
        elif rows is not None:  # the last block kept only the rows that need logits
            normed, _ = norm.forward_residual(pending[:keep], x[:keep])
        elif meta.logits_indices is not None:  # norm + head only for the rows that need logits
            idx = meta.logits_indices
            normed, _ = norm.forward_residual(pending.index_select(0, idx), x.index_select(0, idx))
        else:
            normed, _ = norm.forward_residual(pending, x)
        return self.head(normed if head_dtype is None else normed.to(head_dtype))

