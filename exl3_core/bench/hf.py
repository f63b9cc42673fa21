"""The same shape in bf16 through HF transformers (random init), timed in the same process.

The architecture string and model type come from ``exl3_core/data/bench_shapes.json``.
Eager mode with a dynamic cache (no ``torch.compile``): the figure is transformers' plain loop.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from exl3_core.bench.models import BenchShape, _shape_table


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def transformers_decode(shape: BenchShape, dev: torch.device, *, ctx: int = 256, new_tokens: int = 64,
                        prefill_tokens: int = 2048) -> dict[str, Any]:
    """b=1 greedy decode tok/s after a ``ctx`` prompt, and prefill tok/s of ``prefill_tokens``."""
    import transformers

    table = _shape_table()["transformers"]
    cfg = transformers.AutoConfig.for_model(
        table["model_type"], vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.dim_head, rms_norm_eps=table.get("rms_norm_eps", 1e-5),
        rope_theta=table.get("rope_theta", 10000.0), tie_word_embeddings=False, max_position_embeddings=131072)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with torch.device(dev):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {"dtype": str(dtype), "compiled": False, "ctx": ctx, "new_tokens": new_tokens}
    with torch.inference_mode():
        ids = torch.randint(0, shape.vocab, (1, ctx), generator=g).to(dev)

        def decode_run() -> float:
            cache = transformers.DynamicCache()
            r = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            tok = r.logits[:, -1:].argmax(-1)
            _sync(dev)
            t = time.perf_counter()
            for _ in range(new_tokens):
                r = model(input_ids=tok, past_key_values=cache, use_cache=True)
                tok = r.logits[:, -1:].argmax(-1)
            _sync(dev)
            return new_tokens / (time.perf_counter() - t)

        decode_run()  # warm-up
        out["decode_tok_s"] = decode_run()
        if prefill_tokens:
            pids = torch.randint(0, shape.vocab, (1, prefill_tokens), generator=g).to(dev)
            model(input_ids=pids, logits_to_keep=1)
            _sync(dev)
            t = time.perf_counter()
            model(input_ids=pids, logits_to_keep=1)
            _sync(dev)
            out["prefill_tok_s"] = prefill_tokens / (time.perf_counter() - t)
    return out
