"""Loaded before every other conftest, for tests/ and plugins/ alike: the OpenMP wait policy must be set
before torch is imported, so that idle OpenMP threads sleep instead of spinning while the suite shares a busy
machine; and the ``cuda``/``slow`` skipping applies to every test path."""
from exl3_core.threads import prepare_env

if not prepare_env():
    import warnings

    warnings.warn("torch was imported before conftest.py; OMP_WAIT_POLICY could not be set", stacklevel=1)

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``cuda`` tests without a GPU, and ``slow`` tests unless the ``-m`` expression names them
    (``pytest -m slow`` runs them; the plain ``pytest`` of CI does not)."""
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    slow = pytest.mark.skip(reason="long-running; run with -m slow")
    run_slow = "slow" in (config.getoption("markexpr") or "")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        elif "slow" in item.keywords and not run_slow:
            item.add_marker(slow)
