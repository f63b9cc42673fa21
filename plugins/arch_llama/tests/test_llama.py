"""Llama and Mistral against transformers, through the core's architecture suite."""
from __future__ import annotations

from exl3_core.testing.arch import arch_suite

test_llama = arch_suite("LlamaForCausalLM")
test_mistral = arch_suite("MistralForCausalLM")
