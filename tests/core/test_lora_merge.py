"""``exl3 convert --lora``: an adapter merged into the unquantized checkpoint before quantizing. The merged folder
loads (without an adapter) to what transformers + PEFT computes with the adapter, for linear modules and for
PEFT's LoRA on fused expert tensors, with experts stored per expert or fused; a bad adapter writes nothing; a
resumed conversion reuses the merged folder; the whole command quantizes base and adapter together."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exl3_core.archkit.config import Config
from exl3_core.archkit.model import Model
from exl3_core.lora import LoraError
from exl3_core.lora.merge import MARKER, merge_checkpoint
from exl3_core.testing.arch import FP32_RTOL, build_checkpoint, rel_err, tiny_variants
from exl3_core.testing.lora import peft_adapter, random_adapter

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _load(d: Path) -> Model:
    return Model.from_config(Config.from_directory(d)).load()


def _hf(d: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()


def _fuse_experts(src: Path, dst: Path) -> None:
    """``src`` with its per-expert tensors stored in transformers' fused 3-D layout."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for n in list(t):
        m = re.match(r"(.*\.experts)\.(\d+)\.(\w+)\.weight$", n)
        if m:
            groups.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = t.pop(n)
    for prefix, per in groups.items():
        E = len(per)
        t[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([per[e]["gate_proj"], per[e]["up_proj"]]) for e in range(E)])
        t[f"{prefix}.down_proj"] = torch.stack([per[e]["down_proj"] for e in range(E)])
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3MoeForCausalLM"])
def test_merged_checkpoint_equals_peft(tmp_path: Path, arch: str) -> None:
    cfg = next(iter(tiny_variants(arch).values()))
    base = tmp_path / "base"
    build_checkpoint(arch, cfg, base, seed=4)
    pm = peft_adapter(_hf(base), tmp_path / "ad", r=4, seed=2)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = pm(ids).logits
    sources = [base]
    if arch == "Qwen3MoeForCausalLM":
        _fuse_experts(base, tmp_path / "fused")
        sources.append(tmp_path / "fused")
    for src in sources:
        out = merge_checkpoint(src, [(tmp_path / "ad", 1.0)], tmp_path / f"merged_{src.name}")
        assert (out / MARKER).is_file() and (out / "config.json").is_file()
        assert rel_err(_load(out).forward(ids), ref) < FP32_RTOL, f"merged from {src.name}"
        # the merged weights are what loading the adapter beside the base computes (either expert layout)
        model = _load(src)
        model.load_lora(tmp_path / "ad", name="ad")
        assert rel_err(model.forward(ids, loras={"ad": 1.0}), ref) < FP32_RTOL, f"adapter on {src.name}"


def test_bad_adapter_writes_nothing_and_resume_reuses(tmp_path: Path) -> None:
    arch = "LlamaForCausalLM"
    base = tmp_path / "base"
    build_checkpoint(arch, next(iter(tiny_variants(arch).values())), base, seed=4)
    model = _load(base)
    linears = {m.key: (m.in_features, m.out_features) for m in model.modules()
               if hasattr(m, "adapters") and ".layers." in getattr(m, "key", "")}
    random_adapter(tmp_path / "other", {k: (2 * i, o) for k, (i, o) in linears.items()}, r=2)
    with pytest.raises(LoraError, match=r"adapter_model\.safetensors.*lora_A\.weight.*another base model"):
        merge_checkpoint(base, [(tmp_path / "other", 1.0)], tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    random_adapter(tmp_path / "a", linears, r=2, seed=1)
    random_adapter(tmp_path / "b", linears, r=2, seed=2)
    out = merge_checkpoint(base, [(tmp_path / "a", 0.5), (tmp_path / "b", 1.0)], tmp_path / "out")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert merge_checkpoint(base, [(tmp_path / "a", 0.5), (tmp_path / "b", 1.0)], tmp_path / "out") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp, "a resumed merge wrote the files again"
    with pytest.raises(LoraError, match="is not this merge"):
        merge_checkpoint(base, [(tmp_path / "a", 1.0)], tmp_path / "out")
    model.load_lora(tmp_path / "a", name="a")
    model.load_lora(tmp_path / "b", name="b")
    ids = torch.arange(14).view(1, 14)
    assert rel_err(_load(out).forward(ids), model.forward(ids, loras={"a": 0.5, "b": 1.0})) < FP32_RTOL


def test_convert_command_merges_before_quantizing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``exl3 convert --lora DIR:W`` hands the quantizer the merged folder (quantizing itself is the plain conversion,
    tested elsewhere; here a stand-in checks what it is given) and removes that folder once the conversion completes."""
    from exl3_core.cli import main
    from exl3_core.convert import pipeline

    arch = "LlamaForCausalLM"
    cfg = next(iter(tiny_variants(arch).values()))
    base = tmp_path / "base"
    build_checkpoint(arch, cfg, base, seed=5)
    pm = peft_adapter(_hf(base), tmp_path / "ad", r=8, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for m in pm.modules():
            if hasattr(m, "scaling") and isinstance(m.scaling, dict) and "default" in m.scaling:
                m.scaling["default"] *= 0.5  # the weight given on the command line
        ref = pm(ids).logits
    seen: list[Path] = []

    def quantize(src: str, out: str, bpw: float, **kw: object) -> pipeline.ConvertResult:
        seen.append(Path(src))
        assert rel_err(_load(Path(src)).forward(ids), ref) < FP32_RTOL, "the quantizer got another model"
        return pipeline.ConvertResult(Path(out), completed=True)

    monkeypatch.setattr(pipeline, "convert", quantize)
    rc = main(["convert", "-i", str(base), "-o", str(tmp_path / "q"), "-b", "4", "--lora", f"{tmp_path / 'ad'}:0.5",
               "--no-progress"])
    assert rc == 0 and seen == [tmp_path / "q.lora-base"]
    assert not seen[0].exists(), "the merged copy outlived the finished conversion"
    rc = main(["convert", "-i", str(base), "-o", str(tmp_path / "q2"), "-b", "4", "--lora", str(tmp_path / "nowhere")])
    assert rc == 1 and "nowhere" in capsys.readouterr().err and len(seen) == 1
