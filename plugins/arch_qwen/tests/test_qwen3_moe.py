"""Qwen3-MoE against transformers on tiny random checkpoints (see exl3_core.testing.moe)."""
from __future__ import annotations

from exl3_core.testing.moe import moe_arch_suite

test_qwen3_moe = moe_arch_suite("Qwen3MoeForCausalLM")
