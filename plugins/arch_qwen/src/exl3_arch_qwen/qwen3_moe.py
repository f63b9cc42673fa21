"""Qwen3-MoE: the Qwen3 decoder (per-head q/k RMSNorm before RoPE) with softmax top-k experts.

Layer ``i`` is a MoE layer unless ``i in mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``;
dense layers are a gated MLP of ``intermediate_size``. Routing: softmax over all experts in the
model dtype's logits, top-k, renormalised when ``norm_topk_prob``; no shared experts.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from exl3_arch_qwen.qwen3 import Qwen3Config, Qwen3Model
from exl3_core.archkit.config import Config, ConfigError
from exl3_core.archkit.decoder import StandardDecoderConfig
from exl3_core.nn.moe import MoE, RoutingConfig


class Qwen3MoeConfig(Qwen3Config):
    arch_string = "Qwen3MoeForCausalLM"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        hf = config.hf
        # transformers 5 writes num_local_experts (attribute map); older configs num_experts
        self.num_experts: int = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
        self.moe_intermediate_size: int = int(hf.get("moe_intermediate_size") or 0)
        self.decoder_sparse_step: int = int(hf.get("decoder_sparse_step") or 1)
        self.mlp_only_layers: set[int] = set(hf.get("mlp_only_layers") or [])
        self.routing: RoutingConfig | None = None
        if self.num_experts:
            if not self.moe_intermediate_size:
                raise ConfigError(f"{self.source}: num_experts is set but moe_intermediate_size is missing")
            try:
                self.routing = RoutingConfig(
                    num_experts=self.num_experts,
                    top_k=int(self.require(hf.get("num_experts_per_tok"), "num_experts_per_tok")),
                    scoring="softmax", renormalize=bool(hf.get("norm_topk_prob")))
            except ValueError as e:
                raise ConfigError(f"{self.source}: {e}") from None

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0


class Qwen3MoeModel(Qwen3Model):
    config_class: ClassVar[type[StandardDecoderConfig]] = Qwen3MoeConfig
    arch_config: Qwen3MoeConfig

    def make_mlp(self, layer_idx: int) -> torch.nn.Module:
        c = self.arch_config
        if not c.is_moe_layer(layer_idx):
            return super().make_mlp(layer_idx)
        assert c.routing is not None
        # router in the model dtype, as the reference computes it
        return MoE(prefix=f"{c.layer_prefix(layer_idx)}.{c.mlp_key}", hidden_size=c.hidden_size,
                   intermediate_size=c.moe_intermediate_size, routing=c.routing, act=c.hidden_act,
                   router_dtype=None, expert_proj_keys=c.mlp_proj_keys, bias=False)


def tiny_configs() -> dict[str, Any]:
    """Tiny random transformers configs: a dense layer (mlp_only_layers) plus sparse layers."""
    from transformers import Qwen3MoeConfig as HFConfig

    base: dict[str, Any] = {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
    }
    return {
        "norm_topk_dense_first": HFConfig(**base, norm_topk_prob=True, mlp_only_layers=[0]),
        "no_norm_sparse_step2": HFConfig(**base, norm_topk_prob=False, decoder_sparse_step=2),
    }
