"""Bad LoRA input: an adapter of another base model, an unknown target module, missing files, a damaged
safetensors file, contradicting ranks, features exl3 does not run: each error names the file and the
tensor (or field), and a failed load leaves the model exactly as it was."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from exl3_core.archkit.config import Config
from exl3_core.archkit.model import Model
from exl3_core.lora import LoraError
from exl3_core.testing.arch import build_checkpoint, tiny_variants
from exl3_core.testing.lora import random_adapter, write_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCH = "LlamaForCausalLM"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, dict[str, tuple[int, int]]]:
    cfg = next(iter(tiny_variants(ARCH).values()))
    d = tmp_path_factory.mktemp("llama")
    build_checkpoint(ARCH, cfg, d, seed=1)
    model = Model.from_config(Config.from_directory(d)).load()
    linears = {m.key: (m.in_features, m.out_features) for m in model.modules()
               if hasattr(m, "adapters") and ".layers." in getattr(m, "key", "")}
    return model, linears


@pytest.fixture
def good(base: tuple[Model, dict], tmp_path: Path) -> Path:
    random_adapter(tmp_path / "good", base[1], r=4, seed=3)
    return tmp_path / "good"


def _edit(src: Path, dst: Path, fn: Any) -> Path:
    """A copy of adapter ``src`` whose tensors ``fn`` edits in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    t = load_file(str(dst / "adapter_model.safetensors"))
    fn(t)
    save_file(t, str(dst / "adapter_model.safetensors"))
    return dst


def _adapters(model: Model) -> dict[str, tuple[Any, ...]]:
    """Every linear's adapters and, for LoRA ones, the stack they hold."""
    return {m.key: tuple((a, getattr(a, "stack", None)) for a in m.adapters) for m in model.modules()
            if getattr(m, "adapters", ())}


def _fails(model: Model, path: Path, *needles: str) -> str:
    ids = torch.arange(10).view(1, 10)
    names, attached, before = model.lora_names(), _adapters(model), model.forward(ids)
    with pytest.raises(LoraError) as e:
        model.load_lora(path, name="bad")
    msg = str(e.value)
    for n in needles:
        assert n in msg, f"error does not name {n!r}: {msg}"
    assert model.lora_names() == names
    assert _adapters(model) == attached, "a failed load changed the adapters on the linears"
    assert torch.equal(model.forward(ids), before), "a failed load changed the model's output"
    return msg


def test_adapter_for_another_base(base: tuple[Model, dict], tmp_path: Path) -> None:
    """Same module names, another hidden size: the first mismatching tensor and the file are named."""
    model, linears = base
    other = {k: (i * 2, o * 2) for k, (i, o) in linears.items()}
    random_adapter(tmp_path / "other", other, r=4, seed=4)
    first = min(k for k in linears if k.endswith("_proj"))
    _fails(model, tmp_path / "other", "adapter_model.safetensors", f"{first}.lora_A.weight", "another base model")


def test_unknown_target_module(base: tuple[Model, dict], good: Path, tmp_path: Path) -> None:
    def add(t: dict) -> None:
        t["base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight"] = torch.zeros(4, 64)
        t["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"] = torch.zeros(64, 4)

    bad = _edit(good, tmp_path / "unknown", add)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": [*cfg["target_modules"], "qkv_proj"]}))
    _fails(base[0], bad, "adapter_model.safetensors", "layers.0.self_attn.qkv_proj.lora_", "not a linear")


def test_output_head_is_refused(base: tuple[Model, dict], good: Path, tmp_path: Path) -> None:
    def add(t: dict) -> None:
        t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
        t["base_model.model.lm_head.lora_B.weight"] = torch.zeros(160, 4)

    bad = _edit(good, tmp_path / "head", add)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": [*cfg["target_modules"], "lm_head"]}))
    _fails(base[0], bad, "lm_head.lora_", "output head")


def test_missing_files(base: tuple[Model, dict], good: Path, tmp_path: Path) -> None:
    model = base[0]
    _fails(model, tmp_path / "nowhere", str(tmp_path / "nowhere"), "no such adapter folder")
    no_cfg = shutil.copytree(good, tmp_path / "no_cfg")
    (no_cfg / "adapter_config.json").unlink()
    _fails(model, no_cfg, "adapter_config.json", "not found")
    no_w = shutil.copytree(good, tmp_path / "no_w")
    (no_w / "adapter_model.safetensors").unlink()
    _fails(model, no_w, "adapter_model.safetensors", "not found")
    (no_w / "adapter_model.bin").write_bytes(b"\x80\x04")
    _fails(model, no_w, "adapter_model.bin", "safe_serialization")

    def drop_b(t: dict) -> None:
        del t[next(k for k in sorted(t) if k.endswith("lora_B.weight"))]

    half = _edit(good, tmp_path / "half", drop_b)
    _fails(model, half, "adapter_model.safetensors", "no lora_B")


def test_corrupt_safetensors(base: tuple[Model, dict], good: Path, tmp_path: Path) -> None:
    model = base[0]
    trunc = shutil.copytree(good, tmp_path / "trunc")
    f = trunc / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    _fails(model, trunc, str(f))
    garbage = shutil.copytree(good, tmp_path / "garbage")
    (garbage / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + b"\0" * 64)
    _fails(model, garbage, "adapter_model.safetensors")
    bad_json = shutil.copytree(good, tmp_path / "bad_json")
    (bad_json / "adapter_config.json").write_text("{r: 4,")
    _fails(model, bad_json, "adapter_config.json", "JSON")

    def nan(t: dict) -> None:
        k = max(t)
        t[k][0, 0] = float("nan")

    nan_dir = _edit(good, tmp_path / "nan", nan)
    from safetensors.torch import load_file

    last = max(load_file(str(good / "adapter_model.safetensors")))
    _fails(model, nan_dir, last, "NaN")


def test_rank_contradicts_config(base: tuple[Model, dict], good: Path, tmp_path: Path) -> None:
    bad = shutil.copytree(good, tmp_path / "rank")
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "r": 8}))
    _fails(base[0], bad, "lora_A.weight", "rank 4 contradicts", "adapter_config.json")


@pytest.mark.parametrize("field,value,needle", [
    ("use_dora", True, "DoRA"), ("modules_to_save", ["lm_head"], "modules_to_save"), ("bias", "all", "bias"),
    ("peft_type", "IA3", "LoRA adapters only"), ("r", "eight", "'r'"),
])
def test_refused_features(base: tuple[Model, dict], good: Path, tmp_path: Path, field: str, value: Any,
                          needle: str) -> None:
    bad = shutil.copytree(good, tmp_path / field)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, field: value}))
    _fails(base[0], bad, "adapter_config.json", needle)


def test_failure_after_a_loaded_adapter_keeps_it(base: tuple[Model, dict], good: Path, tmp_path: Path) -> None:
    """A bad adapter whose first modules are fine fails on a later one; the adapter loaded before it keeps
    working exactly as before."""
    model, linears = base
    ids = torch.arange(12).view(1, 12)
    model.load_lora(good, name="good")
    try:
        with_good = model.forward(ids, loras={"good": 1.0})

        def late(t: dict) -> None:
            k = max(t)
            t[k] = torch.cat([t[k], t[k][:1]])

        bad = _edit(good, tmp_path / "late", late)
        _fails(model, bad, max(linears))
        assert torch.equal(model.forward(ids, loras={"good": 1.0}), with_good)
        with pytest.raises(LoraError, match="no LoRA adapter named 'bad' is loaded"):
            model.forward(ids, loras={"bad": 1.0})
        with pytest.raises(LoraError, match="loaded already"):
            model.load_lora(good, name="good")
        with pytest.raises(LoraError, match="adapter name"):
            model.load_lora(good, name="has:colon")
        with pytest.raises(ValueError, match="finite"):
            model.forward(ids, loras={"good": float("inf")})
    finally:
        model.unload_lora("good")
    assert not any(getattr(m, "adapters", ()) for m in model.modules())


def test_written_adapter_layouts(base: tuple[Model, dict], tmp_path: Path) -> None:
    """Tensor names with the adapter's name kept (``lora_A.<name>.weight``) or without PEFT's prefix load the
    same as PEFT's own layout."""
    model, linears = base
    ids = torch.arange(12).view(1, 12)
    pairs = random_adapter(tmp_path / "plain", linears, r=2, seed=8)
    model.load_lora(tmp_path / "plain", name="plain")
    ref = model.forward(ids, loras={"plain": 1.0})
    model.unload_lora("plain")
    tensors = {}
    for k, (a, b) in pairs.items():
        tensors[f"{k}.lora_A.default.weight"] = a
        tensors[f"{k}.lora_B.default.weight"] = b
    write_adapter(tmp_path / "named", tensors, {"r": 2})
    model.load_lora(tmp_path / "named", name="named")
    try:
        assert torch.equal(model.forward(ids, loras={"named": 1.0}), ref)
    finally:
        model.unload_lora("named")
