"""``--sequential``: a block's input groups are quantized in forward order, each from a Hessian
captured with the groups before it already quantized; resumable like every conversion."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from convert_tiny import build_tiny

from exl3_core.convert.pipeline import convert
from exl3_core.convert.workdir import ResumeError

CAL = {"cal_rows": 4, "cal_cols": 32}


def _convert(src: Path, out: Path, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer in the tiny model: random calibration rows
        return convert(src, out, 3.0, progress=False, report=lambda s: None, **CAL, **kw)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return build_tiny("LlamaForCausalLM", tmp_path_factory.mktemp("seq") / "src", layers=2)


def test_first_group_unchanged_later_groups_requantized(src: Path, tmp_path: Path) -> None:
    plain: dict[str, Any] = {}
    seq: dict[str, Any] = {}
    _convert(src, tmp_path / "plain", on_quantized=plain.__setitem__)
    _convert(src, tmp_path / "seq", on_quantized=seq.__setitem__, sequential=True)
    assert plain.keys() == seq.keys()
    first = [k for k in plain if k.startswith("model.layers.0.self_attn.") and k[-6:] in ("q_proj", "k_proj", "v_proj")]
    assert len(first) == 3
    for k in first:  # the block's first group: the same Hessian and the same sign seeds as before
        assert torch.equal(plain[k].trellis, seq[k].trellis) and torch.equal(plain[k].svh, seq[k].svh), k
    later = [k for k in plain if k.startswith("model.layers.0.") and k not in first]
    assert later
    for k in later:  # o_proj, gate/up and down_proj now read inputs made by quantized linears
        assert not torch.equal(plain[k].trellis, seq[k].trellis), f"{k} did not see its quantized inputs"


def test_stop_resume_byte_identical_and_changed_flag_refused(src: Path, tmp_path: Path) -> None:
    full = tmp_path / "full"
    _convert(src, full, sequential=True)
    work = tmp_path / "work"
    res = _convert(src, tmp_path / "out", work_dir=work, _stop_after_module=1, sequential=True)
    assert not res.completed
    with pytest.raises(ResumeError, match="sequential: was True, now False"):
        _convert(src, tmp_path / "out", work_dir=work, resume=True)
    res = _convert(src, tmp_path / "out", work_dir=work, resume=True, sequential=True)
    assert res.completed and _files(tmp_path / "out") == _files(full)
