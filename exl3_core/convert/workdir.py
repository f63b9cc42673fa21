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

import copy
import json
import threading
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
               "refit_propagate", "tf32", "sequential",
               "refit_final")


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

    @classmethod
    def for_output(cls, out_dir: str | Path, work_dir: str | Path | None) -> WorkDir:
        """The work directory of a conversion into ``out_dir``: ``work_dir``, or ``<out_dir>.work``."""
        if work_dir:
            return cls(Path(work_dir).expanduser())
        out = Path(out_dir).expanduser()
        return cls(out.with_name(out.name + ".work"))

    @property
    def job_file(self) -> Path:
        return self.path / JOB_FILE

    def exists(self) -> bool:
        return self.job_file.is_file()

    def stage_file(self, index: int) -> Path:
        return self.path / "stages" / f"{index:04d}.safetensors"

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

    def check_resume(self, job: Job, args: dict[str, Any], source: dict[str, int],
                     defaults: dict[str, Any] | None = None) -> None:
        """Raise :class:`ResumeError` naming every argument that differs from the interrupted run.

        An argument the interrupted run's ``job.json`` does not record (an option added since) counts
        as its ``defaults`` value, which is what that run used."""
        was = {k: job.args[k] if k in job.args else (defaults or {}).get(k) for k in RESULT_ARGS}
        diffs = [f"{k}: was {was[k]!r}, now {args.get(k)!r}" for k in RESULT_ARGS if was[k] != args.get(k)]
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

    @staticmethod
    def states_name(index: int) -> str:
        return f"states-{index:04d}.safetensors"

    def save_states(self, index: int, states: torch.Tensor) -> str:
        name = self.states_name(index)
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


class StatesCommitter:
    """Commits stages (states file, then ``job.json``) on a worker thread while the next stage runs.

    A GPU conversion's states are large (an 8B model's 250 x 2048 rows: 8.4 GB of fp32): copying
    them to pageable host memory and writing them took longer than a stage. Here the device states
    go to a reused pinned host buffer on a side stream (the copy overlaps the next stage's kernels),
    and the worker writes the file and *then* the job snapshot taken at submit time, so the
    crash-consistency rule of this module still holds: ``job.json`` only ever names a complete
    states file of a stage it records as done. At most one commit is in flight; :meth:`wait` joins
    it and re-raises its error.
    """

    def __init__(self, work: WorkDir) -> None:
        self.work = work
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pinned: torch.Tensor | None = None
        self._stream: Any = None

    def submit(self, job: Job, index: int | None, states: list[torch.Tensor]) -> None:
        """Commit ``job`` as it is now; with ``index``, ``states`` (stacked when several) become its
        states file ``states-<index>``. The tensors must not be written to afterwards."""
        self.wait()
        job.states = None if index is None else WorkDir.states_name(index)
        snapshot = copy.deepcopy(job)
        host = self._to_host(states) if index is not None else None
        event = None
        if host is not None and host.is_pinned() and self._stream is not None:
            event = torch.cuda.Event()
            event.record(self._stream)
        self._thread = threading.Thread(target=self._commit, args=(snapshot, index, host, event),
                                        name="exl3-convert-commit", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _to_host(self, states: list[torch.Tensor]) -> torch.Tensor:
        if not states[0].is_cuda:  # host states are never written in place: the worker reads them as they are
            return states[0] if len(states) == 1 else torch.stack(states)
        shape = (len(states), *states[0].shape) if len(states) > 1 else tuple(states[0].shape)
        if self._pinned is None or tuple(self._pinned.shape) != shape or self._pinned.dtype != states[0].dtype:
            self._pinned = None
            try:
                self._pinned = torch.empty(shape, dtype=states[0].dtype, pin_memory=True)
            except RuntimeError:  # no page-locked memory to spare: a plain (slow, blocking) copy
                return torch.stack([s.cpu() for s in states]) if len(states) > 1 else states[0].cpu()
        if self._stream is None:
            self._stream = torch.cuda.Stream(states[0].device)
        dst = [self._pinned] if len(states) == 1 else list(self._pinned.unbind(0))
        self._stream.wait_stream(torch.cuda.current_stream(states[0].device))
        with torch.cuda.stream(self._stream):
            for d, s in zip(dst, states, strict=True):
                d.copy_(s, non_blocking=True)
                s.record_stream(self._stream)  # the allocator must not hand s out before the copy ends
        return self._pinned

    def _commit(self, job: Job, index: int | None, host: torch.Tensor | None, event: Any) -> None:
        try:
            if event is not None:
                event.synchronize()
            if index is not None and host is not None:
                self.work.save_states(index, host)
            self.work.save_job(job)  # the commit point
            self.work.drop_old_states(job.states)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread by wait()
            self._error = e
