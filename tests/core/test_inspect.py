"""``exl3 inspect``: the plan's decisions, cache and attention choices, as text and JSON."""
from __future__ import annotations

import json

import pytest
import torch

from exl3_core import ops
from exl3_core.bench.models import build_model, parse_shape
from exl3_core.cli import main
from exl3_core.plan.cli import inspect_model


def test_inspect_reports_every_block_and_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "fused_enabled", lambda t: True)  # what CUDA would say
    model, cache = build_model(parse_shape("custom(256,512,2,4,2,300)"), device="cpu", dtype=torch.float16,
                               cache_tokens=512, page_size=64)
    data = inspect_model(model, cache, max_batch=2)
    parts = [p["part"] for p in data["plan"]]
    assert parts == ["plan", "model", "layer 0", "layer 1"]
    layer0 = {d["name"]: d for d in data["plan"][2]["decisions"]}
    assert layer0["residual add inside the next norm"]["taken"]
    assert not layer0["q/k/v: one launch"]["taken"]  # the compiled kernels are CUDA's
    assert any("CUDA" in w for w in layer0["q/k/v: one launch"]["why"])
    assert data["cache"] and "KVCacheLayer" in data["cache"][0]
    att = data["attention"]
    assert sum("no cache" in a for a in att) == 2 and sum("decode" in a for a in att) == 2 * 2
    assert all(" on " in a or "no backend" in a for a in att)


def test_inspect_command_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--shape", "custom(128,256,1,4,2,300)", "--cache-tokens", "256", "--max-batch", "1",
                 "--device", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device"] == "cpu" and data["plan"][0]["part"] == "plan"
    assert main(["inspect", "--shape", "custom(128,256,1,4,2,300)", "--cache-tokens", "256", "--max-batch", "1",
                 "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "layer 0 (DecoderBlock)" in text and "attention (per layer" in text
