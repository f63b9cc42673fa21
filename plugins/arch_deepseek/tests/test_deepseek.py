"""DeepSeek-V2/V3 against transformers on tiny random checkpoints (latent attention + MoE).

The MoE conformance suite runs fp32 logits (1e-4), a paged-cache round trip, bf16 logits with
routing pinned to transformers' choice (2e-2; near-tie flips are counted and checked to be
ties) and load-error reporting, for every variant in each module's ``tiny_configs``.
"""
from __future__ import annotations

from exl3_core.testing.moe import moe_arch_suite

test_deepseek_v2 = moe_arch_suite("DeepseekV2ForCausalLM")
test_deepseek_v3 = moe_arch_suite("DeepseekV3ForCausalLM")
