"""Conversion of tiny random Llama, Qwen3-MoE and DeepSeek-V3 models at 2, 3 and 4 bpw on the CPU:
every output loads, the MoE/latent-attention specifics are stored as the format says, and the KL
divergence to the unquantized original falls as the bitrate rises."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from convert_tiny import build_tiny, load

from exl3_core.convert.pipeline import convert
from exl3_core.eval.kld import kl_divergence
from exl3_core.loader import SafetensorsCollection

ARCHS = ["LlamaForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"]
BPWS = [2.0, 4.0]


@pytest.mark.parametrize("arch", [pytest.param(ARCHS[0], marks=pytest.mark.slow), *ARCHS[1:]])  # Llama: test_convert_*
def test_kld_falls_with_bitrate(arch: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    src = build_tiny(arch, tmp_path / "src")
    ref = load(src)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(7))
    klds = []
    for bpw in BPWS:
        out = tmp_path / f"q{bpw}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no tokenizer: random calibration rows (warned)
            res = convert(src, out, bpw, cal_rows=8, cal_cols=64, progress=False, report=lambda s: None)
        assert res.completed and res.bits == bpw
        model = load(out)
        klds.append(kl_divergence(model, ref, ids).kld)
        with SafetensorsCollection(out) as c:
            names = set(c.keys())
            assert not any(n.endswith(".weight") and ".experts." in n for n in names), "experts left unquantized"
            for n in names:
                if n.endswith(".gate.weight"):  # MoE routers stay dense fp16 (spec 1.6)
                    assert c.dtype(n) == torch.float16
            if arch != "LlamaForCausalLM":
                assert any(".experts.1.down_proj.trellis" in n for n in names)
                assert any(".shared_experts." in n for n in names) == (arch == "DeepseekV3ForCausalLM")
            if arch == "DeepseekV3ForCausalLM":
                assert any(n.endswith("kv_b_proj.trellis") for n in names)
                assert any(n.endswith("e_score_correction_bias") for n in names)
    print(f"{arch}: KLD at {BPWS} bpw = " + ", ".join(f"{k:.5f}" for k in klds))
    assert klds[0] > klds[1] > 0, klds
