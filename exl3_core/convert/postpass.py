"""Post-pass refit of the stored scales from the *finished* model (``exl3 convert --refit-final β``).

During the stage loop a stage's Hessians are captured in one pass before any of its linears is
quantized, so the scale refit there (``--refit-scales``) sees inputs that come from the stage's own
*unquantized* linears (o_proj's input from unquantized q/k/v, the MLP's from an unquantized
attention). Once every stage is quantized the codes are final, and the scales can be refit once
more against what the finished model really feeds each linear:

* the calibration rows run through the stages again, the quantized model and the unquantized one
  side by side (two state sets, as error propagation keeps);
* per quantized linear ``H = X_qᵀX_q`` (the fully quantized model's inputs, upstream stages already
  refit) and ``C = X_qᵀX_f``; the target is the error-propagated ``W + β·(W* − W)``
  (:func:`~exl3_core.convert.propagation.propagated_weight`), i.e. the unquantized model's output;
* ``suh``/``svh`` are refit in closed form for the fixed codes
  (:func:`~exl3_core.quant.exl3.scale_refit.refit_scales`, kept only if the objective at the fp16
  scales drops), and the stage is re-run with its new scales so later stages see them.

The trellis is never touched and the stage files keep their layout; only ``suh``/``svh`` values
change. The refit stage files go to ``<work>/refit/`` beside the untouched originals, so a post-pass
killed half-way reruns from the originals on resume and writes byte-identical output. Nothing here
depends on wall-clock or on how the conversion was split into runs.
"""
from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exl3_core.convert.capture import HessianCapture, LinearSlot
from exl3_core.convert.dequantized import runtime_linear
from exl3_core.convert.propagation import CrossAccumulator, InputRecorder, propagated_weight
from exl3_core.convert.stages import Stage, advance_states, forward_stage, refresh_derived, replace_linear
from exl3_core.loader import save_tensors
from exl3_core.quant.exl3.hessian import HessianAccumulator, mean_hessian64
from exl3_core.quant.exl3.linear import EXL3Linear
from exl3_core.quant.exl3.regularize import rotate
from exl3_core.quant.exl3.scale_refit import refit_scales
from exl3_core.quant.exl3.trellis import decode_inner

SIGMA_REG = 0.025  # the damping LDLQ's Hessian carries (finalize_hessian's sigma_reg): the same metric
REFIT_DIR = "refit"
# The default (``exl3 convert`` without --refit-final): β = 0.5 on every device and bitrate.
# Measured (docs/quality.md): model_a 3.0 bpw, 4 seeds, mean KL 0.07960 -> 0.07500 and 4.0 bpw
# 0.02234 -> 0.02156, every seed better; the embedded 135M default model at 3.0 bpw KLD 0.1108 -> 0.1024.
# With the converter's CPU forwards on dequantized weights the three extra passes are cheap there too.
DEFAULT_BETA = 0.5


def default_beta(bpw: float, device: str) -> float:
    """The post-pass strength ``exl3 convert`` uses when none is given (the same on every device)."""
    return DEFAULT_BETA

Report = Callable[[str], None]


@dataclass
class FinalRefit:
    """One linear's post-pass refit: relative objective f/tr(AᵀHA) (A: the target) before (stored
    scales) and after (refit scales, fp16), whether it was kept, and whether C was usable."""

    key: str
    stage: int
    before: float
    after: float
    accepted: bool
    propagated: bool
    reason: str = ""


def refit_file(work_path: Path, index: int) -> Path:
    """Where the post-pass writes stage ``index``'s refit tensors (the original stays in ``stages/``)."""
    return work_path / REFIT_DIR / f"{index:04d}.safetensors"


def damped_hessian(h_sum: torch.Tensor, count: int, k: int) -> torch.Tensor:
    """``Σ XᵀX / count`` zero-padded to ``k`` and damped like LDLQ's (``SIGMA_REG``·mean diag), fp64."""
    kt = h_sum.shape[0]
    h = mean_hessian64(h_sum, max(count, 1), k)
    h.diagonal()[:kt].add_(SIGMA_REG * float(h.diagonal()[:kt].mean()))
    return h


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _swap(st: Stage, slots: Sequence[LinearSlot], modules: dict[str, torch.nn.Module], device: torch.device) -> None:
    for s in slots:
        if s.key in modules:
            replace_linear(s.parent, s.attr, modules[s.key])
    refresh_derived(st, torch.float32, device)  # MoE stacks, folded latent-attention weights


def _refit_linear(key: str, stage: int, lin: EXL3Linear, weight: torch.Tensor, acc: HessianAccumulator | None,
                  cross: CrossAccumulator | None, beta: float) -> tuple[FinalRefit, torch.Tensor, torch.Tensor]:
    """Refit one linear's scales; returns the record and the (possibly unchanged) fp16 suh/svh."""
    su, sv = lin.suh, lin.svh
    if acc is None or acc.h_sum is None or acc.count == 0:
        return FinalRefit(key, stage, 0.0, 0.0, False, False, "no calibration input"), su, sv
    dev = acc.h_sum.device
    k, n = lin.padded_in_features, lin.padded_out_features
    h = damped_hessian(acc.h_sum, acc.count, k)
    w = weight.detach().to(dev, torch.float32)  # HF orientation [out, in]
    propagated = cross is not None and cross.valid and cross.c_sum is not None
    if propagated:
        assert cross is not None and cross.c_sum is not None
        w = propagated_weight(w, acc.h_sum, cross.c_sum, beta)
    aim = torch.zeros(k, n, dtype=torch.float32, device=dev)
    aim[: lin.in_features, : lin.out_features] = w.T
    m = rotate(rotate(decode_inner(lin.trellis.to(dev), lin.K, lin.codebook).to(torch.float32), 0), 1)
    r = refit_scales(aim, m, su.to(dev, torch.float32), sv.to(dev, torch.float32), h,
                     in_features=lin.in_features, out_features=lin.out_features)
    rec = FinalRefit(key, stage, r.before, r.after, r.accepted, propagated, r.reason)
    if not r.accepted:
        return rec, su, sv
    return rec, r.su.to(torch.float16), r.sv.to(torch.float16)


def final_refit(model: Any, stages: Sequence[Stage], slots: dict[int, list[LinearSlot]], files: Sequence[Path],
                ids: torch.Tensor, beta: float, device: torch.device | str, *, chunks: Sequence[slice],
                work_path: Path, home: Callable[[int], torch.device] | None = None,
                report: Report | None = None) -> tuple[list[Path], list[FinalRefit]]:
    """Refit every quantized linear's ``suh``/``svh`` from the finished model's inputs (module docstring).

    :param model: the converter's model; each slot's ``module`` must still be its unquantized linear.
    :param stages: the conversion stages in forward order; ``files`` their finished stage files.
    :param ids: the calibration token ids ``[rows, cols]``; ``chunks`` the row slices per forward call.
    :param beta: strength of the error-propagated target in (0, 1].
    :param work_path: the work directory; refit stage files go to its ``refit/`` folder.
    :param home: where states of a given byte size live (default: the host).
    :returns: the stage files to write (refit ones where any scale changed) and one record per linear.
    On return every stage runs with its quantized (refit) linears installed.
    """
    if not 0.0 < beta <= 1.0:
        raise ValueError(f"--refit-final {beta}: the strength must be in (0, 1]")
    if len(files) != len(stages):
        raise ValueError(f"final_refit: {len(files)} stage files for {len(stages)} stages")
    dev = torch.device(device)
    home = home or (lambda nbytes: torch.device("cpu"))
    say = report or (lambda s: None)
    shutil.rmtree(work_path / REFIT_DIR, ignore_errors=True)  # leftovers of a killed post-pass
    out_files = list(files)
    records: list[FinalRefit] = []
    x_q: torch.Tensor = ids
    x_f: torch.Tensor | None = None  # the unquantized model's states; None while both models agree
    with torch.no_grad():
        for st, path in zip(stages, files, strict=True):
            tensors = _load(path)
            fslots = [s for s in slots[st.index] if f"{s.key}.trellis" in tensors]
            if not fslots:  # nothing quantized here: both models run the same module
                if st.kind != "head":
                    x_q = advance_states(model, st, x_q, ids, chunks, dev, home)
                    x_f = None if x_f is None else advance_states(model, st, x_f, ids, chunks, dev, home)
                continue
            if x_f is None:
                x_f = x_q
            qlins = {s.key: EXL3Linear.from_tensors(s.key, tensors.get, s.in_features, s.out_features).to(dev)
                     for s in fslots}
            runs = {s.key: runtime_linear(s.key, tensors.get, s.in_features, s.out_features, dev) for s in fslots}
            accs, crosses, fp_out = _capture(model, st, fslots, runs, x_q, x_f, ids, chunks, dev, home)
            changed = False
            for s in fslots:
                lin = qlins[s.key]
                w = s.module.weight
                assert isinstance(w, torch.Tensor), f"{s.key}: the unquantized linear has no weight tensor"
                rec, su, sv = _refit_linear(s.key, st.index, lin, w, accs.get(s.key), crosses.get(s.key), beta)
                records.append(rec)
                mark = "" if rec.accepted else f" kept ({rec.reason})"
                say(f"    refit-final {s.key:<52} {rec.before:.6f}->{rec.after:.6f}{mark}")
                if rec.accepted:
                    tensors[f"{s.key}.suh"], tensors[f"{s.key}.svh"] = su.cpu(), sv.cpu()
                    runs[s.key] = runtime_linear(s.key, tensors.get, s.in_features, s.out_features, dev)
                    changed = True
            _swap(st, fslots, runs, dev)  # the stage now runs with its refit scales
            if changed:
                out_files[st.index] = refit_file(work_path, st.index)
                out_files[st.index].parent.mkdir(parents=True, exist_ok=True)
                save_tensors(tensors, out_files[st.index])
            if st.kind != "head":
                x_q = advance_states(model, st, x_q, ids, chunks, dev, home)
                x_f = fp_out
    return out_files, records


def _capture(model: Any, st: Stage, fslots: list[LinearSlot], qlins: dict[str, torch.nn.Module], x_q: torch.Tensor,
             x_f: torch.Tensor, ids: torch.Tensor, chunks: Sequence[slice], dev: torch.device,
             home: Callable[[int], torch.device],
             ) -> tuple[dict[str, HessianAccumulator], dict[str, CrossAccumulator], torch.Tensor | None]:
    """Per linear key: ``Σ X_qᵀX_q`` and ``Σ X_qᵀX_f`` (shared within an input group), and the
    unquantized stage's output on ``x_f`` (None for the head, whose input is the stage input)."""
    accs: dict[str, HessianAccumulator] = {}
    if st.kind == "head":  # every head linear reads the stage input: no vocabulary-wide forward
        k = fslots[0].in_features
        acc, cross = HessianAccumulator(k, name=f"{st.name} input"), CrossAccumulator()
        for c in chunks:
            xq = x_q[c].to(dev).reshape(-1, k)
            acc.add(xq)
            cross.add(xq, x_f[c].to(dev).reshape(-1, k))
        return {s.key: acc for s in fslots}, {s.key: cross for s in fslots}, None

    originals = {s.key: s.module for s in fslots}
    # the quantized pass hooks the quantized modules; group leaders are observed as in the stage loop
    qslots = [LinearSlot(s.key, s.parent, s.attr, s.path, qlins[s.key], True) for s in fslots]
    partner: dict[str, torch.Tensor] = {}
    crosses: dict[str, CrossAccumulator] = {}  # by group leader

    def observe(leader: str, xq: torch.Tensor) -> None:
        crosses.setdefault(leader, CrossAccumulator()).add(xq, partner.get(leader))

    qcap = HessianCapture(st.module, qslots, observer=observe)
    fp_outs: list[torch.Tensor] = []
    where: torch.device | None = x_f.device if x_f.is_floating_point() else None
    for c in chunks:
        _swap(st, fslots, originals, dev)
        # a paused capture only for its MoE hook: every expert sees every token, as in the quantized pass
        with HessianCapture(st.module, fslots, paused=True), InputRecorder(fslots) as rec:
            y = forward_stage(model, st, x_f[c].to(dev), ids[c].to(dev)).float()
        if where is None:  # token ids in: the states' home is chosen by their size
            where = home(x_f.numel() * y.shape[-1] * y.element_size())
        fp_outs.append(y.to(where))  # the chunk goes home at once: never a whole state set extra on the device
        partner = rec.inputs
        _swap(st, fslots, qlins, dev)
        with qcap:  # entered per chunk: its hooks must only ever see the quantized modules
            qcap.next_batch()
            forward_stage(model, st, x_q[c].to(dev), ids[c].to(dev))
        partner = {}
    fp_out = torch.cat(fp_outs)
    by_key: dict[str, CrossAccumulator] = {}
    for s in qslots:  # every linear of a group shares its leader's sums
        leader = s.group or s.key
        if leader in qcap.accumulators:
            accs[s.key] = qcap.accumulators[leader]
        if leader in crosses:
            by_key[s.key] = crosses[leader]
    return accs, by_key, fp_out
