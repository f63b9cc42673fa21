"""EXL3_PDL and the launch options of the Triton kernels (exl3_core/kernels/pdl.py) on the CPU.

The GPU behaviour (PDL on vs off give the same results, graph replays see fresh inputs) is in
tests/gpu/test_pdl_gpu.py; here: the setting parses, and CPU tensors never ask for a PDL launch
(the interpreter and CPU paths must not see ``launch_pdl``)."""
from __future__ import annotations

import pytest
import torch

from exl3_core import settings


def test_pdl_setting_default_and_off(clean_settings: pytest.MonkeyPatch) -> None:
    assert settings.get().pdl is True
    clean_settings.setenv("EXL3_PDL", "0")
    settings.reload()
    assert settings.get().pdl is False


def test_pdl_setting_rejects_garbage(clean_settings: pytest.MonkeyPatch) -> None:
    clean_settings.setenv("EXL3_PDL", "sometimes")
    with pytest.raises(ValueError, match="EXL3_PDL"):
        settings.reload()
        settings.get()


def test_cpu_tensors_get_no_pdl_launch(clean_settings: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from exl3_core.kernels.pdl import early_launch, launch_opts

    x = torch.zeros(2, 8)
    assert early_launch(x) is False
    assert launch_opts(x) == {"PDL": False}


@pytest.mark.parametrize("value,mode", [(None, 2), ("0", 0), ("1", 1), ("2", 2)])
def test_predecode_setting(clean_settings: pytest.MonkeyPatch, value: str | None, mode: int) -> None:
    if value is not None:
        clean_settings.setenv("EXL3_PREDECODE", value)
        settings.reload()
    assert settings.get().predecode == mode


@pytest.mark.parametrize("value", ["3", "-1", "on"])
def test_predecode_setting_rejects_other_values(clean_settings: pytest.MonkeyPatch, value: str) -> None:
    clean_settings.setenv("EXL3_PREDECODE", value)
    with pytest.raises(ValueError, match="EXL3_PREDECODE"):
        settings.reload()
        settings.get()
