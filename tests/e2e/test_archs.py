"""Every registered architecture with a test_config against transformers, plus suite self-checks.

The parametrization covers plugins written by anyone: whatever ``get_plugins()`` registers with a
``test_config`` runs through :func:`exl3_core.testing.arch.check_variant`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from exl3_core.archkit import Config, Model
from exl3_core.plugins import UnknownArchitecture, get_plugins
from exl3_core.testing import arch

pytest.importorskip("transformers")


def _cases() -> list[Any]:
    cases = []
    for hf_arch, spec in sorted(get_plugins().architectures().items()):
        if spec.test_config is None or hf_arch != spec.hf_arch:  # aliases share the spec's variants
            continue
        try:
            names = sorted(arch.tiny_variants(hf_arch))
        except Exception as e:  # noqa: BLE001 - reported as a failing case, other archs still run
            cases.append(pytest.param(hf_arch, None, repr(e), id=f"{hf_arch}-test_config-error"))
            continue
        cases += [pytest.param(hf_arch, n, None, id=f"{hf_arch}-{n}") for n in names]
    return cases


@pytest.mark.parametrize(("hf_arch", "variant", "error"), _cases())
def test_arch_matches_transformers(hf_arch: str, variant: str | None, error: str | None, tmp_path: Path) -> None:
    if error is not None:
        pytest.fail(f"{hf_arch}: its test_config failed: {error}")
    cfg = arch.tiny_variants(hf_arch)[variant]
    results = arch.check_variant(hf_arch, cfg, tmp_path)
    print(f"{hf_arch}[{variant}]: " + ", ".join(f"{k} {v:.2e}" for k, v in results.items()))


# -- the suite must be able to fail -------------------------------------------------------------

@pytest.fixture(scope="module")
def mistral_window(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, torch.Tensor, torch.Tensor]:
    cfg = arch.tiny_variants("MistralForCausalLM")["window_16"]
    d = tmp_path_factory.mktemp("mistral")
    hf = arch.build_checkpoint("MistralForCausalLM", cfg, d)
    ids = torch.randint(0, cfg.vocab_size, (2, arch.SEQ_LEN), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids).logits
    model = Model.from_config(Config.from_directory(d)).load()
    return model, d, ids, ref


def _err(model: Any, ids: torch.Tensor, ref: torch.Tensor) -> float:
    with torch.no_grad():
        return arch.rel_err(model(ids), ref)


def test_sabotage_is_detected(mistral_window: tuple[Any, Path, torch.Tensor, torch.Tensor]) -> None:
    """Ignoring norm weights, the window or the RoPE layout each breaks the fp32 tolerance."""
    model, _, ids, ref = mistral_window
    assert _err(model, ids, ref) <= arch.FP32_RTOL
    attn = [blk.attn for blk in model.layers]
    norm = model.layers[0].attn_norm
    saved = norm.weight.clone()
    norm.weight.fill_(1.0)
    assert _err(model, ids, ref) > 100 * arch.FP32_RTOL
    norm.weight.copy_(saved)
    for a in attn:
        a.window, a._specs = None, {}
    assert _err(model, ids, ref) > 100 * arch.FP32_RTOL
    for a in attn:
        a.window, a._specs = 16, {}
    model.rope.interleaved = True
    assert _err(model, ids, ref) > 100 * arch.FP32_RTOL
    model.rope.interleaved = False
    assert _err(model, ids, ref) <= arch.FP32_RTOL


def test_logits_indices_select_rows(mistral_window: tuple[Any, Path, torch.Tensor, torch.Tensor]) -> None:
    from exl3_core.archkit import BatchMeta

    model, _, ids, ref = mistral_window
    meta = BatchMeta.full(ids)
    rows = torch.tensor([0, arch.SEQ_LEN - 1, arch.SEQ_LEN + 7, 2 * arch.SEQ_LEN - 1])
    meta.logits_indices = rows
    with torch.no_grad():
        out = model.forward_batch(meta)
    assert out.shape == (4, ref.shape[-1]) and out.dtype == torch.float32
    assert arch.rel_err(out, ref.reshape(-1, ref.shape[-1])[rows]) <= arch.FP32_RTOL


def test_unsupported_architecture_is_named(mistral_window: tuple[Any, Path, torch.Tensor, torch.Tensor],
                                           tmp_path: Path) -> None:
    _, d, _, _ = mistral_window
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FrobnicatorForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnknownArchitecture, match="FrobnicatorForCausalLM") as info:
        Model.from_config(Config.from_directory(tmp_path))
    assert "MistralForCausalLM" in str(info.value)  # the message lists what is installed


def test_base_dispatch_and_load_state(mistral_window: tuple[Any, Path, torch.Tensor, torch.Tensor]) -> None:
    _, d, ids, ref = mistral_window
    model = Model.from_config(Config.from_directory(d))
    assert type(model).__name__ == "MistralModel"
    assert not model.loaded
    with pytest.raises(RuntimeError, match="not loaded"):
        model(ids)
    layers = model.attention_layers()  # available before loading, for cache sizing
    assert [a.cache_index for a in layers] == list(range(len(layers)))
    assert all(a.cache_kind == "kv" and a.num_kv_heads == 2 and a.head_dim == 16 for a in layers)
    model.load()
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    assert _err(model, ids, ref) <= arch.FP32_RTOL
