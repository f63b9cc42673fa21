"""Hessian capture against transformers: for tiny random Llama, Qwen3-MoE and DeepSeek-V3 blocks, the
groups found by observing shared inputs and every captured ``Σ XᵀX`` equal those built from the
inputs transformers' own modules receive (routed experts: from every token of the MoE input,
through that expert's source weights; latent attention: ``kv_b_proj`` although exl3 folds it)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from convert_tiny import build_tiny, load
from safetensors.torch import load_file

from exl3_core.convert.capture import HessianCapture, find_linears
from exl3_core.convert.stages import conversion_stages, forward_stage

T = 40


def _hf_inputs(hf: torch.nn.Module, names: list[str], ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Inputs of the named HF submodules of block 0 during one forward, flattened to [tokens, features]."""
    got: dict[str, torch.Tensor] = {}
    block = hf.model.layers[0]
    hooks = [block.get_submodule(n).register_forward_pre_hook(
        lambda m, a, n=n: got.__setitem__(n, a[0].reshape(-1, a[0].shape[-1]).detach().clone())) for n in names]
    with torch.no_grad():
        hf(ids)
    for h in hooks:
        h.remove()
    return got


def _gram(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x.T @ x


CASES = {
    "LlamaForCausalLM": {
        "groups": {"self_attn.q_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                   "self_attn.o_proj": ["self_attn.o_proj"], "mlp.gate_proj": ["mlp.gate_proj", "mlp.up_proj"],
                   "mlp.down_proj": ["mlp.down_proj"]},
    },
    "Qwen3MoeForCausalLM": {
        "groups": {"self_attn.q_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                   "self_attn.o_proj": ["self_attn.o_proj"],
                   "mlp.experts.0.gate_proj": [f"mlp.experts.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj")],
                   "mlp.experts.0.down_proj": ["mlp.experts.0.down_proj"],
                   "mlp.experts.1.down_proj": ["mlp.experts.1.down_proj"]},
    },
    "DeepseekV3ForCausalLM": {
        "groups": {"self_attn.q_a_proj": ["self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"],
                   "self_attn.q_b_proj": ["self_attn.q_b_proj"], "self_attn.kv_b_proj": ["self_attn.kv_b_proj"],
                   "self_attn.o_proj": ["self_attn.o_proj"],
                   "mlp.experts.0.gate_proj": [f"mlp.experts.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj")]
                   + ["mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"],
                   "mlp.experts.0.down_proj": ["mlp.experts.0.down_proj"],
                   "mlp.experts.1.down_proj": ["mlp.experts.1.down_proj"],
                   "mlp.shared_experts.down_proj": ["mlp.shared_experts.down_proj"]},
    },
}


@pytest.mark.parametrize("arch", sorted(CASES))
def test_capture_matches_transformers(arch: str, tmp_path: Path) -> None:
    tf = pytest.importorskip("transformers")
    src = build_tiny(arch, tmp_path / "src")
    model = load(src)
    stages = conversion_stages(model)
    block = stages[1]
    slots = find_linears(block.module)
    ids = torch.randint(0, 256, (2, T // 2), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        x = forward_stage(model, stages[0], ids, ids)
        with HessianCapture(block.module, slots) as cap:
            for half in (slice(0, 1), slice(1, 2)):  # two passes: groups must be stable, H accumulates
                cap.next_batch()
                forward_stage(model, block, x[half], ids[half])
    prefix = "model.layers.0."
    found = {k[len(prefix):]: sorted(m[len(prefix):] for m in v) for k, v in cap.groups.items()}
    assert found == {k: sorted(v) for k, v in CASES[arch]["groups"].items()}
    assert not cap.unseen()
    assert all(not s.quantize for s in slots if s.key.endswith(".mlp.gate"))  # the router stays dense

    hf = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    direct = [k for k in CASES[arch]["groups"] if ".experts." not in k]
    moe_in = ["mlp"] if arch != "LlamaForCausalLM" else []
    hf_x = _hf_inputs(hf, direct + moe_in, ids)
    weights = load_file(str(src / "model.safetensors"))
    for leader in CASES[arch]["groups"]:
        if ".experts." not in leader:
            want = _gram(hf_x[leader])
        elif leader.endswith("gate_proj"):
            want = _gram(hf_x["mlp"])  # every expert sees every token of the MoE input
        else:
            e = leader.split(".")[2]
            w = {p: weights[f"{prefix}mlp.experts.{e}.{p}.weight"].double() for p in ("gate_proj", "up_proj")}
            xm = hf_x["mlp"].double()
            want = _gram(F.silu(xm @ w["gate_proj"].T) * (xm @ w["up_proj"].T))
        acc = cap.accumulators[prefix + leader]
        assert acc.count == T
        err = float((acc.h_sum.double() - want).norm() / want.norm())
        assert err < 1e-5, f"{arch} {leader}: H differs from the transformers inputs by {err:.2e}"
