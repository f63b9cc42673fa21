"""Memory accounting of Model.load: the dry-run plan equals the bytes a real load holds."""
from __future__ import annotations

import pytest
import torch

from exl3_core.archkit.memory import (
    InsufficientDeviceMemory,
    check_fits,
    measure_loaded,
    weight_bytes_required,
)
from exl3_core.bench.models import RandomSource, bench_plugins, parse_shape
from exl3_core.cache import Cache


def _model(head_bits: int | None):
    from exl3_core.archkit import Config, Model

    shape = parse_shape("custom(256,384,2,4,2,700)")
    plugins = bench_plugins()
    src = RandomSource(shape, 4.0, head_bits, "mcg")
    return Model.from_config(Config(src.directory, shape.hf_config(), plugins=plugins)), src, plugins


@pytest.mark.parametrize("head_bits", [6, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_plan_matches_loaded_bytes(head_bits: int | None, dtype: torch.dtype) -> None:
    model, src, plugins = _model(head_bits)
    planned = weight_bytes_required(model, src, dtype)
    assert not any(t is not None and t.device.type == "meta" for m in model.modules() for t in m._buffers.values())
    cache = Cache(model, 300, page_size=16, plugins=plugins)
    model.load(dtype=dtype, source=src, caches=[cache])
    # independent count: every distinct storage the loaded modules reference
    ptrs = {}
    for m in model.modules():
        for t in list(m._buffers.values()) + list(m._parameters.values()):
            if t is not None:
                ptrs[(t.untyped_storage().data_ptr(), t.storage_offset())] = t.numel() * t.element_size()
    assert planned == sum(ptrs.values())
    rep = model.memory_report()
    assert rep["planned"]["weights"] == planned == rep["allocated"]["weights"]
    assert rep["planned"]["caches"] == cache.storage_size() == rep["allocated"]["caches"] > 0
    assert measure_loaded(model, caches=[cache])["total"] == rep["allocated"]["total"]
    model.unload()
    with pytest.raises(RuntimeError, match="not loaded"):
        model.memory_report()


def test_refusal_message_names_both_figures() -> None:
    plan = {"weights": 3 << 30, "caches": 2 << 30, "total": 5 << 30}
    with pytest.raises(InsufficientDeviceMemory) as e:
        check_fits(plan, free=4 << 30, total=80 << 30, what="model X", device="cuda:0")
    msg = str(e.value)
    assert "5.00 GiB" in msg and "3.00 GiB" in msg and "2.00 GiB" in msg and "4.00 GiB" in msg and "model X" in msg
    check_fits(plan, free=6 << 30, total=80 << 30, what="model X", device="cuda:0")
