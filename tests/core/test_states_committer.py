"""The converter's background commit (states file, then job.json) on the host."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from exl3_core.convert.workdir import Job, StatesCommitter, WorkDir


def _job() -> Job:
    return Job(args={"bpw": 4.0}, source={"a.safetensors": 1}, bits={"x": 4}, done=0,
               stages=[{"name": "embed", "metrics": {}}])


def test_commit_writes_states_then_a_snapshot_of_the_job(tmp_path: Path) -> None:
    work = WorkDir(tmp_path)
    c = StatesCommitter(work)
    job = _job()
    x = torch.randn(3, 5, 7)
    job.done = 1
    c.submit(job, 0, [x])
    job.stages.append({"name": "later", "metrics": {}})  # after submit: must not reach this commit
    job.done = 2
    c.wait()
    saved = json.loads(work.job_file.read_text())
    assert saved["done"] == 1 and saved["states"] == "states-0000.safetensors"
    assert [s["name"] for s in saved["stages"]] == ["embed"]
    assert torch.equal(load_file(str(tmp_path / saved["states"]))["states"], x)


def test_later_commit_replaces_states_and_stacks_pairs(tmp_path: Path) -> None:
    work = WorkDir(tmp_path)
    c = StatesCommitter(work)
    job = _job()
    a, b = torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    job.done = 1
    c.submit(job, 0, [a])
    job.done = 2
    c.submit(job, 1, [a, b])  # waits for the first commit, then writes [quantized, unquantized]
    c.wait()
    assert sorted(p.name for p in tmp_path.glob("states-*")) == ["states-0001.safetensors"]
    got = work.load_states(json.loads(work.job_file.read_text())["states"])
    assert torch.equal(got, torch.stack([a, b]))
    job.done = 3
    c.submit(job, None, [a])  # the last stage: no states, old ones dropped
    c.wait()
    assert json.loads(work.job_file.read_text())["states"] is None
    assert not list(tmp_path.glob("states-*"))


def test_a_failed_write_is_raised_by_wait_and_keeps_the_old_commit(tmp_path: Path) -> None:
    work = WorkDir(tmp_path)
    c = StatesCommitter(work)
    job = _job()
    job.done = 1
    c.submit(job, 0, [torch.zeros(2, 2)])
    c.wait()
    (tmp_path / "states-0001.safetensors").mkdir()  # a directory where the file must go: the write fails
    job.done = 2
    c.submit(job, 1, [torch.ones(2, 2)])
    with pytest.raises(OSError):
        c.wait()
    saved = json.loads(work.job_file.read_text())
    assert saved["done"] == 1 and saved["states"] == "states-0000.safetensors"
    assert torch.equal(work.load_states(saved["states"]), torch.zeros(2, 2))
    c.wait()  # the error is reported once


def test_resume_check_reads_options_missing_from_an_older_job_as_their_defaults(tmp_path: Path) -> None:
    from exl3_core.convert.workdir import RESULT_ARGS, ResumeError

    work = WorkDir(tmp_path)
    now = {k: None for k in RESULT_ARGS} | {"bpw": 4.0, "refit_final": 0.0}
    old = {k: v for k, v in now.items() if k != "refit_final"}  # written before the option existed
    job = Job(args=old, source={"a": 1})
    work.check_resume(job, now, {"a": 1}, defaults={"refit_final": 0.0})
    with pytest.raises(ResumeError, match="refit_final: was 0.0, now 0.5"):
        work.check_resume(job, now | {"refit_final": 0.5}, {"a": 1}, defaults={"refit_final": 0.0})
    with pytest.raises(ResumeError, match="bpw: was 4.0, now 3.0"):
        work.check_resume(job, now | {"bpw": 3.0}, {"a": 1}, defaults={"refit_final": 0.0})
