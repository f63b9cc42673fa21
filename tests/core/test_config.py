"""Config: HF config.json parsing, RoPE normalisation, and errors that name the problem."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from exl3_core.archkit.config import Config, ConfigError, normalise_rope
from exl3_core.plugins import UnknownArchitecture


@pytest.mark.parametrize("hf, want", [
    ({"rope_theta": 5e5}, dict(type="default", theta=5e5)),
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}, dict(type="default", theta=1e4)),
    ({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}, dict(type="linear", factor=2.0)),
    ({"rope_theta": 1e4, "rope_scaling": {"rope_type": "dynamic", "factor": 3.0}}, dict(type="dynamic", factor=3.0)),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "original_max_position_embeddings": 4096,
                          "beta_fast": 16, "mscale": 0.707}},
     dict(type="yarn", factor=4.0, theta=1e6, original_max_position_embeddings=4096, beta_fast=16, mscale=0.707)),
    ({"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     dict(type="llama3", factor=8.0, high_freq_factor=4.0, original_max_position_embeddings=8192)),
    ({"rope_theta": 1e4, "partial_rotary_factor": 0.5}, dict(partial_rotary_factor=0.5)),
])
def test_rope_normalised(hf: dict, want: dict) -> None:
    r = normalise_rope(hf)
    for k, v in want.items():
        assert getattr(r, k) == pytest.approx(v), k


def test_rope_rotary_dim_and_errors() -> None:
    assert normalise_rope({"partial_rotary_factor": 0.25}).rotary_dim(128) == 32
    with pytest.raises(ConfigError, match="invalid RoPE settings"):
        normalise_rope({"rope_scaling": {"type": "linear", "factor": -1.0}})


def _write(d: Path, cfg: dict | str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return d


def test_unknown_architecture_names_it(tmp_path: Path, plugins) -> None:
    d = _write(tmp_path / "m", {"architectures": ["FrobnicatorForCausalLM"], "hidden_size": 8})
    with pytest.raises(UnknownArchitecture, match="'FrobnicatorForCausalLM'.*installed architectures"):
        Config.from_directory(d, plugins=plugins)


def test_missing_and_broken_files(tmp_path: Path, plugins) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        Config.from_directory(tmp_path / "nope", plugins=plugins)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="config.json not found"):
        Config.from_directory(tmp_path / "empty", plugins=plugins)
    d = _write(tmp_path / "bad", '{"architectures": ["X"], ')
    with pytest.raises(ConfigError, match=r"bad[/\\]config.json is not valid JSON"):
        Config.from_directory(d, plugins=plugins)
    d = _write(tmp_path / "noarch", {"hidden_size": 8})
    with pytest.raises(ConfigError, match="no 'architectures' entry"):
        Config.from_directory(d, plugins=plugins)
    d = _write(tmp_path / "badtype", {"architectures": ["X"], "hidden_size": "wide"})
    with pytest.raises(ConfigError, match="hidden_size"):
        Config.from_directory(d, plugins=plugins)


def test_golden_config_reads(plugins_with_dummy_llama=None) -> None:
    from exl3_core.plugins import load_plugins

    d = Path(__file__).resolve().parents[1] / "data" / "exl3-golden" / "exl3" / "model_c_exl3_3.0bpw_mul1"
    if not d.exists():
        pytest.skip("golden data not vendored yet")
    cfg = Config.from_directory(d, plugins=load_plugins())
    assert cfg.arch_name == "LlamaForCausalLM"
    q = cfg.quantization
    assert q is not None and q.quant_method == "exl3" and q.head_bits == 6
    assert cfg.eos_token_ids() == [2]
