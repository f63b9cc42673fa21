"""``exl3 convert``: quantize an HF model to EXL3, stage by stage, resumably (format spec 5.1).

For each stage (embedding, every block, final norm, head), in order:

1. run the calibration rows through the *unquantized* stage, its inputs being the states that
   the already-quantized earlier stages produced, and capture ``H += XᵀX`` once per group of
   linears reading the same input (:mod:`exl3_core.convert.capture`);
2. finalise each H once (seeded by the stage index) and quantize every linear with its bit width
   from the allocation (:mod:`exl3_core.quant.exl3.allocation`), the head with ``head_bits``;
3. swap the stage's linears for modules built from exactly the tensors that will be stored
   (:func:`~exl3_core.convert.dequantized.runtime_linear`), advance the states through it and report rfn/cos/sqnr against
   the unquantized outputs on the first rows;
4. checkpoint the stage's tensors and the new states in the work directory.

All randomness is seeded per stage and no step depends on wall-clock or on how the job was
split, so a run killed at any point and resumed writes byte-identical output.
"""
from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from exl3_core.convert.calibration import RANDOM_FRACTION, calibration_ids, default_size, postpass_rows
from exl3_core.convert.capture import HessianCapture, LinearSlot, find_linears
from exl3_core.convert.compile import quantization_config, write_output
from exl3_core.convert.concurrent import run_on_streams
from exl3_core.convert.dequantized import runtime_linear
from exl3_core.convert.propagation import CrossAccumulator, InputRecorder, default_strength, propagated_weight
from exl3_core.convert.stages import (
    Stage,
    advance_states,
    conversion_stages,
    forward_stage,
    load_recording,
    refresh_derived,
    replace_linear,
    source_fingerprint,
)
from exl3_core.convert.workdir import Job, ResumeError, StatesCommitter, WorkDir
from exl3_core.progress import write as progress_write
from exl3_core.quant.exl3.allocation import AllocItem, allocate_bits, average_bits
from exl3_core.quant.exl3.hessian import HessianAccumulator, HessianInfo, padded_size
from exl3_core.quant.exl3.quantize import QuantizedLinear, quantize_linear

CODEBOOKS = ("mul1", "mcg", "3inst")
METRIC_ROWS = 5  # rows the per-stage error is measured on (as the reference quantizer does)
CHUNK_TOKENS = 4096  # calibration tokens per forward call
# Hidden states up to this size are checkpointed after every stage; bigger ones (an 8B model's
# 250x2048 rows are 8.4 GB) at most once per STATE_CHECKPOINT_S, since writing them costs more than
# a stage. A resume restarts from the last checkpoint and recomputes identically either way.
SMALL_STATES_BYTES = 1 << 30
STATE_CHECKPOINT_S = 120.0
HEAD_METRIC_COLS = 512  # tokens per row the head's error is measured on
ATTENTION_PRIORITY, FEEDFORWARD_PRIORITY = 2, 1  # bit allocation order (spec 5.7)

Report = Callable[[str], None]


@dataclass(frozen=True)
class ConvertArgs:
    """Everything that defines a conversion (see ``exl3 convert --help``)."""

    in_dir: str
    out_dir: str
    bpw: float
    head_bits: int = 6
    codebook: str = "mul1"
    out_scales: str = "always"
    cal_rows: int | None = None  # None: sized for the model (calibration.default_size)
    cal_cols: int | None = None
    device: str = "cpu"
    shard_mib: int = 8192
    work_dir: str | None = None
    seed: int = 0
    text: str | None = None  # calibration text file (None: the built-in text)
    cal_random: float = RANDOM_FRACTION  # share of uniform-random calibration rows
    propagate: float = 0.0  # error-propagation strength α (0: off; see convert/propagation.py)
    refit_scales: bool = False  # closed-form refit of suh/svh for the final codes (quant/exl3/scale_refit.py)
    refit_propagate: float = 0.0  # β: the refit aims at W + β·(W* − W), the output metric with quantized inputs
    tf32: bool = True  # CUDA: fp32 matmuls of the calibration forwards and Hessians on TF32 tensor cores
    sequential: bool = False  # re-capture each input group of a block after the groups before it are quantized
    refit_final: float = 0.0  # β of the post-pass scale refit from the finished model (0: off; convert/postpass.py)
    bits_fixed: dict[str, int] | None = None  # K per tensor key chosen by the caller (exl3 optimize's allocation)

    @property
    def rows(self) -> int:
        assert self.cal_rows is not None, "calibration size not resolved (Converter.run does it)"
        return self.cal_rows

    @property
    def cols(self) -> int:
        assert self.cal_cols is not None, "calibration size not resolved (Converter.run does it)"
        return self.cal_cols

    def validate(self) -> None:
        if not 1.0 <= self.bpw <= 8.0:
            raise ValueError(f"--bits {self.bpw}: EXL3 bitrates are 1..8 bits per weight")
        if not (1 <= self.head_bits <= 8 or self.head_bits == 16):
            raise ValueError(f"--head-bits {self.head_bits}: use 1..8, or 16 to keep the head unquantized")
        if self.codebook not in CODEBOOKS:
            raise ValueError(f"--codebook {self.codebook!r}: use one of {', '.join(CODEBOOKS)}")
        if self.out_scales not in ("always", "never", "auto"):
            raise ValueError(f"--out-scales {self.out_scales!r}: use always, never or auto")
        if (self.cal_rows is not None and self.cal_rows < 1) or (self.cal_cols is not None and self.cal_cols < 2):
            raise ValueError(f"--cal-rows {self.cal_rows} --cal-cols {self.cal_cols}: need at least 1 row of 2 tokens")
        if not 0.0 <= self.cal_random <= 1.0:
            raise ValueError(f"--cal-random {self.cal_random}: the share of random rows must be in [0, 1]")
        if not 0.0 <= self.propagate <= 1.0:
            raise ValueError(f"--propagate {self.propagate}: the error-propagation strength must be in [0, 1]")
        if not 0.0 <= self.refit_propagate <= 1.0:
            raise ValueError(f"--refit-propagate {self.refit_propagate}: the strength must be in [0, 1]")
        if self.refit_propagate > 0 and not self.refit_scales:
            raise ValueError(f"--refit-propagate {self.refit_propagate} only applies with --refit-scales")
        if not 0.0 <= self.refit_final <= 1.0:
            raise ValueError(f"--refit-final {self.refit_final}: the strength must be in [0, 1] (0: off)")
        if self.shard_mib < 1:
            raise ValueError(f"--shard-size {self.shard_mib}: must be at least 1 MiB")

    def job_args(self) -> dict[str, Any]:
        d = asdict(self)
        d["in_dir"] = str(Path(self.in_dir).expanduser().resolve())
        d["text"] = None if self.text is None else str(Path(self.text).expanduser().resolve())
        return d


@dataclass
class ConvertResult:
    out_dir: Path
    completed: bool
    bits: float = 0.0
    stages: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


#: blocks with more input groups than this (MoE: two per expert) are captured once, not per group
SEQUENTIAL_MAX_GROUPS = 8


class StopAfterModule(Exception):
    """Raised internally by the ``_stop_after_module`` test hook."""


@contextmanager
def _tf32(enabled: bool) -> Iterator[None]:
    """TF32 tensor cores for fp32 matmuls (calibration forwards, Hessians) while converting on CUDA:
    ~8x the fp32 rate, and the 10-bit mantissa only perturbs statistics averaged over the whole
    calibration set. Restores the caller's setting."""
    if not enabled:
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


# -- metrics --------------------------------------------------------------------------------------
def error_metrics(y: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """rfn = ‖y−ref‖/‖ref‖, cos = 1 − cosine similarity, sqnr in dB (spec 5.1)."""
    y, ref = y.double().reshape(-1), ref.double().reshape(-1)
    err = float((y - ref).norm())
    rn = float(ref.norm())
    cos = float(torch.dot(y, ref) / (y.norm() * ref.norm()).clamp_min(1e-300))
    return {"rfn": err / rn if rn else 0.0, "cos": 1.0 - cos,
            "sqnr": 10 * math.log10(rn * rn / (err * err)) if err > 0 else float("inf")}


# -- grouping and allocation ----------------------------------------------------------------------
def _chunks(rows: int, cols: int) -> list[slice]:
    step = max(1, CHUNK_TOKENS // cols)
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def probe_groups(model: Any, stages: list[Stage], slots: dict[int, list[LinearSlot]], vocab: int) -> None:
    """Fill every slot's ``group`` by running a short sequence through the stages with capture hooks."""
    ids = torch.arange(8, dtype=torch.int64).remainder(vocab).view(1, 8).to(model.device)
    x: torch.Tensor = ids
    with torch.no_grad():
        for st in stages:
            if st.kind == "head":
                head = [s for s in slots[st.index] if s.quantize]
                for s in head:
                    s.group = head[0].key
                continue
            with HessianCapture(st.module, slots[st.index]) as cap:
                cap.next_batch()
                x = forward_stage(model, st, x, ids)


def _priority(slot: LinearSlot) -> int:
    return ATTENTION_PRIORITY if getattr(type(slot.parent), "cache_kind", None) is not None else FEEDFORWARD_PRIORITY


def allocation_items(stages: list[Stage], slots: dict[int, list[LinearSlot]]) -> tuple[list[AllocItem], list[str]]:
    """Budgeted items (one allocation group per shared input) and the head keys."""
    items: list[AllocItem] = []
    head: list[str] = []
    for st in stages:
        qs = [s for s in slots[st.index] if s.quantize]
        if st.kind == "head":
            head += [s.key for s in qs]
            continue
        prio: dict[str, int] = {}
        for s in qs:
            g = s.group or s.key
            prio[g] = max(prio.get(g, 0), _priority(s) if st.kind == "block" else 0)
        for s in qs:
            g = s.group or s.key
            items.append(AllocItem(s.key, padded_size(s.in_features) * padded_size(s.out_features), g, prio[g],
                                   st.layer))
    return items, head


# -- per-stage work -------------------------------------------------------------------------------
def _stage_tensors(st: Stage, slots: list[LinearSlot], quantized: dict[str, QuantizedLinear],
                   source: Any) -> tuple[dict[str, torch.Tensor], list[tuple[str, list[str]]]]:
    """The stage's output tensors and its ``tensor_storage`` entries, in load (module) order."""
    consumed: dict[str, LinearSlot] = {}
    dense_linear: set[str] = set()
    for s in slots:
        src_key = str(getattr(s.module, "key", s.key)).split("[", 1)[0]  # fused expert tensors: the base name
        names = [f"{src_key}.weight", f"{src_key}.bias", src_key]
        for n in names:
            if s.quantize:
                consumed.setdefault(n, s)
            else:
                dense_linear.add(n)
    tensors: dict[str, torch.Tensor] = {}
    storage: list[tuple[str, list[str]]] = []
    emitted: set[str] = set()

    def emit_slot(s: LinearSlot) -> None:
        if s.key in emitted:
            return
        emitted.add(s.key)
        ts = quantized[s.key].tensors(s.key)
        tensors.update(ts)
        storage.append((s.key, list(ts)))

    for name in st.reads:
        if name in consumed:
            for s in slots:  # every quantized linear built from this source tensor, in module order
                src_key = str(getattr(s.module, "key", s.key)).split("[", 1)[0]
                if s.quantize and name in (f"{src_key}.weight", f"{src_key}.bias", src_key):
                    emit_slot(s)
            continue
        t = source.get_tensor(name)
        if name in dense_linear or (name.endswith(".weight") and t.dtype == torch.float32):
            t = t.to(torch.float16)  # spec 1.6: fp32 -> fp16, bf16 embeddings/norms stay bf16
        tensors[name] = t.contiguous()
        leaf = name.rsplit(".", 1)[0]
        if storage and storage[-1][0] == leaf:
            storage[-1][1].append(name)
        else:
            storage.append((leaf, [name]))
    for s in slots:
        if s.quantize:
            emit_slot(s)  # linears that read no tensor of their own (a head tied to the embedding)
    return tensors, storage


class Converter:
    """One conversion job; :func:`convert` is the entry point."""

    def __init__(self, args: ConvertArgs, *, report: Report | None = None, progress: bool = True,
                 on_quantized: Callable[[str, QuantizedLinear], None] | None = None) -> None:
        args.validate()
        self.on_quantized = on_quantized
        self.args = args
        self.report = report or progress_write  # above the progress bar, never into it
        self.progress = progress
        self.in_dir = Path(args.in_dir).expanduser()
        self.out_dir = Path(args.out_dir).expanduser()
        default_work = args.work_dir is None
        self.work = WorkDir.for_output(self.out_dir, args.work_dir)
        self.remove_work_when_done = default_work
        self.device = torch.device(args.device)
        self.x_fp: torch.Tensor | None = None  # unquantized-model states (error propagation only)

    # -- setup ------------------------------------------------------------------------------------
    def _load_model(self) -> None:
        from exl3_core.archkit import Config, Model
        from exl3_core.loader import SafetensorsCollection
        from exl3_core.quant.exl3.linear import is_exl3_storage

        self.config = Config.from_directory(self.in_dir)
        if self.config.quantization is not None and self.config.quantization.quant_method == "exl3":
            raise ValueError(f"{self.in_dir} is already an EXL3 model; convert the original (unquantized) model")
        self.model = Model.from_config(self.config)
        self.stages = conversion_stages(self.model)
        self.source = SafetensorsCollection(self.in_dir)
        names = set(self.source.keys())
        if any(n.endswith(".trellis") and is_exl3_storage(n[: -len(".trellis")], names) for n in names):
            raise ValueError(f"{self.in_dir} holds EXL3 tensors; convert the original (unquantized) model")
        rec = load_recording(self.model, self.stages, self.source, self.device)
        if rec.unowned:
            self.stages[0].reads[:0] = rec.unowned  # read by no stage's modules: keep them with the first
        self.slots = {st.index: find_linears(st.module) for st in self.stages}
        self.vocab = int(self.config.hf.vocab_size or 0)

    def _start_or_resume(self, resume: bool) -> Job:
        a = self.args
        job_args = a.job_args()
        source = source_fingerprint(self.in_dir)
        if self.work.exists():
            job = self.work.load_job()
            if not resume:
                state = "a finished" if job.done >= len(self.stages) else "an unfinished"
                raise ResumeError(f"the work directory {self.work.path} holds {state} conversion; pass --resume "
                                  f"to continue (or rewrite) it, or delete it (or choose another with -w) to start over")
            defaults = {f.name: f.default for f in fields(ConvertArgs) if f.default is not MISSING}
            self.work.check_resume(job, job_args, source, defaults)
            self.report(f"resuming {self.work.path}: {job.done} of {len(self.stages)} modules done")
            return job
        probe_groups(self.model, self.stages, self.slots, self.vocab)
        items, head_keys = allocation_items(self.stages, self.slots)
        fixed_head = a.head_bits
        if a.bits_fixed is not None:
            known = {it.key for it in items}
            if unknown := sorted(set(a.bits_fixed) - known):
                raise ValueError(f"bits_fixed: {', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''} "
                                 f"{'is not a quantized tensor' if len(unknown) == 1 else 'are not quantized tensors'}"
                                 f" of {self.in_dir}; give K only for its linears (was the allocation made for "
                                 f"another model?)")
        bits = allocate_bits(items, a.bpw, head_keys=head_keys, head_bits=fixed_head, fixed=a.bits_fixed,
                             num_layers=sum(st.kind == "block" for st in self.stages))
        for s in (s for ss in self.slots.values() for s in ss):
            s.group = None  # the real capture observes the groups again
        text = None if a.text is None else Path(a.text).expanduser().read_text(encoding="utf-8")
        ids = calibration_ids(self.in_dir, self.vocab, a.rows, a.cols, seed=a.seed, text=text,
                              random_fraction=a.cal_random)
        job = Job(args=job_args, source=source, bits=bits)
        self.work.path.mkdir(parents=True, exist_ok=True)
        self.work.save_calibration(ids)
        self.work.save_job(job)
        return job

    # -- the stage loop ---------------------------------------------------------------------------
    def _seed(self, st: Stage) -> int:
        """The stage's RNG seed: its index (spec 5.2), shifted by ``--seed`` so reruns can vary it."""
        return st.index + 1_000_003 * self.args.seed

    def _quantize_slots(self, st: Stage, slots: list[LinearSlot], hinfos: dict[str, HessianInfo | None],
                        bits: dict[str, int], bar: Any,
                        targets: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                        ) -> dict[str, QuantizedLinear]:
        out: dict[str, QuantizedLinear] = {}
        # the sign-pattern seed of a tensor: its place among the stage's quantized linears, so that
        # quantizing a stage's groups one call at a time (sequential) draws the same seeds
        ordinals = {x.key: i for i, x in enumerate(x for x in self.slots[st.index] if x.quantize)}
        jobs: list[tuple[LinearSlot, Callable[[], tuple[QuantizedLinear, float]]]] = []
        for s in slots:
            if not s.quantize:
                continue
            K = bits[s.key]
            if K == 16:
                s.quantize = False  # --head-bits 16: stored dense (spec 1.6)
                if bar is not None:
                    bar.advance(1, s.key)
                continue
            w = s.module.weight
            assert isinstance(w, torch.Tensor), f"{s.key}: a linear without a weight tensor"
            w = w.detach()
            sums = (targets or {}).get(s.group or s.key)
            aim = None
            if sums is not None:  # aim at the unquantized model's output (error propagation)
                if self.args.refit_propagate > 0:  # the scales aim there too, at their own strength
                    aim = propagated_weight(w, sums[0], sums[1], self.args.refit_propagate)
                if self.args.propagate > 0:
                    w = propagated_weight(w, sums[0], sums[1], self.args.propagate)
            b = getattr(s.module, "bias", None)
            kw = dict(K=K, codebook=self.args.codebook, out_scales=self.args.out_scales,
                      seed=self._seed(st) * 4096 + ordinals[s.key], bias=None if b is None else b.detach(),
                      in_features=s.in_features, out_features=s.out_features, name=s.key,
                      refit_scales=self.args.refit_scales, refit_target=aim)

            def job(w: torch.Tensor = w, h: HessianInfo | None = hinfos.get(s.group or s.key),
                    kw: dict[str, Any] = kw, key: str = s.key) -> tuple[QuantizedLinear, float]:
                t0 = time.monotonic()
                if bar is not None:
                    bar.step(f"{key}: quantizing")
                q = quantize_linear(w, h, **kw)
                if bar is not None:
                    bar.advance(1, key)  # here, not after the stage's jobs: on a CPU they run one by one
                return q, time.monotonic() - t0

            jobs.append((s, job))
        # on a GPU the stage's linears are quantized side by side (bit-identical: concurrent.py)
        results = run_on_streams([j for _, j in jobs], self.device)
        for (s, _), (q, secs) in zip(jobs, results, strict=True):
            out[s.key] = q
            if self.on_quantized is not None:
                self.on_quantized(s.key, q)
            self.report(f"    {s.key:<52} {q.summary()}  {secs:5.1f} s")
        return out

    def _quantize_sequential(self, st: Stage, qslots: list[LinearSlot], order: list[str],
                             hinfos: dict[str, HessianInfo | None], bits: dict[str, int], bar: Any,
                             x: torch.Tensor, ids: torch.Tensor) -> dict[str, QuantizedLinear]:
        """Quantize a block's input groups in forward order, each from a Hessian captured with every
        earlier group already quantized (o_proj sees quantized q/k/v, the MLP a quantized attention
        output, down_proj quantized gate/up): the "true sequential" order of GPTQ-style quantizers.
        One extra calibration pass through the block per group after the first."""
        dev = self.device
        quantized: dict[str, QuantizedLinear] = {}
        for i, leader in enumerate(order):
            group = [s for s in qslots if s.group == leader]
            if i > 0:
                with torch.no_grad(), HessianCapture(st.module, group) as cap:
                    for c in _chunks(*ids.shape):
                        cap.next_batch()
                        forward_stage(self.model, st, x[c].to(dev), ids[c].to(dev))
                acc = cap.accumulators.get(leader)
                hinfos[leader] = acc.finalize(seed=self._seed(st)) if acc is not None else None
            q = self._quantize_slots(st, group, hinfos, bits, bar)
            self._install(st, group, q)
            quantized.update(q)
        return quantized

    def _install(self, st: Stage, slots: list[LinearSlot], quantized: dict[str, QuantizedLinear]) -> None:
        for s in slots:
            if s.key not in quantized:
                continue
            ts = quantized[s.key].tensors(s.key)
            replace_linear(s.parent, s.attr, runtime_linear(s.key, ts.get, s.in_features, s.out_features,
                                                            self.device))
        refresh_derived(st, torch.float32, self.device)

    def _run_stage(self, st: Stage, x: torch.Tensor, ids: torch.Tensor, job: Job, bar: Any) -> torch.Tensor:
        slots = self.slots[st.index]
        qslots = [s for s in slots if s.quantize]
        chunks = _chunks(*ids.shape)
        n_metric = min(METRIC_ROWS, ids.shape[0])
        dev = self.device
        ref_rows: list[torch.Tensor] = []
        hinfos: dict[str, HessianInfo | None] = {}
        x_fp = self.x_fp
        crosses: dict[str, CrossAccumulator] = {}
        accumulators: dict[str, HessianAccumulator] = {}
        fp_outs: list[torch.Tensor] = []
        if bar is not None and qslots:
            bar.step(f"{st.name}: calibration pass")
        if qslots and st.kind == "head":
            acc = accumulators[qslots[0].key] = HessianAccumulator(qslots[0].in_features, name=f"{st.name} input")
            for c in chunks:
                acc.add(x[c].to(dev))
                if x_fp is not None:
                    k = qslots[0].in_features
                    crosses.setdefault(qslots[0].key, CrossAccumulator()).add(
                        x[c].to(dev).reshape(-1, k), x_fp[c].to(dev).reshape(-1, k))
            for s in qslots:
                s.group = qslots[0].key
            hinfos[qslots[0].key] = acc.finalize(seed=self._seed(st))
            with torch.no_grad():  # logits are vocabulary-wide: measured on a bounded number of tokens
                ref = forward_stage(self.model, st, x[:n_metric, :HEAD_METRIC_COLS].to(dev),
                                    ids[:n_metric, :HEAD_METRIC_COLS]).cpu()
        elif qslots:
            partner: dict[str, torch.Tensor] = {}

            def cross(leader: str, xq: torch.Tensor) -> None:
                crosses.setdefault(leader, CrossAccumulator()).add(xq, partner.get(leader))

            with torch.no_grad(), HessianCapture(st.module, slots, observer=cross if x_fp is not None else None) as cap:
                for c in chunks:
                    if x_fp is not None:  # the same rows through the unquantized model: inputs and output
                        cap.paused = True
                        with InputRecorder(slots) as rec:
                            fp_outs.append(forward_stage(self.model, st, x_fp[c].to(dev), ids[c].to(dev))
                                           .float().to(x_fp.device))
                        cap.paused = False
                        partner = rec.inputs
                    cap.next_batch()
                    y = forward_stage(self.model, st, x[c].to(dev), ids[c].to(dev))
                    if c.start < n_metric:  # kept where they are: compared on the device after quantizing
                        ref_rows.append(y[: n_metric - c.start].clone())
            ref = torch.cat(ref_rows)
            for key in cap.unseen():
                self.report(f"    warning: {key} received no input during capture; quantized without a Hessian")
            accumulators = cap.accumulators
        order = [leader for leader in accumulators if any(s.group == leader for s in qslots)]
        sequential = (st.kind == "block" and self.args.sequential and x_fp is None
                      and 1 < len(order) <= SEQUENTIAL_MAX_GROUPS)
        if st.kind != "head":
            # sequential: only the first group quantizes from this pass (the others are re-captured)
            for leader in order[:1] if sequential else accumulators:
                hinfos[leader] = accumulators[leader].finalize(seed=self._seed(st))
        targets = {}
        for leader, cr in crosses.items():
            h_sum = accumulators[leader].h_sum if leader in accumulators else None
            if cr.valid and cr.c_sum is not None and h_sum is not None:
                targets[leader] = (h_sum, cr.c_sum)
        if sequential:
            quantized = self._quantize_sequential(st, qslots, order, hinfos, job.bits, bar, x, ids)
        else:
            quantized = self._quantize_slots(st, slots, hinfos, job.bits, bar, targets) if qslots else {}
            self._install(st, slots, quantized)

        metrics: dict[str, float] = {}
        if st.kind == "head":
            new_x = x
            if quantized:
                with torch.no_grad():
                    y = forward_stage(self.model, st, x[:n_metric, :HEAD_METRIC_COLS].to(dev),
                                      ids[:n_metric, :HEAD_METRIC_COLS]).cpu()
                metrics = error_metrics(y, ref)
        else:
            if bar is not None:
                bar.step(f"{st.name}: forward pass")
            new_x = advance_states(self.model, st, x, ids, chunks, dev, self._home)
            if x_fp is not None:  # advance the unquantized model's states too
                if not fp_outs:
                    with torch.no_grad():
                        fp_outs = [forward_stage(self.model, st, x_fp[c].to(dev), ids[c].to(dev)).float()
                                   .to(x_fp.device) for c in chunks]
                self.x_fp = torch.cat(fp_outs)
            if quantized:
                metrics = error_metrics(new_x[:n_metric], ref.to(new_x.device))
        tensors, storage = _stage_tensors(st, slots, quantized, self.source)
        self.work.save_stage(st.index, tensors)
        job.stages.append({"name": st.name, "storage": storage, "metrics": metrics,
                           "bits": {k: q.K for k, q in quantized.items()}})
        return new_x

    def _home(self, nbytes: int) -> torch.device:
        """Where ``nbytes`` of calibration states live between stages: on the GPU when they fit with
        room to spare (no host round trip per chunk and stage), else in host memory."""
        dev = self.device
        if dev.type != "cuda":
            return torch.device("cpu")
        free, _ = torch.cuda.mem_get_info(dev)
        return dev if 3 * nbytes < free else torch.device("cpu")

    def _states_home(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point() or x.device.type == "cuda":
            return x
        return x.to(self._home(x.nbytes))

    def _widest_input(self) -> int:
        return max((s.in_features for ss in self.slots.values() for s in ss if s.quantize), default=1)

    def _size_calibration(self) -> None:
        """Resolve an unset calibration size from the model's linears (``calibration.default_size``)."""
        a = self.args
        if a.cal_rows is not None and a.cal_cols is not None:
            return
        rows, cols = default_size(self._widest_input(), a.cal_rows, a.cal_cols)
        self.args = replace(a, cal_rows=rows, cal_cols=cols)

    def run(self, *, resume: bool = False, _stop_after_module: int | None = None) -> ConvertResult:
        t_start = time.monotonic()
        self._load_model()
        self._size_calibration()
        job = self._start_or_resume(resume)
        ids = self.work.load_calibration()
        if ids is None:
            raise ResumeError(f"{self.work.path}/calibration.safetensors is missing; delete the work directory and "
                              f"start over")
        x: torch.Tensor = ids if job.done == 0 or job.states is None else self.work.load_states(job.states)
        if x.dim() == 4:  # error propagation checkpoints [quantized, unquantized] states together
            x, self.x_fp = x[0], self._states_home(x[1])
        x = self._states_home(x)
        todo = [st for st in self.stages if st.index >= job.done]
        n_lin = sum(1 for st in todo for s in self.slots[st.index] if s.quantize)
        bar = None
        if self.progress:
            from exl3_core.progress import Progress

            bar = Progress(n_lin, f"quantizing {self.in_dir.name}", unit="tensor", heartbeat_s=1.0)
        try:
            with _tf32(self.args.tf32 and self.device.type == "cuda"):
                self._run_stages(todo, x, ids, job, bar, _stop_after_module)
        except StopAfterModule:
            return ConvertResult(self.out_dir, False, stages=job.stages, seconds=time.monotonic() - t_start)
        finally:
            if bar is not None:
                bar.close()
        return self._finish(job, t_start)

    def _run_stages(self, todo: list[Stage], x: torch.Tensor, ids: torch.Tensor, job: Job, bar: Any,
                    _stop_after_module: int | None) -> None:
        committer = StatesCommitter(self.work)
        try:
            self._stage_loop(todo, x, ids, job, bar, _stop_after_module, committer)
        except BaseException:
            with suppress(BaseException):  # let a commit in flight finish; the loop's error is the one to report
                committer.wait()
            raise
        committer.wait()  # a commit in flight completes (or reports its error) before we return

    def _stage_loop(self, todo: list[Stage], x: torch.Tensor, ids: torch.Tensor, job: Job, bar: Any,
                    _stop_after_module: int | None, committer: StatesCommitter) -> None:
        last_commit = time.monotonic()
        for st in todo:
            t0 = time.monotonic()
            x = self._run_stage(st, x, ids, job, bar)
            m = job.stages[-1]["metrics"]
            err = (f"rfn {m['rfn']:.6f}  cos {m['cos']:.3e}  sqnr {m['sqnr']:6.2f} dB" if m else "no linears")
            self.report(f"[{st.index + 1}/{len(self.stages)}] {st.name:<40} {err}  "
                        f"({time.monotonic() - t0:.1f} s)")
            last = st.index == len(self.stages) - 1
            stop = _stop_after_module is not None and st.index >= _stop_after_module and not last
            x = self._states_home(x)
            if (self.args.propagate > 0 or self.args.refit_propagate > 0) and self.x_fp is None \
                    and x.is_floating_point():
                self.x_fp = x  # up to the first quantized stage both models agree
            if (last or stop or x.nbytes <= SMALL_STATES_BYTES
                    or time.monotonic() - last_commit >= STATE_CHECKPOINT_S):
                job.done = st.index + 1
                # stacked on the host, never on the device (that would need twice the states' memory there)
                committer.submit(job, None if last else st.index, [x] if self.x_fp is None else [x, self.x_fp])
                last_commit = time.monotonic()
                if last or stop:
                    committer.wait()
            if stop:
                raise StopAfterModule

    def _refit_final(self, files: list[Path]) -> list[Path]:
        from exl3_core.convert.postpass import final_refit

        self.x_fp = None  # the stage loop's states are done with; the post-pass keeps its own two sets
        ids = self.work.load_calibration()
        assert ids is not None  # run() checked it
        ids = postpass_rows(ids, self._widest_input())
        t0 = time.monotonic()
        with _tf32(self.args.tf32 and self.device.type == "cuda"):
            files, recs = final_refit(self.model, self.stages, self.slots, files, ids, self.args.refit_final,
                                      self.device, chunks=_chunks(*ids.shape), work_path=self.work.path,
                                      home=self._home, report=self.report)
        kept = sum(r.accepted for r in recs)
        self.report(f"refit-final: {kept} of {len(recs)} tensors' scales refit ({time.monotonic() - t0:.1f} s)")
        return files

    def _finish(self, job: Job, t_start: float) -> ConvertResult:
        a = self.args
        items = []  # the budgeted ("bits") tensors; the head is reported separately (spec 1.7)
        for st_info, st in zip(job.stages, self.stages, strict=True):
            if st.kind == "head":
                continue
            for key in st_info["bits"]:
                slot = next(s for s in self.slots[st.index] if s.key == key)
                items.append(AllocItem(key, padded_size(slot.in_features) * padded_size(slot.out_features), key))
        bits = average_bits(job.bits, items) if items else 0.0
        from exl3_core import __version__

        qc = quantization_config(self.config.raw, version=__version__, bits=bits, head_bits=a.head_bits,
                                 cal_rows=a.rows, cal_cols=a.cols, out_scales=a.out_scales,
                                 codebook=a.codebook)
        files = [self.work.stage_file(st.index) for st in self.stages]
        if a.refit_final > 0:  # post-pass: refit every scale from the finished model (reruns whole on resume)
            files = self._refit_final(files)
        storage = [[(leaf, names) for leaf, names in st_info["storage"]] for st_info in job.stages]
        write_output(self.out_dir, self.in_dir, files, storage, qc, a.shard_mib)
        self.source.close()
        self.work.drop_old_states(None)
        if self.remove_work_when_done:
            shutil.rmtree(self.work.path, ignore_errors=True)
        secs = time.monotonic() - t_start
        self.report(f"wrote {self.out_dir} ({bits:.2f} bits per weight, head {a.head_bits}) in {secs:.1f} s")
        return ConvertResult(self.out_dir, True, bits=bits, stages=job.stages, seconds=secs)


def _recorded_arg(out_dir: str | Path, work_dir: str | Path | None, name: str, missing: Any) -> Any:
    """``name`` as the interrupted job in the work directory recorded it (``missing`` when the job
    predates the option); None when there is no readable job to resume."""
    work = WorkDir.for_output(out_dir, work_dir)
    if not work.exists():
        return None
    try:
        return work.load_job().args.get(name, missing)
    except (ResumeError, OSError, ValueError):
        return None  # the resume itself reports what is wrong with the job file


def convert(in_dir: str | Path, out_dir: str | Path, bpw: float, *, head_bits: int = 6, codebook: str = "mul1",
            out_scales: str = "always", cal_rows: int | None = None, cal_cols: int | None = None, device: str = "cpu",
            shard_mib: int = 8192, work_dir: str | Path | None = None, resume: bool = False, seed: int = 0,
            text: str | Path | None = None, cal_random: float = RANDOM_FRACTION, propagate: float | None = None,
            refit_scales: bool = False, refit_propagate: float = 0.0, tf32: bool = True, sequential: bool = False,
            refit_final: float | None = None, bits_fixed: dict[str, int] | None = None,
            report: Report | None = None,
            progress: bool = True,
            on_quantized: Callable[[str, QuantizedLinear], None] | None = None,
            _stop_after_module: int | None = None) -> ConvertResult:
    """Quantize the HF model in ``in_dir`` to EXL3 at ``bpw`` bits per weight into ``out_dir``.

    :param head_bits: K of the output head (16 keeps it unquantized).
    :param codebook: ``mul1`` (default), ``mcg`` or ``3inst``.
    :param out_scales: output-channel scale policy ``always``/``never``/``auto`` (spec 5.3).
    :param cal_rows: calibration rows; ``cal_cols`` tokens each. None: sized for the model from the
        widest quantized input (``calibration.default_size``); a resumed job keeps what it recorded.
    :param work_dir: checkpoint directory (default ``<out_dir>.work``, removed when done).
    :param resume: continue the unfinished job in ``work_dir``; its quantization arguments must match.
    :param text: calibration text file instead of the built-in documentation text.
    :param cal_random: share of uniform-random calibration rows (default 20/135, the reference mix).
    :param propagate: error-propagation strength α in [0, 1] (0: off): aim each linear partly at the
        unquantized model's output instead of reproducing the upstream error (convert/propagation.py).
        None: the measured default for ``bpw`` (``propagation.default_strength``).
    :param refit_scales: after LDLQ, refit the fp16 scales ``suh``/``svh`` in closed form for the final
        codes under the Hessian metric (``quant/exl3/scale_refit.py``; format unchanged).
    :param refit_propagate: with ``refit_scales``, aim the scales (not the codes) at the error-propagated
        target of strength β in [0, 1]: the output error including the quantized inputs.
    :param tf32: on CUDA, run the fp32 matmuls of the calibration forwards and Hessians on TF32
                 tensor cores (default; ~8x faster, statistics unchanged to ~1e-3).
    :param sequential: quantize a block's input groups one at a time in forward order, each from a
        Hessian captured with the earlier groups already quantized (blocks with few groups, no error
        propagation); one extra calibration pass per group.
    :param refit_final: β in [0, 1] (0: off): after every stage is quantized, refit all ``suh``/``svh``
        once more for the fixed codes from the finished model's own inputs, aiming at the
        error-propagated target of strength β (``convert/postpass.py``; three extra calibration passes
        per stage, the unquantized model's states kept beside the quantized ones). None: the measured
        default (``postpass.default_beta``: 0.5 on every device and bitrate).
    :param bits_fixed: K per quantized tensor key, outside the ``bpw`` allocation (``exl3 optimize``
        passes its measured allocation for every tensor); the rest are allocated as usual.
    :param report: receives the per-tensor and per-module report lines (default: stderr).
    :param on_quantized: called with ``(key, QuantizedLinear)`` for every tensor quantized in this run.
    :param _stop_after_module: testing hook, return (unfinished) after checkpointing that stage index.
    :raises ResumeError: the work directory cannot be resumed with these arguments.
    """
    from exl3_core.convert.postpass import default_beta

    if refit_final is None:
        # a resumed job keeps the post-pass setting it started with (the default depends on the device
        # and changed over versions: jobs that do not record it ran without it)
        recorded = _recorded_arg(out_dir, work_dir, "refit_final", 0.0) if resume else None
        refit_final = default_beta(float(bpw), device) if recorded is None else float(recorded)
    if resume:  # an unset size is whatever the interrupted job resolved (older jobs: the old defaults)
        if cal_rows is None:
            cal_rows = _recorded_arg(out_dir, work_dir, "cal_rows", 250)
        if cal_cols is None:
            cal_cols = _recorded_arg(out_dir, work_dir, "cal_cols", 2048)
    args = ConvertArgs(in_dir=str(in_dir), out_dir=str(out_dir), bpw=float(bpw), head_bits=head_bits,
                       codebook=codebook, out_scales=out_scales, cal_rows=cal_rows, cal_cols=cal_cols, device=device,
                       shard_mib=shard_mib, work_dir=None if work_dir is None else str(work_dir), seed=seed,
                       text=None if text is None else str(text), cal_random=cal_random,
                       propagate=default_strength(float(bpw)) if propagate is None else float(propagate),
                       refit_scales=bool(refit_scales), refit_propagate=float(refit_propagate), tf32=bool(tf32),
                       sequential=bool(sequential), refit_final=float(refit_final),
                       bits_fixed=None if bits_fixed is None else {str(k): int(v) for k, v in bits_fixed.items()})
    conv = Converter(args, report=report, progress=progress, on_quantized=on_quantized)
    return conv.run(resume=resume, _stop_after_module=_stop_after_module)
