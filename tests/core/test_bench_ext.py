"""The bench extension's hook in ``exl3 bench`` (exl3_core.bench.run.decode_only_op): the decode-only ceiling
kernel lives in bench/ext, outside exl3_core._C, and is found, or refused with the fix, on any machine."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exl3_core.bench import run as bench_run
from exl3_core.bench.models import parse_shape
from exl3_core.cli import main as cli_main

TINY = "custom(64,128,2,4,2,256)"


def test_missing_explicit_library_is_refused_with_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lib = tmp_path / "exl3_bench.so"
    with pytest.raises(FileNotFoundError, match=r"--ceiling-lib .*exl3_bench\.so.*python bench/ext/build\.py"):
        bench_run.decode_only_op(lib)
    # run_bench checks it before building anything, on any device
    with pytest.raises(FileNotFoundError, match="python bench/ext/build.py"):
        bench_run.run_bench(parse_shape(TINY), device="cpu", ceiling_lib=lib, log=lambda s: None)
    assert cli_main(["bench", "--shape", TINY, "--device", "cpu", "--ceiling-lib", str(lib)]) == 1
    assert "--ceiling-lib" in capsys.readouterr().err


def test_unbuilt_checkout_library_means_no_ceiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if hasattr(torch.ops.exl3_bench, "decode_only"):
        pytest.skip("the bench extension is already loaded in this process")
    monkeypatch.setattr(bench_run, "BENCH_LIB", tmp_path / "build" / "exl3_bench.so")
    assert bench_run.decode_only_op() is None


def test_default_library_path_is_the_build_scripts_output() -> None:
    build_py = Path(bench_run.__file__).resolve().parents[2] / "bench" / "ext" / "build.py"
    if not build_py.is_file():
        pytest.skip("not a source checkout")
    text = build_py.read_text()
    assert 'BUILD = HERE / "build"' in text and '"exl3_bench"' in text
    assert bench_run.BENCH_LIB == build_py.parent / "build" / "exl3_bench.so"
