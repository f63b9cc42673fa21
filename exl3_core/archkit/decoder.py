"""The standard pre-norm decoder: embedding -> N x (attention, MLP) -> norm -> head.

Most families are this shape with small differences; a plugin subclasses
:class:`StandardDecoderConfig` (tensor names, biases, q/k norm, RoPE layout, norm offsets) and
:class:`StandardDecoder` (only if a block differs: the ``make_*`` hooks swap the attention or MLP
of any layer, e.g. MLA attention or a mixture-of-experts MLP).
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.archkit.config import Config, ConfigError, RopeSettings, normalise_rope
from exl3_core.archkit.model import Model
from exl3_core.cache.layer import CacheLayers
from exl3_core.nn.attention import Attention
from exl3_core.nn.embedding import Embedding
from exl3_core.nn.linear import DenseLinear, shard_granularity, shard_linear
from exl3_core.nn.mlp import GatedMLP
from exl3_core.nn.module import ForwardState, LoadContext, Module, WeightError
from exl3_core.nn.norm import RMSNorm
from exl3_core.nn.rope import RotaryEmbedding
from exl3_core.nn.shard import LinearShard, block_split


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


class DecoderBlock(Module):
    """Pre-norm residual block: ``x += attn(norm(x)); x += mlp(norm(x))``."""

    def __init__(self, attn_norm: torch.nn.Module, attn: torch.nn.Module, mlp_norm: torch.nn.Module,
                 mlp: torch.nn.Module) -> None:
        super().__init__()
        self.attn_norm = attn_norm
        self.attn = attn
        self.mlp_norm = mlp_norm
        self.mlp = mlp

    def forward(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``."""
        x = x + self.attn(self.attn_norm(x), state)
        return x + self.mlp(self.mlp_norm(x), state)


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
        #: this rank's vocabulary ``(start, stop)`` under tensor parallelism (None: all of it)
        self.vocab_range: tuple[int, int] | None = None

    def load_weights(self, ctx: LoadContext) -> None:
        has_own = f"{self.key}.weight" in ctx.names or f"{self.key}.trellis" in ctx.names
        if has_own or not self.tied:
            self.attach_loaded("linear", ctx.linear(self.key, self.hidden_size, self.vocab_size, bias=False))  # type: ignore[arg-type]
            return
        emb = self._embedding[0].weight
        if emb is None:
            raise WeightError(f"{self.key}: tied to {self._embedding[0].key} which is not loaded yet")
        self.attach_loaded("linear", DenseLinear(emb, None, self.hidden_size, self.vocab_size, key=self.key))

    def unload_weights(self) -> None:
        super().unload_weights()
        self.vocab_range = None

    def vocab_shares(self, world: int) -> list[tuple[int, int]]:
        """Every rank's vocabulary range (whole 128-row blocks for an EXL3 head; the last rank's may be shorter)."""
        return block_split(self.vocab_size, world, shard_granularity(self.linear), f"vocabulary rows of {self.key}")

    def apply_shard(self, rank: int, world: int) -> None:
        """Keep ``rank``'s slice of the vocabulary (a column cut): its logits are that slice's, and the tensor-
        parallel runtime gathers the slices. Call after loading."""
        start, stop = self.vocab_shares(world)[rank]
        self.attach_loaded("linear", shard_linear(self.linear, LinearShard("column", rank, world, start, stop)))
        self.vocab_range = (start, stop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def adapter_refusals(self) -> dict[str, str]:
        """The head runs on the rows that want logits alone (and may be the embedding itself): no adapters."""
        return {self.key: "adapters on the output head are not supported"}


class StandardDecoder(Model):
    """embedding -> blocks -> final norm -> head, with per-layer hooks for attention and MLP."""

    config_class: ClassVar[type[StandardDecoderConfig]] = StandardDecoderConfig  # type: ignore[assignment]
    #: the execution plan runs this model's parts in its own forms (:mod:`exl3_core.plan`); a subclass whose
    #: ``forward_batch`` is not this class's maths sets False, and the plan then calls its forward
    standard_forward: ClassVar[bool] = True

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
    def forward_batch(self, meta: BatchMeta, cache: CacheLayers | None = None, *,
                      fp32_logits: bool = True) -> torch.Tensor:
        """The reference forward: embedding, blocks, final norm, head (see :meth:`Model.forward_batch`).
        The engine runs the same maths through :class:`exl3_core.plan.ExecutionPlan`. Loaded over several
        ranks, every rank runs its share and the logits come back whole."""
        if self.parallel is not None:
            return self.parallel.forward(meta, cache, fp32_logits=fp32_logits)
        state = ForwardState(meta, cache, self.allowed_backends, self.plugins)
        x = self.embed(meta.input_ids)
        for block in self.layers:
            x = block(x, state)
        if meta.logits_indices is not None:
            x = x.index_select(0, meta.logits_indices)
        logits = self.head(self.norm(x))
        return logits.float() if fp32_logits else logits
