"""DeepSeek-V2 (and the shared DeepSeek decoder): latent attention + mixture of experts.

Layer ``i`` is a MoE layer when ``i >= first_k_dense_replace and i % moe_layer_freq == 0``,
otherwise a dense gated MLP of ``intermediate_size``. Routing: softmax scores, plain top-k
(``topk_method="greedy"``) or group-limited greedy (best expert per group ranks the group),
weights times ``routed_scaling_factor``. Shared experts are stored fused as one gated MLP of
``n_shared_experts * moe_intermediate_size``.

Quirks kept here:

* the rotary part pairs adjacent channels (the reference code rotates complex pairs), over
  ``qk_rope_head_dim`` channels only;
* the softmax scale grows with ``yarn_mscale(factor, mscale_all_dim)**2`` under YaRN;
* the latent norms use eps 1e-6 whatever ``rms_norm_eps`` says;
* the router weight is kept and run in fp32;
* ``num_key_value_heads`` in config.json is meaningless for latent attention and is ignored;
* ``norm_topk_prob`` follows the original reference code (renormalise instead of scaling when
  ``top_k > 1``); transformers ignores the flag for V2. Released V2 checkpoints set it false,
  where both agree.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from exl3_core.archkit.config import Config, ConfigError
from exl3_core.archkit.decoder import StandardDecoder, StandardDecoderConfig
from exl3_core.nn.mla import LatentAttention, latent_softmax_scale
from exl3_core.nn.mlp import GatedMLP
from exl3_core.nn.moe import MoE, RoutingConfig
from exl3_core.nn.rope import RotaryEmbedding

LATENT_NORM_EPS = 1e-6


class DeepseekV2Config(StandardDecoderConfig):
    arch_string = "DeepseekV2ForCausalLM"
    rope_interleaved = True

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        hf = config.hf
        self.q_lora_rank: int | None = hf.get("q_lora_rank")
        self.kv_lora_rank: int = self.require(hf.get("kv_lora_rank"), "kv_lora_rank")
        self.qk_nope_head_dim: int = self.require(hf.get("qk_nope_head_dim"), "qk_nope_head_dim")
        self.qk_rope_head_dim: int = self.require(hf.get("qk_rope_head_dim"), "qk_rope_head_dim")
        self.v_head_dim: int = self.require(hf.get("v_head_dim"), "v_head_dim")
        self.num_experts: int = int(hf.get("n_routed_experts") or 0)
        self.moe_intermediate_size: int = int(hf.get("moe_intermediate_size") or 0)
        self.num_shared_experts: int = int(hf.get("n_shared_experts") or 0)
        self.first_k_dense_replace: int = int(hf.get("first_k_dense_replace") or 0)
        self.moe_layer_freq: int = int(hf.get("moe_layer_freq") or 1)
        if self.num_experts and not self.moe_intermediate_size:
            raise ConfigError(f"{self.source}: n_routed_experts is set but moe_intermediate_size is missing")
        self.routing: RoutingConfig | None = self.make_routing(hf) if self.num_experts else None

    def make_routing(self, hf: Any) -> RoutingConfig:
        top_k = int(self.require(hf.get("num_experts_per_tok"), "num_experts_per_tok"))
        method = hf.get("topk_method") or "greedy"
        renorm = bool(hf.get("norm_topk_prob")) and top_k > 1
        common: dict[str, Any] = {
            "num_experts": self.num_experts, "top_k": top_k, "scoring": "softmax", "renormalize": renorm,
            "scaling_factor": 1.0 if renorm else float(hf.get("routed_scaling_factor") or 1.0)}
        try:
            if method == "greedy":
                return RoutingConfig(**common)
            if method == "group_limited_greedy":
                return RoutingConfig(**common, num_groups=int(self.require(hf.get("n_group"), "n_group")),
                                     topk_groups=int(self.require(hf.get("topk_group"), "topk_group")),
                                     group_score="max")
        except ValueError as e:
            raise ConfigError(f"{self.source}: {e}") from None
        raise ConfigError(f"{self.source}: topk_method={method!r} is not supported for {self.arch_string}; "
                          f"expected 'greedy' or 'group_limited_greedy'")

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0


class DeepseekV2Model(StandardDecoder):
    """Embedding -> N x (latent attention, dense MLP or MoE) -> norm -> head."""

    config_class: ClassVar[type[StandardDecoderConfig]] = DeepseekV2Config
    arch_config: DeepseekV2Config
    #: router compute dtype (the reference keeps router weights in fp32)
    router_dtype: ClassVar[torch.dtype | None] = torch.float32
    correction_bias_key: ClassVar[str | None] = None

    def make_rope(self) -> RotaryEmbedding:
        c = self.arch_config
        return RotaryEmbedding(c.rope, c.qk_rope_head_dim)

    def make_attention(self, layer_idx: int) -> torch.nn.Module:
        c = self.arch_config
        assert self.rope is not None
        return LatentAttention(
            prefix=f"{c.layer_prefix(layer_idx)}.{c.attn_key}", layer_idx=layer_idx, hidden_size=c.hidden_size,
            num_heads=c.num_heads, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
            rope=self.rope, scale=latent_softmax_scale(c.qk_nope_head_dim + c.qk_rope_head_dim, c.rope),
            latent_norm_eps=LATENT_NORM_EPS, bias=c.attn_o_bias)

    def make_mlp(self, layer_idx: int) -> torch.nn.Module:
        c = self.arch_config
        p = f"{c.layer_prefix(layer_idx)}.{c.mlp_key}"
        if not c.is_moe_layer(layer_idx):
            g, u, d = c.mlp_proj_keys
            return GatedMLP(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, act=c.hidden_act,
                            gate_key=f"{p}.{g}", up_key=f"{p}.{u}", down_key=f"{p}.{d}", bias=c.mlp_bias)
        assert c.routing is not None
        return MoE(prefix=p, hidden_size=c.hidden_size, intermediate_size=c.moe_intermediate_size,
                   routing=c.routing, act=c.hidden_act, router_dtype=self.router_dtype,
                   correction_bias_key=self.correction_bias_key,
                   shared_intermediate_size=c.num_shared_experts * c.moe_intermediate_size or None,
                   bias=c.mlp_bias)


def tiny_configs() -> dict[str, Any]:
    """Tiny random transformers configs covering the V2 variants (for the conformance suite)."""
    from transformers import DeepseekV2Config as HFConfig

    base: dict[str, Any] = {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
    }
    return {
        "greedy_q_full": HFConfig(**base, q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0),
        "group_limited_q_lora_yarn": HFConfig(
            **base, q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
            routed_scaling_factor=1.5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.707,
                             "beta_fast": 32.0, "beta_slow": 1.0}),
    }
