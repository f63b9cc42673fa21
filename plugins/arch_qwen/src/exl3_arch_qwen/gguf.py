"""GGUF import adapter for llama.cpp's ``qwen2`` architecture (Qwen2, Qwen2.5).

Used by ``exl3_core.convert.gguf_import`` through ``ArchSpec(gguf_arch=("qwen2",),
gguf_adapter="exl3_arch_qwen.gguf:ADAPTER")``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from exl3_core.convert.gguf_import import decoder_config


class Qwen2GGUFAdapter:
    """``qwen2`` GGUF -> ``Qwen2ForCausalLM``.

    llama.cpp converts Qwen2 without permuting Q/K (its rope mode for qwen2 is NEOX, HF's layout),
    so ``permuted_qk`` is False. Q, K and V carry biases (``blk.N.attn_{q,k,v}.bias``), which the
    standard tensor map already covers.
    """

    permuted_qk = False

    #: llama.cpp ``tokenizer.ggml.pre`` names seen on ``qwen2`` files -> exl3 pre-tokenizer recipes.
    pretokenizers: Mapping[str, str] = {
        "qwen2": "split-digits1-nfc",
        "deepseek-r1-qwen": "split-digits1-nfc",
    }

    def hf_config(self, metadata: Mapping[str, Any]) -> dict[str, Any]:
        cfg = decoder_config(metadata)
        cfg.update({
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_act": "silu",
            "attention_bias": True,  # not read by HF (Qwen2 always has qkv bias); explicit for exl3's loader
            "use_sliding_window": False,
            "sliding_window": None,
        })
        return cfg


ADAPTER = Qwen2GGUFAdapter()
