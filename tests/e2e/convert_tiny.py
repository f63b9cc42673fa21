"""Tiny random transformers checkpoints for the conversion tests (built like the arch suite's)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def tiny_config(arch: str, layers: int = 1) -> Any:
    """A minimal config per architecture: one or two blocks, widths below one 128-wide EXL3 block."""
    import transformers as tf

    common: dict[str, Any] = {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4,
                              "max_position_embeddings": 256, "tie_word_embeddings": False, "rms_norm_eps": 1e-6}
    if arch == "LlamaForCausalLM":
        return tf.LlamaConfig(**common, intermediate_size=128, num_hidden_layers=layers, num_key_value_heads=2,
                              head_dim=16)
    if arch == "Qwen3MoeForCausalLM":
        return tf.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=1,
                                 num_key_value_heads=2, head_dim=16, num_experts=2, num_experts_per_tok=1,
                                 norm_topk_prob=True)
    if arch == "DeepseekV3ForCausalLM":
        return tf.DeepseekV3Config(**common, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=1,
                                   num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                                   qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=2, num_experts_per_tok=1,
                                   n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
                                   routed_scaling_factor=1.5, num_mtp_layers=0)
    raise ValueError(arch)


def build_tiny(arch: str, directory: Path, seed: int = 0, layers: int = 1) -> Path:
    from exl3_core.testing.arch import build_checkpoint

    build_checkpoint(arch, tiny_config(arch, layers), directory, seed=seed)
    return directory


def load(directory: Path) -> Any:
    from exl3_core.archkit import Model

    return Model.from_pretrained(directory, device="cpu", dtype=torch.float32)
