"""``exl3 optimize``: measured bit allocation (measure -> allocate -> compile).

1. **Candidates.** The model is converted once per candidate bitrate K (every tensor at K), with the
   converter's defaults, into ``<work>/cand-K`` (each conversion resumable on its own).
2. **Measure.** On calibration rows (not the evaluation text), the unquantized fp32 model gives the
   reference logits. For every *group* (the linears of a block that read one input: q/k/v, o, gate/up,
   down) and every K, the group alone is swapped for its candidate-K tensors and the mean
   KL(reference ‖ model) per token is measured. Only the blocks from the group's own onward are rerun
   (the unquantized states at each block's input are kept). Saved to ``<work>/measurement.json`` with
   the source fingerprint and the candidate set, so it is reused on resume and refused for another
   model or another candidate set.
3. **Allocate.** The predicted KL of an allocation is the sum of its groups' measured KL (the
   additive model of measured allocation). A K per group is chosen to minimise it subject to the
   budget ``floor(bpw · Σ numel)`` bits over the budgeted tensors (as ``exl3 convert`` counts bpw)
   and, optionally, a total file size: an exact multiple-choice knapsack by dynamic programming.
4. **Convert.** One more sequential conversion with the chosen K per tensor (``exl3 convert``'s
   stage loop and post-pass with the allocation fixed), so every tensor is quantized and refit
   against the inputs of the mixed model it ends up in. With ``--assemble`` the output instead
   takes each group's tensors from its chosen candidate (seconds, no quantizer run): a tensor then
   keeps the fit to its own candidate's upstream layers, which measured worse than the allocation
   gains (docs/quality.md).
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from exl3_core.convert.capture import LinearSlot
from exl3_core.convert.compile import MIB, output_config, quantization_config, write_json_atomic
from exl3_core.convert.stages import Stage, conversion_stages, forward_stage, load_recording, source_fingerprint
from exl3_core.convert.workdir import ResumeError

MEASUREMENT_FILE = "measurement.json"
JOB_FILE = "optimize.json"
FORMAT = 1
#: arguments that change the candidates or the measurement; a resumed job must use the same values
JOB_ARGS = ("in_dir", "candidates", "head_bits", "seed", "device", "measure_rows", "measure_cols", "cal_rows",
            "cal_cols")
BUDGET_UNIT = 128 * 128  # every padded tensor is a multiple of this many weights: the knapsack's unit

Report = Callable[[str], None]


@dataclass(frozen=True)
class Group:
    """Linears of one block reading one input: they get one K (as ``exl3 convert``'s allocation)."""

    name: str
    stage: int
    keys: tuple[str, ...]
    numel: int  # padded weights, the budget's measure


@dataclass
class Measurement:
    """Per group and candidate K: the mean KL(reference ‖ model with only that group at K)."""

    source: dict[str, int]
    candidates: list[int]
    rows: int
    cols: int
    baseline: dict[str, float]  # per K: every group at K (the uniform conversion), for the report
    kl: dict[str, dict[str, float]] = field(default_factory=dict)  # group -> str(K) -> KL

    def save(self, path: Path) -> None:
        write_json_atomic({"format": FORMAT, **asdict(self)}, path, indent=1)

    @classmethod
    def load(cls, path: Path) -> Measurement:
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ResumeError(f"{path} is unreadable ({e}); delete it to measure again") from None
        if d.get("format") != FORMAT:
            raise ResumeError(f"{path} has format {d.get('format')!r}, this exl3 writes {FORMAT}; delete it to "
                              f"measure again")
        d.pop("format")
        return cls(**d)

    def check(self, path: Path, source: dict[str, int], candidates: list[int], groups: list[Group] | None) -> None:
        """Refuse a measurement of another model, candidate set or grouping (the message names the fix)."""
        if self.source != source:
            raise ResumeError(f"{path} was measured on another model (its source files differ from this one's); "
                              f"measure this model (delete the file or choose another work directory)")
        if sorted(self.candidates) != sorted(candidates):
            raise ResumeError(f"{path} measured the bitrates {sorted(self.candidates)}, not {sorted(candidates)}; "
                              f"pass --candidates {','.join(map(str, sorted(self.candidates)))} or delete it")
        if groups is not None and sorted(self.kl) != sorted(g.name for g in groups):
            raise ResumeError(f"{path} measured other tensor groups than this model has; delete it to measure again")


# -- allocation -----------------------------------------------------------------------------------
def allocate(groups: list[Group], measurement: Measurement, budget_bits: int) -> dict[str, int]:
    """The K per group minimising the summed measured KL with ``Σ K·numel <= budget_bits`` (exact DP).

    :raises ValueError: the budget is below every group at the smallest candidate.
    """
    ks = sorted(measurement.candidates)
    units = [g.numel // BUDGET_UNIT for g in groups]
    if any(g.numel % BUDGET_UNIT for g in groups):
        raise ValueError("optimize: a group's padded size is not a multiple of 128x128 weights")
    cap = budget_bits // BUDGET_UNIT
    least = sum(u * ks[0] for u in units)
    if least > cap:
        raise ValueError(f"optimize: the budget ({budget_bits / sum(g.numel for g in groups):.3f} bpw) is below "
                         f"the smallest candidate ({ks[0]} bits); add a smaller candidate or raise the target")
    # dp over the budget left above the all-smallest allocation, in units of BUDGET_UNIT weight-bits
    span = cap - least
    inf = float("inf")
    best = torch.full((span + 1,), inf, dtype=torch.float64)
    best[0] = 0.0
    picks: list[torch.Tensor] = []
    for g, u in zip(groups, units, strict=True):
        kl = measurement.kl[g.name]
        new = torch.full_like(best, inf)
        arg = torch.zeros(span + 1, dtype=torch.int64)
        for i, k in enumerate(ks):
            extra = u * (k - ks[0])
            if extra > span:
                continue
            cand = torch.full_like(best, inf)
            cand[extra:] = best[: span + 1 - extra] + kl[str(k)]
            better = cand < new
            new = torch.where(better, cand, new)
            arg = torch.where(better, torch.full_like(arg, i), arg)
        best = new
        picks.append(arg)
    at = int(torch.argmin(best))
    out: dict[str, int] = {}
    for g, u, arg in zip(reversed(groups), reversed(units), reversed(picks), strict=True):
        i = int(arg[at])
        out[g.name] = ks[i]
        at -= u * (ks[i] - ks[0])
    return out


def predicted_kl(groups: list[Group], measurement: Measurement, alloc: dict[str, int]) -> float:
    return sum(measurement.kl[g.name][str(alloc[g.name])] for g in groups)


# -- groups and candidates ------------------------------------------------------------------------
def model_groups(stages: list[Stage], slots: dict[int, list[LinearSlot]]) -> list[Group]:
    """The budgeted groups: every block's quantized linears by shared input (``slot.group``)."""
    from exl3_core.quant.exl3.hessian import padded_size

    out: list[Group] = []
    for st in stages:
        if st.kind != "block":
            continue
        by: dict[str, list[LinearSlot]] = {}
        for s in slots[st.index]:
            if s.quantize:
                by.setdefault(s.group or s.key, []).append(s)
        for leader, members in by.items():
            out.append(Group(leader, st.index, tuple(s.key for s in members),
                             sum(padded_size(s.in_features) * padded_size(s.out_features) for s in members)))
    return out


def candidate_dir(work: Path, k: int) -> Path:
    return work / f"cand-{k}"


def _finished(out: Path) -> bool:
    return (out / "quantization_config.json").is_file()


@dataclass(frozen=True)
class OptimizeArgs:
    in_dir: str
    out_dir: str
    bpw: float
    work_dir: str
    candidates: tuple[int, ...]
    target_bytes: int | None = None
    head_bits: int = 6
    seed: int = 0
    device: str = "cpu"
    measure_rows: int = 16
    measure_cols: int = 256
    measurement: str | None = None  # a measurement file to reuse instead of <work>/measurement.json
    shard_mib: int = 8192
    cal_rows: int | None = None  # the candidates' calibration (None: exl3 convert's default for the model)
    cal_cols: int | None = None
    assemble: bool = False  # take the chosen tensors from the candidates instead of converting once more

    def validate(self) -> None:
        ks = sorted(set(self.candidates))
        if len(ks) < 2 or any(not 1 <= k <= 8 for k in ks):
            raise ValueError(f"--candidates {','.join(map(str, self.candidates))}: give at least two bitrates in 1..8")
        if not ks[0] <= self.bpw <= ks[-1]:
            raise ValueError(f"--bits {self.bpw}: outside what the candidates {ks} allow; pick a target in "
                             f"[{ks[0]}, {ks[-1]}] or add candidates (--candidates)")
        if self.target_bytes is not None and self.target_bytes <= 0:
            raise ValueError(f"--target-bytes {self.target_bytes}: must be positive")
        if self.measure_rows < 1 or self.measure_cols < 2:
            raise ValueError(f"--measure-rows {self.measure_rows} --measure-cols {self.measure_cols}: need at least "
                             f"1 row of 2 tokens")

    def job(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in JOB_ARGS}
        d["in_dir"] = str(Path(self.in_dir).expanduser().resolve())
        d["candidates"] = sorted(set(self.candidates))
        return d


def default_candidates(bpw: float) -> tuple[int, ...]:
    """floor(bpw) and ceil(bpw), one more on each side where it exists (a spread to trade between)."""
    lo, hi = math.floor(bpw), math.ceil(bpw)
    if hi == lo:
        hi = lo + 1 if lo < 8 else lo
        lo = lo if lo < 8 else lo - 1
    return tuple(k for k in range(max(1, lo - 1), min(8, hi + 1) + 1))


class Optimizer:
    def __init__(self, args: OptimizeArgs, *, report: Report | None = None, progress: bool = True) -> None:
        args.validate()
        self.args = args
        self.report = report or (lambda s: print(s, file=sys.stderr, flush=True))
        self.progress = progress
        self.work = Path(args.work_dir).expanduser()
        self.in_dir = Path(args.in_dir).expanduser()
        self.ks = sorted(set(args.candidates))

    # -- the job file -----------------------------------------------------------------------------
    def _start(self, resume: bool) -> None:
        path = self.work / JOB_FILE
        job = self.args.job()
        if path.is_file():
            was = json.loads(path.read_text(encoding="utf-8"))
            if not resume:
                raise ResumeError(f"the work directory {self.work} holds an optimize job; pass --resume to continue "
                                  f"it, or choose another work directory with -w")
            diffs = [f"{k}: was {was.get(k)!r}, now {job[k]!r}" for k in JOB_ARGS if was.get(k) != job[k]]
            if diffs:
                raise ResumeError(f"cannot resume the optimize job in {self.work} with different arguments ("
                                  + "; ".join(diffs) + "); rerun with the original arguments or another work directory")
            return
        self.work.mkdir(parents=True, exist_ok=True)
        write_json_atomic(job, path, indent=1)

    def _candidates(self) -> None:
        from exl3_core.convert.pipeline import convert

        for k in self.ks:
            out = candidate_dir(self.work, k)
            if _finished(out):
                continue
            wd = self.work / f"cand-{k}.work"
            self.report(f"candidate {k} bits: converting into {out}")
            convert(self.in_dir, out, float(k), head_bits=self.args.head_bits, device=self.args.device,
                    work_dir=wd, resume=(wd / "job.json").is_file(), seed=self.args.seed, report=self.report,
                    cal_rows=self.args.cal_rows, cal_cols=self.args.cal_cols,
                    progress=self.progress)
            shutil.rmtree(wd, ignore_errors=True)

    # -- measurement ------------------------------------------------------------------------------
    def _load_model(self) -> None:
        from exl3_core.archkit import Config, Model
        from exl3_core.convert.capture import find_linears
        from exl3_core.convert.pipeline import probe_groups
        from exl3_core.loader import SafetensorsCollection

        self.config = Config.from_directory(self.in_dir)
        self.model = Model.from_config(self.config)
        self.stages = conversion_stages(self.model)
        self.source = SafetensorsCollection(self.in_dir)
        load_recording(self.model, self.stages, self.source, torch.device(self.args.device))
        self.slots = {st.index: find_linears(st.module) for st in self.stages}
        self.vocab = int(self.config.hf.vocab_size or 0)
        probe_groups(self.model, self.stages, self.slots, self.vocab)
        self.groups = model_groups(self.stages, self.slots)

    def _forward_from(self, start: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        dev = torch.device(self.args.device)
        with torch.no_grad():
            for st in self.stages[start:]:
                x = forward_stage(self.model, st, x.to(dev), ids.to(dev))
        return x.float().cpu()

    def _measure(self) -> Measurement:
        from exl3_core.convert.calibration import calibration_ids
        from exl3_core.convert.dequantized import runtime_linear
        from exl3_core.eval.kld import kl_per_token
        from exl3_core.loader import SafetensorsCollection

        a = self.args
        source = source_fingerprint(self.in_dir)
        path = Path(a.measurement).expanduser() if a.measurement else self.work / MEASUREMENT_FILE
        if path.is_file():
            m = Measurement.load(path)
            m.check(path, source, self.ks, self.groups)
            self.report(f"measurement: reusing {path}")
            return m
        if a.measurement:
            raise FileNotFoundError(f"--measurement {path}: no such file")
        # measurement rows: calibration text and random rows, drawn with a seed the candidates did not use
        ids = calibration_ids(self.in_dir, self.vocab, a.measure_rows, a.measure_cols, seed=a.seed + 7919)
        dev = torch.device(a.device)
        states: list[torch.Tensor] = []  # the unquantized input of every stage
        x: torch.Tensor = ids
        with torch.no_grad():
            for st in self.stages:
                states.append(x)
                x = forward_stage(self.model, st, x.to(dev), ids.to(dev)).float().cpu()
        ref = x
        m = Measurement(source, self.ks, a.measure_rows, a.measure_cols, {}, {g.name: {} for g in self.groups})
        slot_of = {s.key: s for ss in self.slots.values() for s in ss}
        t0 = time.monotonic()
        n, total = 0, len(self.groups) * len(self.ks)
        for k in self.ks:
            with SafetensorsCollection(candidate_dir(self.work, k)) as cand:
                for g in self.groups:
                    originals = {}
                    for key in g.keys:
                        s = slot_of[key]
                        originals[key] = s.parent._modules[s.attr]
                        s.parent._modules[s.attr] = runtime_linear(key, lambda n_: cand.get_tensor(n_) if n_ in cand
                                                                   else None, s.in_features, s.out_features, dev)
                    try:
                        logits = self._forward_from(g.stage, states[g.stage], ids)
                    finally:
                        for key, mod in originals.items():
                            s = slot_of[key]
                            s.parent._modules[s.attr] = mod
                    m.kl[g.name][str(k)] = float(kl_per_token(ref, logits).mean())
                    n += 1
                    self.report(f"  measure [{n}/{total}] {g.name:<44} K={k} KL {m.kl[g.name][str(k)]:.6f} "
                                f"({time.monotonic() - t0:.0f} s)")
            from exl3_core.archkit import Model

            uniform = Model.from_pretrained(candidate_dir(self.work, k), device=a.device)
            with torch.no_grad():
                m.baseline[str(k)] = float(kl_per_token(ref, uniform(ids.to(dev)).float().cpu()).mean())
            del uniform
        m.save(path)
        return m

    # -- compile ----------------------------------------------------------------------------------
    def _fixed_bytes(self) -> int:
        """Bytes of everything a choice of K does not change: the output minus the groups' trellises."""
        from exl3_core.loader import SafetensorsCollection

        keys = {f"{key}.trellis" for g in self.groups for key in g.keys}
        with SafetensorsCollection(candidate_dir(self.work, self.ks[0])) as c:
            total = 0
            for n in c.keys():
                if n not in keys:
                    t = c.get_tensor(n)
                    total += t.numel() * t.element_size()
        return total

    def budget_bits(self) -> int:
        items = sum(g.numel for g in self.groups)
        bits = math.floor(self.args.bpw * items)
        if self.args.target_bytes is not None:
            left = self.args.target_bytes - self._fixed_bytes()
            if left < items * self.ks[0] // 8:
                raise ValueError(f"--target-bytes {self.args.target_bytes}: below the smallest candidate's size "
                                 f"({self._fixed_bytes() + items * self.ks[0] // 8} bytes); raise it or add a smaller "
                                 f"candidate")
            bits = min(bits, 8 * left)
        return bits

    def _compile(self, alloc: dict[str, int], out: Path) -> float:
        from exl3_core import __version__
        from exl3_core.convert.compile import copy_other_files
        from exl3_core.loader import SafetensorsCollection, save_sharded
        from exl3_core.quant.exl3.quantize import tensor_storage_entry

        base_k = min(self.ks, key=lambda k: (abs(k - self.args.bpw), k))
        choice = {key: alloc[g.name] for g in self.groups for key in g.keys}
        base = candidate_dir(self.work, base_k)
        qc_base = json.loads((base / "quantization_config.json").read_text(encoding="utf-8"))
        storage: dict[str, Any] = qc_base.pop("tensor_storage")
        cands = {k: SafetensorsCollection(candidate_dir(self.work, k)) for k in self.ks}
        new_storage: dict[str, Any] = {}
        group_of: dict[str, str] = {}
        try:
            def tensors() -> Any:
                for leaf, entry in storage.items():
                    src = cands[choice.get(leaf, base_k)]
                    ts = {n: src.get_tensor(n) for n in entry["stored_tensors"]}
                    new_storage[leaf] = tensor_storage_entry(ts)
                    group_of.update(dict.fromkeys(ts, leaf))  # a module's tensors share a shard
                    yield from ts.items()

            out.mkdir(parents=True, exist_ok=True)
            save_sharded(tensors(), out, self.args.shard_mib * MIB, group_key=lambda n: group_of[n])
        finally:
            for c in cands.values():
                c.close()
        bits = sum(alloc[g.name] * g.numel for g in self.groups) / sum(g.numel for g in self.groups)
        qc = quantization_config(self.config.raw, version=__version__, bits=bits, head_bits=qc_base["head_bits"],
                                 cal_rows=qc_base["calibration"]["rows"], cal_cols=qc_base["calibration"]["cols"],
                                 out_scales=qc_base["out_scales"], codebook=qc_base["codebook"])
        src_cfg = json.loads((self.in_dir / "config.json").read_text(encoding="utf-8"))
        write_json_atomic(output_config(src_cfg, qc), out / "config.json")
        write_json_atomic({**qc, "tensor_storage": new_storage}, out / "quantization_config.json")
        copy_other_files(self.in_dir, out)
        return bits

    def _final(self, alloc: dict[str, int], out: Path) -> float:
        """Convert once more with ``alloc`` fixed per tensor; resumable in a work folder of its own per
        allocation (another target's interrupted conversion is left alone)."""
        from exl3_core.convert.pipeline import convert

        per_key = {key: alloc[g.name] for g in self.groups for key in g.keys}
        tag = hashlib.sha1(json.dumps(per_key, sort_keys=True).encode("utf-8")).hexdigest()[:12]
        wd = self.work / f"final-{tag}.work"
        self.report(f"converting {self.in_dir} with the measured allocation into {out}")
        res = convert(self.in_dir, out, self.args.bpw, head_bits=self.args.head_bits, device=self.args.device,
                      work_dir=wd, resume=(wd / "job.json").is_file(), seed=self.args.seed, report=self.report,
                      cal_rows=self.args.cal_rows, cal_cols=self.args.cal_cols, bits_fixed=per_key,
                      progress=self.progress)
        shutil.rmtree(wd, ignore_errors=True)
        return res.bits

    def run(self, *, resume: bool = False) -> dict[str, Any]:
        out = Path(self.args.out_dir).expanduser()
        if out.exists() and any(out.iterdir()):
            raise FileExistsError(f"{out} exists and is not empty; optimize writes a new directory (nothing there is "
                                  f"overwritten): remove it or choose another -o")
        self._start(resume)
        given = Path(self.args.measurement).expanduser() if self.args.measurement else None
        if given is not None:  # refused before any candidate is converted
            if not given.is_file():
                raise FileNotFoundError(f"--measurement {given}: no such file")
            Measurement.load(given).check(given, source_fingerprint(self.in_dir), self.ks, None)
        self._candidates()
        self._load_model()
        m = self._measure()
        budget = self.budget_bits()
        alloc = allocate(self.groups, m, budget)
        write_json_atomic({"bpw": self.args.bpw, "target_bytes": self.args.target_bytes, "allocation": alloc},
                          self.work / "allocation.json", indent=1)
        bits = self._compile(alloc, out) if self.args.assemble else self._final(alloc, out)
        pred = predicted_kl(self.groups, m, alloc)
        self.source.close()
        counts = {k: sum(1 for v in alloc.values() if v == k) for k in self.ks}
        self.report(f"wrote {out}: {bits:.3f} bits per weight, groups per K {counts}, predicted KL {pred:.6f} "
                    f"(uniform conversions: " + ", ".join(f"{k} bits {v:.6f}" for k, v in m.baseline.items()) + ")")
        return {"out_dir": str(out), "bits": bits, "allocation": alloc, "predicted_kl": pred,
                "uniform_kl": m.baseline}


def optimize(in_dir: str | Path, out_dir: str | Path, bpw: float, *, work_dir: str | Path | None = None,
             candidates: tuple[int, ...] | None = None, target_bytes: int | None = None, head_bits: int = 6,
             seed: int = 0, device: str = "cpu", measure_rows: int = 16, measure_cols: int = 256,
             measurement: str | Path | None = None, shard_mib: int = 8192, resume: bool = False,
             cal_rows: int | None = None, cal_cols: int | None = None, assemble: bool = False,
             report: Report | None = None, progress: bool = True) -> dict[str, Any]:
    """Measure, allocate and compile a mixed-bitrate EXL3 model at an average ``bpw`` (module docstring).

    :param work_dir: candidates, measurement and job file (default ``<out_dir>.optimize``; kept, so
        other targets can be compiled from the same measurement with ``--resume``).
    :param candidates: the bitrates to choose from (default :func:`default_candidates`).
    :param target_bytes: also keep the output's total tensor bytes at or below this.
    :param assemble: take each group's tensors from its candidate (seconds) instead of converting once
        more with the allocation (the default, better: module docstring).
    :raises ValueError: a target the candidates cannot meet. :raises ResumeError: a job or measurement
        that does not match these arguments or this model.
    """
    out = Path(out_dir).expanduser()
    work = Path(work_dir).expanduser() if work_dir else out.with_name(out.name + ".optimize")
    args = OptimizeArgs(str(in_dir), str(out_dir), float(bpw), str(work),
                        tuple(candidates) if candidates else default_candidates(float(bpw)), target_bytes,
                        head_bits, seed, device, measure_rows, measure_cols,
                        None if measurement is None else str(measurement), shard_mib, cal_rows, cal_cols, assemble)
    return Optimizer(args, report=report, progress=progress).run(resume=resume)
