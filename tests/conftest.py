"""Shared fixtures: device selection, seeded RNG, isolated plugin sets (CUDA and slow skipping: ../conftest.py)."""
from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter. Triton reads this switch when a
# kernel is decorated, so it must be set before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TESTS = Path(__file__).resolve().parent
DATA = TESTS / "data"


def _fake_install(root: Path, dist: str, version: str, entry_points: str) -> None:
    """A dist-info folder under ``root``: what importlib.metadata finds for an installed distribution."""
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(entry_points)


#: the session's fake installation of tests/plugins/exl3_dummy_arch (see pytest_configure)
_DUMMY_ROOT: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Install the dummy architecture plugin (tests/plugins/exl3_dummy_arch) for the tests alone: a
    dist-info with its entry point in a temporary folder on ``sys.path`` (and on PYTHONPATH, for the
    tests' subprocesses), the package source beside it. scripts/install.sh does not install it, so no
    user's registry or ``exl3 plugins`` holds a fake architecture. Done before collection, so that
    every plugin set a test module builds sees it."""
    global _DUMMY_ROOT
    _DUMMY_ROOT = Path(tempfile.mkdtemp(prefix="exl3-test-plugins-"))
    _fake_install(_DUMMY_ROOT, "exl3-dummy-arch", "0.0.1", "[exl3]\ndummy = exl3_dummy_arch\n")
    paths = [str(_DUMMY_ROOT), str(TESTS / "plugins" / "exl3_dummy_arch" / "src")]
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _DUMMY_ROOT is not None:
        shutil.rmtree(_DUMMY_ROOT, ignore_errors=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default=None, help="torch device for GPU tests (default: cuda:0 when present)")


@pytest.fixture
def device(request: pytest.FixtureRequest) -> torch.device:
    opt = request.config.getoption("--device")
    if opt:
        return torch.device(opt)
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(1234)
    torch.manual_seed(1234)


@pytest.fixture
def broken_plugin(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """An installed-looking ``exl3`` plugin whose import fails (tests/plugins/exl3_broken_plugin), for
    this test only: a dist-info with its entry point in a temporary directory on ``sys.path``, the
    package source beside it. Returns the environment a subprocess needs to see it too. (It is not
    installed by scripts/install.sh, so users' ``exl3`` commands never warn about it.)"""
    _fake_install(tmp_path, "exl3-broken-plugin", "0.0.1", "[exl3]\nbroken = exl3_broken_plugin\n")
    src = TESTS / "plugins" / "exl3_broken_plugin" / "src"
    for d in (str(src), str(tmp_path)):
        monkeypatch.syspath_prepend(d)
    path = os.pathsep.join([str(tmp_path), str(src), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "PYTHONPATH": path}


@pytest.fixture
def clean_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Drop every EXL3_* variable for the test and re-read settings before and after."""
    from exl3_core import settings

    for k in list(os.environ):
        if k.startswith("EXL3_"):
            monkeypatch.delenv(k)
    settings.reload()
    yield monkeypatch
    monkeypatch.undo()
    settings.reload()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models on a shared 2-core machine: thread hand-offs cost far more than the math."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def plugins():
    """A plugin set with only the core built-ins (tests never depend on what is installed)."""
    from exl3_core.plugins import load_plugins

    return load_plugins(autoload=False)
