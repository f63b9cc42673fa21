"""Model configuration: pydantic models over HF ``config.json`` and friends, RoPE normalised.

``Config.from_directory(path)`` reads ``config.json`` (required), ``generation_config.json`` and
``tokenizer_config.json`` (optional), resolves the architecture through the plugin registry and
normalises every RoPE spelling (``rope_scaling`` of transformers 4, ``rope_parameters`` of
transformers 5, ``type``/``rope_type``) into one :class:`RopeSettings`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from exl3_core.plugins.specs import ArchSpec

RopeType = Literal["default", "linear", "dynamic", "yarn", "llama3", "longrope"]


class ConfigError(ValueError):
    """A model configuration file is missing, unreadable or inconsistent."""


class RopeSettings(BaseModel):
    """Normalised rotary embedding settings (one shape for every HF spelling)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: RopeType = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None
    # llama3-style frequency-band scaling
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # YaRN
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # which part of each head rotates, and how pairs are laid out
    partial_rotary_factor: float = 1.0
    interleaved: bool = False

    @field_validator("theta", "factor")
    @classmethod
    def _positive(cls, v: float) -> float:
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"must be a positive finite number, got {v}")
        return v

    def rotary_dim(self, head_dim: int) -> int:
        d = int(head_dim * self.partial_rotary_factor)
        return d - (d % 2)


def normalise_rope(hf: dict[str, Any], *, interleaved: bool = False, partial_rotary_factor: float | None = None,
                   theta_key: str = "rope_theta") -> RopeSettings:
    """Build :class:`RopeSettings` from a raw HF config dict (any transformers version)."""
    params: dict[str, Any] = {}
    for key in ("rope_parameters", "rope_scaling"):
        v = hf.get(key)
        if isinstance(v, dict):
            # transformers 5 may nest per-layer-type parameters: take the full-attention entry
            if "full_attention" in v and isinstance(v["full_attention"], dict):
                v = v["full_attention"]
            params.update(v)
    rtype = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rtype == "su":
        rtype = "longrope"
    if rtype == "mrope":
        rtype = "default"
    theta = params.pop("rope_theta", None) or hf.get(theta_key) or 10000.0
    prf = partial_rotary_factor if partial_rotary_factor is not None else params.pop(
        "partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    params.pop("partial_rotary_factor", None)
    known = set(RopeSettings.model_fields)
    kwargs = {k: v for k, v in params.items() if k in known and v is not None}
    try:
        return RopeSettings(type=rtype, theta=float(theta), partial_rotary_factor=float(prf),
                            interleaved=interleaved, max_position_embeddings=hf.get("max_position_embeddings"),
                            **kwargs)
    except ValidationError as e:
        raise ConfigError(f"invalid RoPE settings {dict(type=rtype, theta=theta, **params)}: {e}") from None


class QuantizationConfig(BaseModel):
    """The ``quantization_config`` block of an EXL3 checkpoint (format spec 1.7)."""

    model_config = ConfigDict(extra="allow")

    quant_method: str
    version: str | None = None
    bits: float | None = None
    head_bits: int | None = None
    calibration: dict[str, Any] | None = None
    out_scales: str | None = None
    codebook: str | None = None


class HFConfig(BaseModel):
    """Typed view of the common ``config.json`` keys; everything else stays in ``extra``."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    architectures: list[str] = Field(default_factory=list)
    model_type: str | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    quantization_config: QuantizationConfig | None = None

    def get(self, key: str, default: Any = None) -> Any:
        """Any key of config.json (typed or extra)."""
        if key in type(self).model_fields:
            return getattr(self, key)
        return (self.model_extra or {}).get(key, default)


class GenerationConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    do_sample: bool | None = None


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.exists():
        if required:
            raise ConfigError(f"{path} not found: a model directory needs a config.json (is {path.parent} the right folder?)")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); re-download or fix the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must contain a JSON object, found {type(data).__name__}")
    return data


class Config:
    """A model directory's configuration, with its architecture resolved through the plugins."""

    def __init__(self, directory: Path, hf: dict[str, Any], *, generation: dict[str, Any] | None = None,
                 tokenizer_config: dict[str, Any] | None = None, plugins: Any = None) -> None:
        from exl3_core.plugins import get_plugins

        self.directory = Path(directory)
        self.raw = hf
        self.plugins = plugins if plugins is not None else get_plugins()
        try:
            self.hf = HFConfig.model_validate(hf)
        except ValidationError as e:
            raise ConfigError(f"{self.directory / 'config.json'}: {e}") from None
        try:
            self.generation = GenerationConfig.model_validate(generation or {})
        except ValidationError as e:
            raise ConfigError(f"{self.directory / 'generation_config.json'}: {e}") from None
        self.tokenizer_config = tokenizer_config or {}
        if not self.hf.architectures:
            raise ConfigError(f"{self.directory / 'config.json'} has no 'architectures' entry; add e.g. "
                              f'"architectures": ["<Name>ForCausalLM"]')
        self.arch_name = self.hf.architectures[0]
        self.arch: ArchSpec = self.plugins.arch(self.arch_name, hf, self.directory)

    @classmethod
    def from_directory(cls, path: str | Path, plugins: Any = None) -> Config:
        d = Path(path).expanduser()
        if not d.is_dir():
            raise ConfigError(f"model directory {d} does not exist or is not a directory")
        hf = _read_json(d / "config.json", True)
        assert hf is not None
        return cls(d, hf, generation=_read_json(d / "generation_config.json", False),
                   tokenizer_config=_read_json(d / "tokenizer_config.json", False), plugins=plugins)

    @property
    def quantization(self) -> QuantizationConfig | None:
        return self.hf.quantization_config

    def model_class(self) -> type:
        return self.plugins.resolve(self.arch.model, what=f"model class for {self.arch_name}")

    def eos_token_ids(self) -> list[int]:
        out: list[int] = []
        for src in (self.generation.eos_token_id, self.hf.eos_token_id):
            if src is None:
                continue
            for i in src if isinstance(src, list) else [src]:
                if i not in out:
                    out.append(i)
        return out

    def __repr__(self) -> str:
        return f"Config({str(self.directory)!r}, arch={self.arch_name!r})"
