"""The public facade is a deliberate list: changing it must change this snapshot."""
from __future__ import annotations

import subprocess
import sys

import exl3_core

SNAPSHOT = [
    "AsyncGenerator", "AsyncJob", "AttnArgs", "AttnSpec", "BatchMeta", "Cache", "Config", "Filter",
    "Generator", "Job", "Model", "Sampler", "SamplingStep", "Tokenizer", "__version__", "get_plugins",
    "hookimpl", "load_plugins",
]


def test_all_matches_snapshot() -> None:
    assert sorted(exl3_core.__all__) == sorted(SNAPSHOT)


def test_every_public_name_resolves() -> None:
    for name in exl3_core.__all__:
        assert getattr(exl3_core, name) is not None, name


def test_import_is_light() -> None:
    code = "import sys, exl3_core; print(int('torch' in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0", "import exl3_core must not import torch (plugins load it in every process)"
