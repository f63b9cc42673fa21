"""Helpers of the tensor-parallel tests (imported by name: conftest modules share one name)."""
from __future__ import annotations

from typing import Any

from exl3_core.parallel import WorkerGroup

#: the architectures' tiny test configs, resized: 128-dim heads, 512 features wherever a rank takes a
#: share (4 ranks x one 128-feature block), 2 KV heads (fewer than 4 ranks)
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "gqa", {
        "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 128, "vocab_size": 512, "num_hidden_layers": 2}),
    "qwen3moe": ("Qwen3MoeForCausalLM", "norm_topk_dense_first", {
        "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 128, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 512,
        "num_hidden_layers": 2}),
    "deepseekv3": ("DeepseekV3ForCausalLM", "q_lora_yarn_interleave", {
        "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 512, "num_attention_heads": 8,
        "num_key_value_heads": 8, "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64, "v_head_dim": 64, "n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4,
        "topk_group": 2, "vocab_size": 512, "num_hidden_layers": 2}),
}


def keep_dense(name: str) -> bool:
    """Tensors an EXL3 checkpoint keeps unquantized: embeddings and expert routers."""
    return "embed_tokens" in name or name.endswith(".mlp.gate.weight")


class Groups:
    """One CPU worker group per size, started on first use and closed at the end of the session."""

    def __init__(self) -> None:
        self.groups: dict[int, WorkerGroup] = {}

    def __call__(self, world: int) -> WorkerGroup:
        g = self.groups.get(world)
        if g is None or g.failure is not None or g.closed:
            g = self.groups[world] = WorkerGroup(["cpu"] * world)
        return g

    def close(self) -> None:
        for g in self.groups.values():
            g.close()


def alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
