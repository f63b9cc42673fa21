"""Launch options of the Triton kernels (exl3_core/kernels/pdl.py, launch.py) on the CPU.

The GPU behaviour (PDL on vs off give the same results, graph replays see fresh inputs) is in
tests/gpu/test_pdl_gpu.py; here: the plan's tuning reaches the launches of its forward and no further,
and CPU tensors never ask for a PDL launch (the interpreter and CPU paths must not see ``launch_pdl``)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from exl3_core.kernels.launch import LaunchConfig, current, launch_config, pdl_requested
from exl3_core.tuning import KernelTuning, Tuning


def test_launch_config_is_scoped() -> None:
    assert pdl_requested() is True and current().predecode == 2
    with launch_config(LaunchConfig(pdl=False, predecode=0)):
        assert pdl_requested() is False and current().predecode == 0
        with launch_config(LaunchConfig(pdl=True, predecode=1)):
            assert current() == LaunchConfig(True, 1)
        assert current() == LaunchConfig(False, 0)
    assert current() == LaunchConfig()


def test_plan_forward_launches_with_its_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    from exl3_core.archkit.batch import BatchMeta
    from exl3_core.bench.models import build_model, parse_shape
    from exl3_core.plan import ExecutionPlan

    model, _ = build_model(parse_shape("custom(128,256,1,4,2,100)"), device="cpu", dtype=torch.float32, seed=1)
    seen: list[LaunchConfig] = []
    block = model.layers[0]
    orig = type(block).forward

    def spy(self, x, state):  # noqa: ANN001, ANN202
        seen.append(current())
        return orig(self, x, state)

    monkeypatch.setattr(type(block), "forward", spy)
    tuning = dataclasses.replace(Tuning.generic(), kernels=KernelTuning(pdl=False, predecode=0))
    ExecutionPlan(model, tuning).forward(BatchMeta.full(torch.tensor([[3, 5, 7]])))
    assert seen == [LaunchConfig(pdl=False, predecode=0)]
    assert current() == LaunchConfig(), "nothing outlives the forward"


def test_kernel_tuning_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="predecode"):
        KernelTuning(predecode=3)
    with pytest.raises(ValueError, match="fused_linear_max_rows"):
        KernelTuning(fused_linear_max_rows=17)


def test_cpu_tensors_get_no_pdl_launch() -> None:
    pytest.importorskip("triton")
    from exl3_core.kernels.pdl import early_launch, launch_opts

    x = torch.zeros(2, 8)
    assert early_launch(x) is False
    assert launch_opts(x) == {"PDL": False}
