"""The default model: a small GGUF shipped in a PyPI package, imported once into the cache.

Which package holds it is data (``exl3_core/data/default_model.json``), not code, so the core
names no model. The package is located with ``importlib.util.find_spec`` and never imported.
``EXL3_DEFAULT_MODEL`` (``settings.default_model``) overrides all of this.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from exl3_core import settings
from exl3_core.convert.gguf_import import IMPORT_MARKER, IMPORTER_VERSION, GGUFAdapter, import_gguf

_DATA = Path(__file__).resolve().parents[1] / "data" / "default_model.json"


def default_model_info() -> dict[str, Any]:
    """Contents of ``exl3_core/data/default_model.json``."""
    return dict(json.loads(_DATA.read_text(encoding="utf-8")))


def _install_hint(info: dict[str, Any]) -> str:
    flags = info.get("pip_flags", "")
    return f"pip install {flags + ' ' if flags else ''}{info['pip']}"


def default_model_gguf() -> Path:
    """The GGUF file inside the installed default-model package."""
    info = default_model_info()
    spec = importlib.util.find_spec(info["package"])
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model ({info['display_name']}) is not installed: run `{_install_hint(info)}`, "
            f"or set EXL3_DEFAULT_MODEL to a model directory, or pass a model path explicitly")
    found = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("**/*.gguf"))
    if not found:
        raise FileNotFoundError(f"package {info['package']!r} contains no .gguf file; reinstall it with "
                                f"`{_install_hint(info)} --force-reinstall`")
    return found[0]


def _is_complete(target: Path, gguf: Path) -> bool:
    """A finished import from this very file by this importer version."""
    try:
        marker = json.loads((target / IMPORT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (marker.get("importer_version") == IMPORTER_VERSION
            and marker.get("source_size") == gguf.stat().st_size)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dead_partials(models: Path, name: str) -> None:
    """Delete temp folders that killed imports left behind (their process is gone)."""
    for p in models.glob(f".{name}.partial-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def default_model_dir(progress: bool = True, adapters: Mapping[str, GGUFAdapter] | None = None) -> Path:
    """Directory of the default model, importing it into ``<cache_dir>/models/`` on first use.

    :param progress: print a one-line notice and tensor progress to stderr while importing
        (never when ``EXL3_NO_PROGRESS=1``).
    :param adapters: GGUF adapters for the import (None: from the installed plugins).
    """
    s = settings.get()
    if s.default_model is not None:
        if not s.default_model.is_dir():
            raise FileNotFoundError(f"EXL3_DEFAULT_MODEL={s.default_model} is not a directory")
        return s.default_model
    gguf = default_model_gguf()
    models = s.cache_dir / "models"
    target = models / gguf.stem
    if _is_complete(target, gguf):
        return target
    models.mkdir(parents=True, exist_ok=True)
    _remove_dead_partials(models, target.name)
    show = progress and not s.no_progress
    if show:
        print(f"exl3: importing the default model {gguf.name} into {target} (once)", file=sys.stderr)

    from exl3_core.progress import Progress

    bar: Progress | None = None

    def report(done: int, total: int, name: str) -> None:
        nonlocal bar
        if bar is None:
            bar = Progress(total, "import")
        bar.update(done, name)

    info = default_model_info()
    try:
        return import_gguf(gguf, target, dtype=info.get("dtype", "bf16"), adapters=adapters,
                           progress=report if show else None, overwrite=True)
    finally:
        if bar is not None:
            bar.close()
