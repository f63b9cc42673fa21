"""The Triton attention and LoRA kernels compile for an sm_90 GPU (tests/kernels/sm90_compile.py): the interpreter
runs them on the CPU without compiling, so a kernel the compiler refuses would pass every other CPU test."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia", reason="Triton without its NVIDIA backend cannot compile for sm_90")
SCRIPT = Path(__file__).with_name("sm90_compile.py")


@pytest.mark.parametrize("dtypes", ["fp16,fp32", pytest.param("bf16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("views", ["kv/fp16-decode", "kv/quant-decode", "mla/quant-decode", "kv/quant-prefill", "lora"])
def test_kernels_compile_for_sm90(views: str, dtypes: str) -> None:
    """Attention decode steps (one query per sequence and several) over the fp16 and quantized cache views,
    quantized prefill (``views`` selects the conformance cases) and ``lora``, the LoRA kernel pair. bf16 takes
    the fp16 cases' code paths with another element type, so it runs with the slow tests."""
    out = subprocess.run([sys.executable, str(SCRIPT), views, dtypes], capture_output=True, text=True, timeout=600,
                         check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("ok ", "FAIL "))]
    assert lines, out.stdout + out.stderr
    assert out.returncode == 0 and all(ln.startswith("ok ") for ln in lines), "\n".join(lines) + out.stderr[-3000:]
