"""Resumable conversion: interrupted (by the test hook, and by a real SIGKILL) and resumed, the output
directory is byte-identical to an uninterrupted run; resuming with other arguments fails clearly."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from convert_tiny import build_tiny

from exl3_core.convert.pipeline import convert
from exl3_core.convert.workdir import ResumeError

BPW = 4.0
CAL = {"cal_rows": 4, "cal_cols": 32}
ROOT = Path(__file__).resolve().parents[2]


def _convert(src: Path, out: Path, **kw: object) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer in the tiny model: random calibration rows
        return convert(src, out, kw.pop("bpw", BPW), progress=False, report=lambda s: None, **CAL, **kw)  # type: ignore[arg-type]


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("resume")
    src = build_tiny("LlamaForCausalLM", tmp / "src", layers=2)
    _convert(src, tmp / "full")
    return src, _files(tmp / "full")


def test_stop_and_resume_is_byte_identical(setup: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    src, full = setup
    work = tmp_path / "work"
    res = _convert(src, tmp_path / "out", work_dir=work, _stop_after_module=1)
    assert not res.completed and not (tmp_path / "out").exists()
    job = json.loads((work / "job.json").read_text())
    assert job["done"] == 2 and (work / job["states"]).is_file()
    res = _convert(src, tmp_path / "out", work_dir=work, resume=True)
    assert res.completed
    assert sorted(_files(tmp_path / "out")) == sorted(full)
    for name, data in _files(tmp_path / "out").items():
        assert data == full[name], f"{name} differs after stop+resume"
    assert not list(work.glob("states-*.safetensors")), "finished jobs keep no hidden states"


def test_sigkill_and_resume_is_byte_identical(setup: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    src, full = setup
    work, out = tmp_path / "work", tmp_path / "out"
    cmd = [sys.executable, "-m", "exl3_core", "convert", "-i", str(src), "-o", str(out), "-b", str(BPW),
           "-w", str(work), "--cal-rows", str(CAL["cal_rows"]), "--cal-cols", str(CAL["cal_cols"]), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    killed = False
    while proc.poll() is None and time.monotonic() < deadline:
        job = work / "job.json"
        if job.is_file() and json.loads(job.read_text()).get("done", 0) >= 2:
            proc.send_signal(signal.SIGKILL)  # mid-way through the second block
            killed = True
            break
        time.sleep(0.01)
    proc.wait(timeout=60)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if not killed:
        pytest.fail(f"conversion ended (rc {proc.returncode}) before it could be killed: {err[-2000:]}")
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists() or not (out / "model.safetensors").exists()
    rc = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert rc.returncode == 0, rc.stderr[-3000:]
    assert "resuming" in rc.stderr
    for name, data in _files(out).items():
        assert data == full[name], f"{name} differs after SIGKILL+resume"
    assert sorted(_files(out)) == sorted(full)


def test_resume_with_other_arguments_fails(setup: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    src, _ = setup
    work = tmp_path / "work"
    _convert(src, tmp_path / "out", work_dir=work, _stop_after_module=0)
    with pytest.raises(ResumeError) as e:
        _convert(src, tmp_path / "out", work_dir=work, resume=True, bpw=3.0, codebook="mcg")
    msg = str(e.value)
    assert "bpw: was 4.0, now 3.0" in msg and "codebook: was 'mul1', now 'mcg'" in msg and "head_bits" not in msg
    with pytest.raises(ResumeError, match="--resume"):
        _convert(src, tmp_path / "out", work_dir=work)


def test_error_propagation_stop_and_resume_is_byte_identical(setup: tuple[Path, dict[str, bytes]],
                                                             tmp_path: Path) -> None:
    """With --propagate the work directory checkpoints both models' states; a resumed run still
    writes exactly what an uninterrupted one does, and the weights differ from the plain run."""
    src, plain = setup
    full = tmp_path / "full"
    _convert(src, full, propagate=0.5)
    work = tmp_path / "work"
    res = _convert(src, tmp_path / "out", work_dir=work, _stop_after_module=2, propagate=0.5)
    assert not res.completed
    job = json.loads((work / "job.json").read_text())
    from safetensors.torch import load_file

    states = load_file(str(work / job["states"]))["states"]
    assert states.dim() == 4 and states.shape[0] == 2  # [quantized, unquantized] states
    assert not torch.equal(states[0], states[1])
    res = _convert(src, tmp_path / "out", work_dir=work, resume=True, propagate=0.5)
    assert res.completed
    assert _files(tmp_path / "out") == _files(full)
    assert _files(full)["model.safetensors"] != plain["model.safetensors"]
