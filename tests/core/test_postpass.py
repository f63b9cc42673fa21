"""Post-pass scale refit from the finished model (convert/postpass.py, ``convert(refit_final=β)``).

On a tiny random 2-block Llama: the post-pass changes only suh/svh (every trellis bit-identical);
an independent oracle (the loaded checkpoints run by ``Model.forward``, inputs caught by plain
hooks, the target and the objective written out in fp64) shows the objective against the
error-propagated target, measured with the fully quantized model's inputs, drops for every linear;
β = 0 (the CPU default) never runs the post-pass; stop/resume and a kill inside the post-pass stay
byte-identical.
"""
from __future__ import annotations

import itertools

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from convert_tiny import build_tiny, load  # noqa: E402

from exl3_core.convert import postpass  # noqa: E402
from exl3_core.convert.pipeline import ConvertArgs, convert  # noqa: E402
from exl3_core.quant.exl3.linear import EXL3Linear  # noqa: E402

BPW = 3.0
BETA = 0.5
CAL = {"cal_rows": 6, "cal_cols": 32}
DAMP = 0.025  # the relative diagonal damping of H in both the target's solve and the objective


def _convert(src: Path, out: Path, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer in the tiny model: random calibration rows
        return convert(src, out, BPW, progress=False, report=lambda s: None, **CAL, **kw)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for p in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(p)))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("postpass")
    src = build_tiny("LlamaForCausalLM", tmp / "src", layers=2)
    def boom(*a: Any, **k: Any) -> Any:
        raise AssertionError("the post-pass ran with refit_final=0")

    with pytest.MonkeyPatch.context() as mp:  # off: the post-pass must not even be called
        mp.setattr(postpass, "final_refit", boom)
        _convert(src, tmp / "off", refit_final=0.0, work_dir=tmp / "off.work")
    _convert(src, tmp / "on", refit_final=BETA, work_dir=tmp / "on.work")  # kept: its calibration ids
    return {"src": src, "off": tmp / "off", "on": tmp / "on", "work": tmp / "on.work", "off_work": tmp / "off.work"}


def test_only_scales_change_and_trellis_is_bit_identical(runs: dict[str, Path]) -> None:
    off, on = _tensors(runs["off"]), _tensors(runs["on"])
    assert sorted(off) == sorted(on)
    changed = 0
    for name, t in off.items():
        if name.endswith((".suh", ".svh")):
            assert on[name].dtype == t.dtype and on[name].shape == t.shape
            assert bool(torch.isfinite(on[name]).all())
            changed += not torch.equal(on[name], t)
        else:  # trellis, codebook markers, norms, embedding: untouched, bit for bit
            assert on[name].dtype == t.dtype and torch.equal(on[name], t), f"{name} changed"
    n_scales = sum(n.endswith((".suh", ".svh")) for n in off)
    assert changed >= n_scales // 2, f"only {changed} of {n_scales} scale vectors refit"
    # the headers and configs describe the same checkpoint
    for name in ("config.json", "quantization_config.json"):
        assert (runs["off"] / name).read_bytes() == (runs["on"] / name).read_bytes()


def _inputs(model: Any, ids: torch.Tensor, keys: set[str], cls: type) -> dict[str, torch.Tensor]:
    """fp64 ``[tokens, in]`` input of each linear of type ``cls`` whose key is in ``keys``."""
    got: dict[str, list[torch.Tensor]] = {}
    handles = []
    for m in model.modules():
        if isinstance(m, cls) and getattr(m, "key", None) in keys:
            def hook(mod: Any, args: Any, key: str = m.key) -> None:
                got.setdefault(key, []).append(args[0].detach().reshape(-1, args[0].shape[-1]).double())
            handles.append(m.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return {k: torch.cat(v)[:, : next(m for m in model.modules() if getattr(m, "key", None) == k and
                                         isinstance(m, cls)).in_features] for k, v in got.items()}


def test_objective_against_propagated_target_drops_for_every_linear(runs: dict[str, Path]) -> None:
    from safetensors.torch import load_file

    from exl3_core.nn.linear import DenseLinear

    ids = load_file(str(runs["work"] / "calibration.safetensors"))["input_ids"]
    fp = load(runs["src"])
    q_on, q_off = load(runs["on"]), load(runs["off"])
    on_lin = {m.key: m for m in q_on.modules() if isinstance(m, EXL3Linear)}
    off_lin = {m.key: m for m in q_off.modules() if isinstance(m, EXL3Linear)}
    dense = {m.key: m for m in fp.modules() if isinstance(m, DenseLinear)}
    stages: dict[str, list[str]] = {}
    for key in on_lin:  # a block's linears share a stage; the head is one of its own
        stages.setdefault(key.rsplit(".", 2)[0] if ".layers." in key else key, []).append(key)
    assert len(stages) == 3 and len(on_lin) == 15
    x_f = _inputs(fp, ids, set(on_lin), DenseLinear)
    checked = 0
    for keys in stages.values():
        # the post-pass saw this stage with the stages before it refit and its own scales not yet
        saved = {k: (on_lin[k].suh, on_lin[k].svh) for k in keys}
        for k in keys:
            on_lin[k].suh, on_lin[k].svh = off_lin[k].suh, off_lin[k].svh
        x_q = _inputs(q_on, ids, set(keys), EXL3Linear)
        for k in keys:
            on_lin[k].suh, on_lin[k].svh = saved[k]
        for k in keys:
            xq, xf = x_q[k], x_f[k]
            h, c = xq.T @ xq, xq.T @ xf
            w = dense[k].weight.double()  # [out, in]
            lam = DAMP * float(h.diagonal().mean())
            star = w.T + torch.linalg.inv(h + lam * torch.eye(h.shape[0], dtype=h.dtype)) @ (c - h) @ w.T
            aim = w.T + BETA * (star - w.T)  # [in, out]
            hd = h / xq.shape[0]
            hd = hd + DAMP * float(hd.diagonal().mean()) * torch.eye(hd.shape[0], dtype=hd.dtype)

            def objective(lin: EXL3Linear) -> float:
                e = aim - lin.dequantize().double()
                return float((e * (hd @ e)).sum())

            f_off, f_on = objective(off_lin[k]), objective(on_lin[k])
            assert torch.equal(on_lin[k].trellis, off_lin[k].trellis)
            assert f_on <= f_off * (1 + 1e-6), f"{k}: objective {f_off:.6g} -> {f_on:.6g}"
            checked += f_on < f_off
    assert checked >= 12, f"only {checked} of 15 linears improved"


def test_off_never_runs_the_post_pass(runs: dict[str, Path]) -> None:
    # the fixture converted "off" with final_refit replaced by a function that fails the test
    assert not (runs["off_work"] / postpass.REFIT_DIR).exists()
    assert (runs["work"] / postpass.REFIT_DIR).is_dir()
    with pytest.raises(ValueError, match="--refit-final"):
        ConvertArgs(in_dir="a", out_dir="b", bpw=3.0, refit_final=1.5).validate()
    assert ConvertArgs(in_dir="a", out_dir="b", bpw=3.0).refit_final == 0.0


def test_stop_resume_and_kill_inside_the_post_pass_stay_byte_identical(
        runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    res = _convert(runs["src"], out, refit_final=BETA, work_dir=work, _stop_after_module=1)
    assert not res.completed and not out.exists()
    real = postpass.save_tensors
    writes: list[Path] = []

    class Killed(Exception):
        pass

    def dies_on_second(tensors: Any, path: Any) -> Any:
        if writes:
            raise Killed
        writes.append(Path(path))
        return real(tensors, path)

    monkeypatch.setattr(postpass, "save_tensors", dies_on_second)
    with pytest.raises(Killed):  # resumed, finishes the stages, dies after one refit stage file
        _convert(runs["src"], out, refit_final=BETA, work_dir=work, resume=True)
    assert writes and writes[0].is_file() and not out.exists()
    monkeypatch.setattr(postpass, "save_tensors", real)
    res = _convert(runs["src"], out, refit_final=BETA, work_dir=work, resume=True)  # reruns the post-pass
    assert res.completed and _files(out) == _files(runs["on"])
    with pytest.raises(ValueError, match="refit_final: was 0.5, now 0.25"):
        _convert(runs["src"], tmp_path / "o2", refit_final=0.25, work_dir=work, resume=True)


def test_default_beta_is_the_same_on_every_device_and_bitrate() -> None:
    # CPU and CUDA conversions share their defaults, so their results differ only by arithmetic
    for bpw, dev in itertools.product((2.0, 3.0, 3.5, 4.0, 8.0), ("cpu", "cuda", "cuda:1")):
        assert postpass.default_beta(bpw, dev) == postpass.DEFAULT_BETA == 0.5


def test_resume_keeps_the_recorded_setting(runs: dict[str, Path], tmp_path: Path) -> None:
    """convert(resume=True) without refit_final adopts what the job file recorded, not today's default."""
    from exl3_core.convert.pipeline import _recorded_arg

    assert _recorded_arg(runs["on"], runs["work"], "refit_final", 0.0) == BETA
    assert _recorded_arg(runs["off"], runs["off_work"], "refit_final", 0.0) == 0.0
    assert _recorded_arg(tmp_path / "none", None, "refit_final", 0.0) is None  # nothing to resume
