"""Random LoRA adapters for tests: through PEFT on a transformers model (the reference), or written
directly in PEFT's file layout for models transformers cannot build (random EXL3 models).

Random adapters are scaled so each delta is about half the size of its base projection's output
(an adapter whose delta were lost, or applied to the wrong rows, changes the logits visibly).
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

#: the projections the must-hold comparisons adapt (q/k/v/o and the gated MLP)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DELTA_GAIN = 0.5


def lora_scale(r: int, alpha: float, rslora: bool) -> float:
    return alpha / math.sqrt(r) if rslora else alpha / r


def random_pair(n_in: int, n_out: int, r: int, scale: float, g: torch.Generator,
                rows: int | None = None, gain: float = DELTA_GAIN) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [rows, in], B [out, rows])`` fp32 (``rows``: default ``r``; PEFT stacks ``r`` per expert for fused expert
    tensors) with ``scale * B A x`` of rank ``r`` about ``gain`` times a unit-gain projection."""
    n = r if rows is None else rows
    a = torch.randn(n, n_in, generator=g) / math.sqrt(n_in)
    b = torch.randn(n_out, n, generator=g) * (gain / (scale * math.sqrt(r)))
    return a, b


def peft_adapter(hf_model: torch.nn.Module | None, directory: Path, *, r: int, alpha: float = 16.0, rslora: bool = False,
                 targets: Sequence[str] = PROJECTIONS, seed: int = 0, name: str = "default",
                 base: Any = None) -> Any:
    """Wrap ``hf_model`` with a random PEFT LoRA (every ``lora_A``/``lora_B`` drawn by :func:`random_pair`),
    save it to ``directory`` and return the PEFT model (in eval mode). ``base``: an existing PEFT model to
    add the adapter to (as ``name``) instead of wrapping ``hf_model``."""
    from peft import LoraConfig, get_peft_model

    # PEFT annotates lora_alpha as int but takes any number (its scale is alpha / r)
    cfg = LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora,  # type: ignore[arg-type]
                     target_modules=list(targets), lora_dropout=0.0, init_lora_weights=False)
    if base is None:
        if hf_model is None:
            raise ValueError("peft_adapter: give the transformers model to wrap, or base= (a PEFT model)")
        model = get_peft_model(hf_model, cfg, adapter_name=name)
    else:
        model = base
        model.add_adapter(name, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in sorted(model.named_modules(), key=lambda t: t[0]):
            if hasattr(m, "lora_A") and name in m.lora_A:
                wa, wb = m.lora_A[name].weight, m.lora_B[name].weight
                a, b = random_pair(wa.shape[1], wb.shape[0], int(m.r[name]), float(m.scaling[name]), g, rows=wa.shape[0])
                wa.copy_(a)
                wb.copy_(b)
    model.save_pretrained(str(directory), selected_adapters=[name])
    saved = directory / name if name != "default" else directory
    if saved != directory:  # PEFT puts non-default adapters in a subfolder
        for f in saved.iterdir():
            f.replace(directory / f.name)
        saved.rmdir()
    return model.eval()


def write_adapter(directory: Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> Path:
    """An adapter folder in PEFT's layout: ``adapter_config.json`` (``config`` over LoRA defaults) and
    ``adapter_model.safetensors`` holding ``tensors`` as given (names included)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "bias": "none",
           "use_rslora": False, "fan_in_fan_out": False, "target_modules": list(PROJECTIONS), **config}
    (directory / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "adapter_model.safetensors"))
    return directory


def random_adapter(directory: Path, linears: Mapping[str, tuple[int, int]], *, r: int, alpha: float = 16.0,
                   rslora: bool = False, seed: int = 0, dtype: torch.dtype = torch.float32,
                   targets: Sequence[str] = PROJECTIONS,
                   gain: float = DELTA_GAIN) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Write a random adapter on the linears ``{key: (in, out)}`` whose key ends in one of ``targets``;
    returns ``{key: (A, B)}`` (fp32) for a reference computation."""
    g = torch.Generator().manual_seed(seed)
    scale = lora_scale(r, alpha, rslora)
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for key in sorted(linears):
        if key.split(".")[-1] not in targets:
            continue
        n_in, n_out = linears[key]
        a, b = random_pair(n_in, n_out, r, scale, g, gain=gain)
        pairs[key] = (a.to(dtype).float(), b.to(dtype).float())
        tensors[f"base_model.model.{key}.lora_A.weight"] = a.to(dtype)
        tensors[f"base_model.model.{key}.lora_B.weight"] = b.to(dtype)
    write_adapter(directory, tensors, {"r": r, "lora_alpha": alpha, "use_rslora": rslora,
                                       "target_modules": list(targets)})
    return pairs
