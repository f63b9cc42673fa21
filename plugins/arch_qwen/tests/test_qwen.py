"""Qwen2 and Qwen3 against transformers, through the core's architecture suite."""
from __future__ import annotations

from exl3_core.testing.arch import arch_suite

test_qwen2 = arch_suite("Qwen2ForCausalLM")
test_qwen3 = arch_suite("Qwen3ForCausalLM")
