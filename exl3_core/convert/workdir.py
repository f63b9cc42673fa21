"""The conversion's work directory: everything needed to resume after a crash or a kill.

Layout::

    job.json                 arguments, source fingerprint, bit allocation, finished stages
    calibration.safetensors  the calibration token ids (made once)
    stages/NNNN.safetensors  the output tensors of finished stage NNNN
    states-NNNN.safetensors  hidden states after stage NNNN (only the newest is kept)

Every file is written to a temporary name and renamed, and ``job.json`` is written *last* after a
stage: a kill at any point leaves either the previous consistent checkpoint or the new one.
States files carry the stage number in their name, so ``job.json`` never points at states of a
stage it does not record as finished.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from exl3_core.convert.compile import write_json_atomic
from exl3_core.loader import save_tensors

JOB_FILE = "job.json"
JOB_FORMAT = 1
#: arguments that change the quantized tensors; a resumed job must use the same values
RESULT_ARGS = ("in_dir", "bpw", "head_bits", "codebook", "out_scales", "cal_rows", "cal_cols", "device", "seed",
               "text", "cal_random", "propagate", "refit_scales",
               "refit_propagate", "tf32", "sequential")


class ResumeError(ValueError):
    """The work directory cannot be resumed with these arguments (the message says why and what to do)."""


@dataclass
class Job:
    """The persistent state of one conversion (``job.json``)."""

    args: dict[str, Any]
    source: dict[str, int]
    bits: dict[str, int] = field(default_factory=dict)
    done: int = 0
    states: str | None = None
    stages: list[dict[str, Any]] = field(default_factory=list)  # per finished stage: name, file, storage, metrics

    def to_json(self) -> dict[str, Any]:
        return {"format": JOB_FORMAT, "args": self.args, "source": self.source, "bits": self.bits,
                "done": self.done, "states": self.states, "stages": self.stages}


class WorkDir:
    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def job_file(self) -> Path:
        return self.path / JOB_FILE

    def exists(self) -> bool:
        return self.job_file.is_file()

    def stage_file(self, index: int) -> Path:
        return self.path / "stages" / f"{index:04d}.safetensors"

    def states_file(self, name: str) -> Path:
        return self.path / name

    # -- job --------------------------------------------------------------------------------------
    def load_job(self) -> Job:
        try:
            data = json.loads(self.job_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ResumeError(f"{self.job_file} is unreadable ({e}); delete the work directory {self.path} and "
                              f"start over") from None
        if data.get("format") != JOB_FORMAT:
            raise ResumeError(f"{self.job_file} has format {data.get('format')!r}, this exl3 writes {JOB_FORMAT}; "
                              f"delete the work directory {self.path} and start over")
        return Job(args=data["args"], source=data["source"], bits=data["bits"], done=data["done"],
                   states=data["states"], stages=data["stages"])

    def save_job(self, job: Job) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(job.to_json(), self.job_file, indent=1)

    def check_resume(self, job: Job, args: dict[str, Any], source: dict[str, int]) -> None:
        """Raise :class:`ResumeError` naming every argument that differs from the interrupted run."""
        diffs = [f"{k}: was {job.args.get(k)!r}, now {args.get(k)!r}" for k in RESULT_ARGS
                 if job.args.get(k) != args.get(k)]
        if diffs:
            raise ResumeError(f"cannot resume the conversion in {self.path} with different arguments ("
                              + "; ".join(diffs) + "). Rerun with the original arguments, or without --resume and "
                              "with a new or empty work directory")
        if job.source != source:
            changed = sorted(set(job.source.items()) ^ set(source.items()))
            raise ResumeError(f"the source model in {args.get('in_dir')} changed since the interrupted run (files "
                              f"{sorted({n for n, _ in changed})}); delete the work directory {self.path} and "
                              f"start over")

    # -- tensors ----------------------------------------------------------------------------------
    def save_calibration(self, ids: torch.Tensor) -> None:
        save_tensors({"input_ids": ids.contiguous()}, self.path / "calibration.safetensors")

    def load_calibration(self) -> torch.Tensor | None:
        p = self.path / "calibration.safetensors"
        if not p.is_file():
            return None
        from safetensors.torch import load_file

        return load_file(str(p))["input_ids"]

    def save_stage(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        save_tensors(tensors, self.stage_file(index))

    def save_states(self, index: int, states: torch.Tensor) -> str:
        name = f"states-{index:04d}.safetensors"
        save_tensors({"states": states.contiguous()}, self.path / name)
        return name

    def load_states(self, name: str) -> torch.Tensor:
        from safetensors.torch import load_file

        p = self.path / name
        if not p.is_file():
            raise ResumeError(f"{p} (the hidden states {JOB_FILE} points at) is missing; delete the work directory "
                              f"{self.path} and start over")
        return load_file(str(p))["states"]

    def drop_old_states(self, keep: str | None) -> None:
        for p in self.path.glob("states-*.safetensors"):
            if p.name != keep:
                p.unlink(missing_ok=True)
