"""run_on_streams off CUDA: the jobs run in order, results in order, errors pass through."""
from __future__ import annotations

import pytest
import torch

from exl3_core.convert.concurrent import run_on_streams


def test_cpu_runs_in_order() -> None:
    seen: list[int] = []

    def job(i: int):  # noqa: ANN202
        return lambda: seen.append(i) or i * i

    assert run_on_streams([job(i) for i in range(4)], torch.device("cpu")) == [0, 1, 4, 9]
    assert seen == [0, 1, 2, 3]


def test_cpu_error_passes_through() -> None:
    def bad() -> int:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_on_streams([lambda: 1, bad], torch.device("cpu"))
