"""``exl3 inspect``: the plan's decisions, cache and attention choices, as text and JSON."""
from __future__ import annotations

import json

import pytest
import torch

from exl3_core import ops
from exl3_core.bench.models import build_model, parse_shape
from exl3_core.cli import main
from exl3_core.plan.cli import inspect_model
from exl3_core.plan.report import Decision, PartReport, compact_report, merge_layer_runs


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


def test_layer_runs_merge_where_the_rest_is_equal() -> None:
    items = ["layer 0: slow", "plain", "layer 1: slow", "layer 2: fast", "layer 3: slow", "layer 5: slow",
             "layer 4: fast", "layer 10 x"]
    assert merge_layer_runs(items) == ["layers 0-1, 3, 5: slow", "plain", "layers 2, 4: fast", "layer 10 x"]
    assert merge_layer_runs(["layer 7: only"]) == ["layer 7: only"]
    assert merge_layer_runs([]) == []


def test_compact_report_prints_equal_layers_once() -> None:
    same = [Decision("fuse", False, ("layer 0: cpu", "layer 1: cpu"))]
    parts = [PartReport("model", "M", list(same)), PartReport("layer 0", "Block", [Decision("a", True)]),
             PartReport("layer 1", "Block", [Decision("a", True)]), PartReport("layer 2", "Block", [Decision("a", False)]),
             PartReport("layer 3", "Other", [Decision("a", False)])]
    assert compact_report(parts) == ["model (M)", "    no  fuse: layers 0-1: cpu", "layers 0-1 (Block)", "    yes a",
                                     "layer 2 (Block)", "    no  a", "layer 3 (Other)", "    no  a"]


def test_inspect_text_is_compact_and_takes_cache_bits(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["inspect", "--shape", "custom(128,256,3,4,2,300)", "--cache-tokens", "256", "--max-batch", "2",
            "--device", "cpu"]
    assert main([*args, "--cache-bits", "8,4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["part"] for p in data["plan"]][2:] == ["layer 0", "layer 1", "layer 2"]  # the data stays per layer
    assert main([*args, "--cache-bits", "8,4"]) == 0
    text = capsys.readouterr().out
    assert "KVQuantLayer" in text and "layers 0-2 decode keys<=256 seqs<=2 q/seq=1" in text
    assert sum(line.startswith("layer") for line in text.splitlines()) < 3  # no block printed once per layer
    assert main([*args, "--cache-bits", "4", "--variant", "other"]) == 1
    err = capsys.readouterr().err
    assert "--variant other" in err and "--cache-bits" in err
