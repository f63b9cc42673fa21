"""``exl3 optimize``: the exact allocation, and measure -> allocate -> compile on a tiny model."""
from __future__ import annotations

import itertools
import json
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from convert_tiny import build_tiny, load  # noqa: E402

from exl3_core.convert.optimize import BUDGET_UNIT, Group, Measurement, allocate, optimize, predicted_kl  # noqa: E402
from exl3_core.convert.workdir import ResumeError  # noqa: E402
from exl3_core.loader import SafetensorsCollection  # noqa: E402


def _instance(seed: int) -> tuple[list[Group], Measurement]:
    rng = random.Random(seed)
    ks = sorted(rng.sample(range(1, 9), 3))
    groups = [Group(f"g{i}", i, (f"g{i}.w",), BUDGET_UNIT * rng.randint(1, 4)) for i in range(5)]
    kl = {}
    for g in groups:
        base = rng.uniform(0.01, 1.0)
        kl[g.name] = {str(k): base * 2.0 ** -(k * rng.uniform(0.7, 1.3)) for k in ks}
    return groups, Measurement({}, ks, 1, 2, {}, kl)


@pytest.mark.parametrize("seed", range(6))
def test_allocation_is_the_brute_force_optimum(seed: int) -> None:
    groups, m = _instance(seed)
    ks = m.candidates
    total = sum(g.numel for g in groups)
    rng = random.Random(100 + seed)
    budget = int(rng.uniform(ks[0], ks[-1]) * total)
    alloc = allocate(groups, m, budget)
    assert sum(alloc[g.name] * g.numel for g in groups) <= budget
    best = min((c for c in itertools.product(ks, repeat=len(groups))
                if sum(k * g.numel for k, g in zip(c, groups, strict=True)) <= budget),
               key=lambda c: sum(m.kl[g.name][str(k)] for k, g in zip(c, groups, strict=True)))
    brute = {g.name: k for g, k in zip(groups, best, strict=True)}
    assert predicted_kl(groups, m, alloc) == pytest.approx(predicted_kl(groups, m, brute), rel=1e-12)


def test_allocation_below_the_smallest_candidate_is_an_error() -> None:
    groups, m = _instance(0)
    with pytest.raises(ValueError, match="below the smallest candidate"):
        allocate(groups, m, sum(g.numel for g in groups) * m.candidates[0] - 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("LlamaForCausalLM", tmp_path_factory.mktemp("opt") / "hf", layers=2)


CAL = {"cal_rows": 4, "cal_cols": 32, "measure_rows": 2, "measure_cols": 16, "candidates": (2, 3)}


@pytest.fixture(scope="module")
def optimized(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    base = tmp_path_factory.mktemp("optimized")
    res = optimize(tiny, base / "out", 2.5, work_dir=base / "work", progress=False, report=lambda s: None, **CAL)
    return base, res


def test_optimize_measures_allocates_compiles_and_resumes(tiny: Path, optimized: tuple[Path, dict]) -> None:
    tmp_path, res = optimized
    work = tmp_path / "work"
    assert 2.0 <= res["bits"] <= 2.5
    ks = set(res["allocation"].values())
    assert ks <= {2, 3}
    # the final conversion quantized every group at its chosen K (the trellis' last dim is 16 K);
    # the model loads and runs, and no conversion work folder is left behind
    alloc = json.loads((work / "allocation.json").read_text())["allocation"]
    assert len(set(alloc.values())) == 2, alloc  # a mixed allocation exercises bits_fixed
    with SafetensorsCollection(tmp_path / "out") as out:
        for leader, k in alloc.items():
            assert out.get_tensor(f"{leader}.trellis").shape[-1] == 16 * k, leader
    ids = torch.randint(0, 256, (1, 12))
    assert torch.isfinite(load(tmp_path / "out")(ids)).all()
    qc = json.loads((tmp_path / "out" / "quantization_config.json").read_text())
    assert qc["bits"] == round(res["bits"], 2)
    assert not list(work.glob("final-*.work"))

    # --assemble: every chosen group's tensors are its candidate's, byte for byte, at the same size
    resa = optimize(tiny, tmp_path / "outa", 2.5, work_dir=work, resume=True, assemble=True, progress=False,
                    report=lambda s: None, **CAL)
    assert resa["allocation"] == res["allocation"] and resa["bits"] == res["bits"]
    with SafetensorsCollection(tmp_path / "outa") as out:
        for leader, k in alloc.items():
            with SafetensorsCollection(work / f"cand-{k}") as cand:
                assert torch.equal(out.get_tensor(f"{leader}.trellis"), cand.get_tensor(f"{leader}.trellis"))
    assert torch.isfinite(load(tmp_path / "outa")(ids)).all()

    # another target from the same work directory reuses candidates and measurement
    m_before = (work / "measurement.json").read_text()
    res3 = optimize(tiny, tmp_path / "out3", 3.0, work_dir=work, resume=True, progress=False,
                    report=lambda s: None, **CAL)
    assert set(res3["allocation"].values()) == {3}
    assert (work / "measurement.json").read_text() == m_before

    with pytest.raises(ValueError, match="outside what the candidates"):
        optimize(tiny, tmp_path / "out4", 3.5, work_dir=work, resume=True, progress=False, **CAL)
    with pytest.raises(ResumeError, match="different arguments"):
        optimize(tiny, tmp_path / "out5", 2.5, work_dir=work, resume=True, progress=False, **{**CAL, "seed": 1})
    with pytest.raises(ResumeError, match="pass --resume"):
        optimize(tiny, tmp_path / "out6", 2.5, work_dir=work, progress=False, **CAL)
    with pytest.raises(FileExistsError, match="not empty"):
        optimize(tiny, tmp_path / "out", 2.5, work_dir=work, resume=True, progress=False, **CAL)
    assert not (tmp_path / "out4").exists() and not (tmp_path / "out5").exists()


def test_measurement_of_another_model_is_refused(tiny: Path, optimized: tuple[Path, dict], tmp_path: Path) -> None:
    other = build_tiny("LlamaForCausalLM", tmp_path / "other", seed=1, layers=1)
    work = optimized[0] / "work"
    with pytest.raises(ResumeError, match="another model"):
        optimize(other, tmp_path / "out2", 2.5, work_dir=tmp_path / "work2", measurement=work / "measurement.json",
                 progress=False, report=lambda s: None, **CAL)
    with pytest.raises(ResumeError, match="measured the bitrates"):
        optimize(tiny, tmp_path / "out3", 3.0, work_dir=tmp_path / "work3", measurement=work / "measurement.json",
                 progress=False, report=lambda s: None, **{**CAL, "candidates": (3, 4)})


def test_bits_fixed_for_a_tensor_the_model_lacks_is_refused(tiny: Path, tmp_path: Path) -> None:
    from exl3_core.convert.pipeline import convert

    with pytest.raises(ValueError, match="model.layers.7.mlp.up_proj is not a quantized tensor"):
        convert(tiny, tmp_path / "out", 3.0, cal_rows=2, cal_cols=16, bits_fixed={"model.layers.7.mlp.up_proj": 3},
                progress=False, report=lambda s: None)
    assert not (tmp_path / "out").exists()
