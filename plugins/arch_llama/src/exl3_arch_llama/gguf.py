"""GGUF import adapter for llama.cpp's ``llama`` architecture (Llama 1-3, SmolLM, Mistral-style files).

Used by ``exl3_core.convert.gguf_import`` through ``ArchSpec(gguf_arch=("llama",),
gguf_adapter="exl3_arch_llama.gguf:ADAPTER")``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from exl3_core.convert.gguf_import import decoder_config


class LlamaGGUFAdapter:
    """``llama`` GGUF -> ``LlamaForCausalLM``.

    llama.cpp's converter permutes the Q and K rows of Llama checkpoints (HF's rotate-half layout
    -> Meta's interleaved one), so ``permuted_qk`` is True and the importer undoes it.
    """

    permuted_qk = True

    #: llama.cpp ``tokenizer.ggml.pre`` names seen on ``llama`` files -> exl3 pre-tokenizer recipes.
    pretokenizers: Mapping[str, str] = {
        "llama-bpe": "split-digits3",   # Llama 3.x
        "llama3": "split-digits3",
        "llama-v3": "split-digits3",
        "smaug-bpe": "split-digits3",
        "smollm": "bytelevel-digits",   # SmolLM / SmolLM2: one digit per token, then GPT-2 split
    }

    def hf_config(self, metadata: Mapping[str, Any]) -> dict[str, Any]:
        cfg = decoder_config(metadata)
        cfg.update({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        })
        return cfg


ADAPTER = LlamaGGUFAdapter()
