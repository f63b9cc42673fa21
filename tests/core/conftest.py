"""Fixtures shared by the generator and cache tests: the core's own plugins (no entry points) and
the small toy model of ``exl3_core.generator.toy``."""
from __future__ import annotations

from typing import Any

import pytest

from exl3_core.generator.toy import ToyModel
from exl3_core.plugins import load_plugins

TOY_VOCAB = 264  # 256 bytes + specials of ByteTokenizer


@pytest.fixture(scope="module")
def plugins() -> Any:
    return load_plugins(autoload=False)


@pytest.fixture(scope="module")
def model() -> ToyModel:
    return ToyModel(vocab_size=TOY_VOCAB, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, seed=1)
