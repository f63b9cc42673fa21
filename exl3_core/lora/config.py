"""``adapter_config.json`` of a PEFT LoRA folder: what exl3 reads, what it refuses, and why.

Read: ``r``, ``lora_alpha``, ``use_rslora`` (scale ``alpha / sqrt(r)`` instead of ``alpha / r``),
``rank_pattern``/``alpha_pattern`` (per-module overrides, matched as PEFT matches them),
``target_modules`` (checked against the model), ``fan_in_fan_out`` (PEFT itself turns it off for
``nn.Linear`` targets, and every exl3 linear is one, so the tensors are read the same either way),
``lora_dropout`` (training only: ignored), ``base_model_name_or_path`` (named in errors).

``target_parameters``: LoRA on transformers' fused 3-D expert tensors (``gate_up_proj``/``down_proj``),
which exl3 applies to the per-expert linears (:class:`~exl3_core.lora.peft_io.FusedParam`).

Refused with a clear error: other PEFT types, DoRA, LoRA biases, ``modules_to_save`` (full copies of
modules, not low-rank deltas), layer replication.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
LEGACY_WEIGHTS_FILE = "adapter_model.bin"


class LoraError(ValueError):
    """A LoRA adapter cannot be loaded, selected or merged; the message names the file, tensor or
    adapter and the fix."""


@dataclass(frozen=True)
class AdapterConfig:
    """The parts of a PEFT LoRA config that decide the maths (see the module docstring).

    :param path: the ``adapter_config.json`` it was read from (for messages).
    """

    path: Path
    r: int
    alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str | None = None
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    fan_in_fan_out: bool = False
    base_model: str | None = None
    target_parameters: tuple[str, ...] = ()

    @staticmethod
    def _pattern(patterns: Mapping[str, Any], key: str) -> str | None:
        # PEFT's rule: a pattern names the whole module path or a dotted suffix of it (a regex)
        for p in patterns:
            if re.match(rf"(.*\.)?({p})$", key):
                return p
        return None

    def rank_of(self, key: str) -> int:
        """The rank the config gives module ``key`` (``rank_pattern`` over ``r``)."""
        p = self._pattern(self.rank_pattern, key)
        return int(self.rank_pattern[p]) if p is not None else self.r

    def scale_of(self, key: str) -> float:
        """The factor PEFT multiplies module ``key``'s ``B A x`` by: ``alpha / r`` (rsLoRA: ``alpha / sqrt(r)``)."""
        r = self.rank_of(key)
        p = self._pattern(self.alpha_pattern, key)
        alpha = float(self.alpha_pattern[p]) if p is not None else self.alpha
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, key: str) -> bool:
        """Whether ``target_modules`` names module ``key`` (PEFT's matching; None or ``all-linear``: any)."""
        t = self.target_modules
        if t is None or t == "all-linear":
            return True
        if isinstance(t, str):
            return re.fullmatch(t, key) is not None
        return any(key == name or key.endswith("." + name) for name in t)

    def targets_parameter(self, key: str) -> bool:
        """Whether ``target_parameters`` names the parameter ``key`` (e.g. fused expert tensors)."""
        return any(key == name or key.endswith("." + name) for name in self.target_parameters)


def check_choice(loras: object, what: str = "loras") -> dict[str, float]:
    """``loras`` as a ``{name: weight}`` dict (None: empty).

    :raises TypeError, ValueError: naming ``what``, for anything but names mapped to finite numbers."""
    if loras is None:
        return {}
    if not isinstance(loras, Mapping):
        raise TypeError(f"{what}={loras!r}: expected a mapping of adapter names to weights, e.g. {{'name': 1.0}}")
    out: dict[str, float] = {}
    for k, v in loras.items():
        if not isinstance(k, str) or not k:
            raise TypeError(f"{what}: adapter name {k!r} is not a non-empty string")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{what}[{k!r}] = {v!r}: the weight must be a finite number (1.0: as trained)")
        out[k] = float(v)
    return out


def _num(cfg: Mapping[str, Any], name: str, path: Path, kind: type, default: Any = None) -> Any:
    v = cfg.get(name, default)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)):
        raise LoraError(f"{path}: {name!r} is {v!r}; PEFT writes a {'positive integer' if kind is int else 'number'} "
                        f"there. The file is damaged or not a LoRA config")
    return kind(v)


def read_config(folder: Path) -> AdapterConfig:
    """Parse and check ``folder/adapter_config.json``.

    :raises LoraError: a missing or unreadable file, an adapter type or feature exl3 does not run
        (naming the field and what to do).
    """
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoraError(f"{path}: not found; a PEFT LoRA folder holds {CONFIG_FILE} and {WEIGHTS_FILE} "
                        f"(saved by peft's save_pretrained)")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraError(f"{path}: cannot be read as JSON ({e}); re-download or re-save the adapter") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{path}: holds a {type(cfg).__name__}, not a JSON object; it is not a PEFT config")
    ptype = str(cfg.get("peft_type", "LORA")).upper()
    if ptype != "LORA":
        raise LoraError(f"{path}: peft_type is {ptype!r}; exl3 runs LoRA adapters only")
    refusals = {
        "use_dora": "DoRA adapters (weight-decomposed) need the base weight's column norms, which EXL3 linears "
                    "do not keep; merge the adapter with peft and convert the merged model instead",
        "lora_bias": "LoRA biases are not supported; merge the adapter with peft and convert the merged model",
        "modules_to_save": "modules_to_save replaces whole modules (not a low-rank delta); merge the adapter "
                           "with peft and convert the merged model",
        "layer_replication": "layer replication changes the model's layer stack; it is not supported",
    }
    for name, why in refusals.items():
        if cfg.get(name):
            raise LoraError(f"{path}: {name} = {cfg[name]!r}: {why}")
    bias = cfg.get("bias", "none")
    if bias not in (None, "none"):
        raise LoraError(f"{path}: bias = {bias!r}: adapters that train biases are not supported (only bias='none')")
    r = _num(cfg, "r", path, int)
    if r < 1:
        raise LoraError(f"{path}: r = {r}; the rank must be at least 1")
    alpha = _num(cfg, "lora_alpha", path, float, default=8)
    targets = cfg.get("target_modules")
    if targets is not None and not isinstance(targets, str):
        if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
            raise LoraError(f"{path}: target_modules = {targets!r}; expected a list of module names or a regex")
        targets = tuple(targets)
    params = cfg.get("target_parameters") or []
    if not isinstance(params, (list, tuple)) or not all(isinstance(t, str) for t in params):
        raise LoraError(f"{path}: target_parameters = {params!r}; expected a list of parameter names")
    patterns: dict[str, dict[str, Any]] = {}
    for name in ("rank_pattern", "alpha_pattern"):
        v = cfg.get(name) or {}
        if not isinstance(v, dict) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v.values()):
            raise LoraError(f"{path}: {name} = {v!r}; expected a mapping of module patterns to numbers")
        patterns[name] = v
    if any(int(x) != x or x < 1 for x in patterns["rank_pattern"].values()):
        raise LoraError(f"{path}: rank_pattern = {patterns['rank_pattern']!r}; ranks must be positive integers")
    base = cfg.get("base_model_name_or_path")
    return AdapterConfig(path=path, r=r, alpha=alpha, use_rslora=bool(cfg.get("use_rslora", False)),
                         target_modules=targets, rank_pattern={k: int(v) for k, v in patterns["rank_pattern"].items()},
                         alpha_pattern={k: float(v) for k, v in patterns["alpha_pattern"].items()},
                         fan_in_fan_out=bool(cfg.get("fan_in_fan_out", False)),
                         base_model=base if isinstance(base, str) else None, target_parameters=tuple(params))
