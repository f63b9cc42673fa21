"""DeepSeek-V3: the V2 decoder with sigmoid routing and a selection-only correction bias.

Differences from V2 (everything else is :mod:`exl3_arch_deepseek.deepseek_v2`):

* experts are scored with a per-expert sigmoid; ``e_score_correction_bias`` is added for the
  choice only, and the chosen experts' unbiased scores are the weights;
* grouped routing (``n_group`` groups, ``topk_group`` kept) ranks a group by the sum of its two
  best biased scores;
* weights are renormalised when ``norm_topk_prob`` and then always multiplied by
  ``routed_scaling_factor``;
* ``rope_interleave`` chooses adjacent-pair rotation (default) or the half-split layout;
* multi-token-prediction layers past ``num_hidden_layers`` are not part of the decoder and their
  tensors are never read.
"""
from __future__ import annotations

from typing import Any, ClassVar

from exl3_arch_deepseek.deepseek_v2 import DeepseekV2Config, DeepseekV2Model
from exl3_core.archkit.config import Config, ConfigError
from exl3_core.archkit.decoder import StandardDecoderConfig
from exl3_core.nn.moe import RoutingConfig


class DeepseekV3Config(DeepseekV2Config):
    arch_string = "DeepseekV3ForCausalLM"

    def __init__(self, config: Config) -> None:
        interleave = config.hf.get("rope_interleave")
        # a per-instance override of the class default, read before the base class normalises RoPE
        self.rope_interleaved = True if interleave is None else bool(interleave)  # type: ignore[misc]
        super().__init__(config)

    def make_routing(self, hf: Any) -> RoutingConfig:
        top_k = int(self.require(hf.get("num_experts_per_tok"), "num_experts_per_tok"))
        scoring = hf.get("scoring_func") or "sigmoid"
        method = hf.get("topk_method") or "noaux_tc"
        if scoring not in ("sigmoid", "softmax"):
            raise ConfigError(f"{self.source}: scoring_func={scoring!r} is not supported; expected 'sigmoid'")
        if method != "noaux_tc":
            raise ConfigError(f"{self.source}: topk_method={method!r} is not supported for {self.arch_string}; "
                              f"expected 'noaux_tc'")
        n_group = int(hf.get("n_group") or 1)
        try:
            return RoutingConfig(num_experts=self.num_experts, top_k=top_k, scoring=scoring, num_groups=n_group,
                                 topk_groups=int(hf.get("topk_group") or n_group), group_score="top2_sum",
                                 renormalize=bool(hf.get("norm_topk_prob")),
                                 scaling_factor=float(hf.get("routed_scaling_factor") or 1.0))
        except ValueError as e:
            raise ConfigError(f"{self.source}: {e}") from None


class DeepseekV3Model(DeepseekV2Model):
    config_class: ClassVar[type[StandardDecoderConfig]] = DeepseekV3Config
    correction_bias_key: ClassVar[str | None] = "gate.e_score_correction_bias"


def tiny_configs() -> dict[str, Any]:
    """Tiny random transformers configs covering the V3 variants (for the conformance suite)."""
    from transformers import DeepseekV3Config as HFConfig

    base: dict[str, Any] = {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "n_group": 4, "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "num_mtp_layers": 0,
    }
    return {
        "q_lora_yarn_interleave": HFConfig(
            **base, q_lora_rank=24, rope_interleave=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8,
                             "beta_fast": 32.0, "beta_slow": 1.0}),
        "q_full_halfsplit": HFConfig(**base, q_lora_rank=None, rope_interleave=False),
    }
