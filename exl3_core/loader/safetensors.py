"""Lazy, validated access to the safetensors files of one model directory.

Every header is parsed and checked when the collection is opened (cheap: headers only), so a
truncated shard, a missing shard or an index that promises a tensor a shard lacks is reported
before anything is loaded. Tensor data is read through a private (copy-on-write) mmap only when a
tensor is requested, and every tensor handed out owns its memory, so closing the collection never
invalidates a tensor the caller holds.
"""
from __future__ import annotations

import difflib
import json
import mmap
import os
import threading
from collections.abc import Collection, Iterator
from pathlib import Path
from types import TracebackType
from typing import IO

import torch

from exl3_core.loader.format import FIX_REDOWNLOAD, Header, LoaderError, TensorInfo, parse_header

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def shape_matches(found: tuple[int, ...], expect: Collection[int | None]) -> bool:
    """``expect`` may use ``None`` or ``-1`` for dimensions of any size."""
    exp = tuple(expect)
    if len(exp) != len(found):
        return False
    return all(e is None or e == -1 or e == f for e, f in zip(exp, found, strict=True))


def match_prefix(name: str, prefix: str) -> bool:
    """Module-aware prefix match: ``layers.1`` matches ``layers.1.x`` but not ``layers.10.x``.

    A prefix that ends in ``.`` (or is empty) is a plain string prefix.
    """
    if not prefix or prefix.endswith("."):
        return name.startswith(prefix)
    return name == prefix or name.startswith(prefix + ".")


class _Shard:
    """One file: its validated header and, once data is first needed, its mmap."""

    def __init__(self, header: Header) -> None:
        self.header = header
        self._file: IO[bytes] | None = None
        self._mm: mmap.mmap | None = None

    def mapping(self) -> mmap.mmap:
        if self._mm is None:
            path = self.header.path
            try:
                f = open(path, "rb")
            except OSError as e:
                raise LoaderError(f"{path}: cannot open ({e.strerror or e}); the file was removed or "
                                  f"made unreadable after the model was opened") from e
            try:
                self._check_size(f)
                # ACCESS_COPY: a private mapping is writable from Python's side, so torch.frombuffer
                # takes it without a read-only warning; nothing is ever written back to the file.
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except BaseException:
                f.close()
                raise
            self._file = f
        return self._mm

    def check_unchanged(self) -> None:
        if self._file is not None:
            self._check_size(self._file)

    def _check_size(self, f: IO[bytes]) -> None:
        # A file shrunk under a live mmap raises SIGBUS on access, which no handler can catch:
        # check the size first and turn that into an ordinary error.
        size = os.fstat(f.fileno()).st_size
        if size != self.header.file_size:
            raise LoaderError(f"{self.header.path}: file size changed from {self.header.file_size} to {size} "
                              f"bytes since the model was opened; do not modify model files while "
                              f"loading ({FIX_REDOWNLOAD} if it was damaged)")

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if self._file is not None:
            self._file.close()
            self._file = None


class SafetensorsCollection:
    """All tensors of a model directory, found by the conventional safetensors layouts.

    Resolution order:

    1. ``model.safetensors.index.json``: shards named by its ``weight_map`` (the index is
       authoritative: tensors a shard holds but the index does not list are ignored);
    2. ``model.safetensors``;
    3. every ``*.safetensors`` file in the directory (a name found in two files is an error).

    ``directory`` may also be the path of a single ``.safetensors`` file.

    :raises LoaderError: when no weights are found or any file/index is inconsistent.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._lock = threading.Lock()
        self._shards: dict[Path, _Shard] = {}
        self._tensors: dict[str, TensorInfo] = {}
        self._closed = False
        if self.directory.is_file():
            self._add_files([self.directory])
            self.directory = self.directory.parent
        elif not self.directory.is_dir():
            raise LoaderError(f"{self.directory}: model directory does not exist; pass the directory that "
                              f"holds config.json and the *.safetensors files")
        elif (self.directory / INDEX_FILE).is_file():
            self._load_index(self.directory / INDEX_FILE)
        elif (self.directory / SINGLE_FILE).is_file():
            self._add_files([self.directory / SINGLE_FILE])
        else:
            files = sorted(p for p in self.directory.glob("*.safetensors") if p.is_file())
            if not files:
                present = sorted(p.name for p in self.directory.iterdir())[:20]
                raise LoaderError(
                    f"{self.directory}: no {SINGLE_FILE}, no {INDEX_FILE} and no *.safetensors files "
                    f"(directory holds: {', '.join(present) or 'nothing'}); point at a directory with "
                    f"safetensors weights or convert the model first"
                )
            self._add_files(files)

    # -- opening ----------------------------------------------------------------------------------

    def _add_files(self, files: list[Path]) -> None:
        for path in files:
            shard = _Shard(parse_header(path))
            self._shards[path] = shard
            for name, info in shard.header.tensors.items():
                if name in self._tensors:
                    raise LoaderError(
                        f"tensor {name!r} is stored in both {self._tensors[name].path} and {path}; "
                        f"remove the stale file or add a {INDEX_FILE} that says which one to use"
                    )
                self._tensors[name] = info

    def _load_index(self, index_path: Path) -> None:
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise LoaderError(f"{index_path}: unreadable or not valid JSON ({e}); {FIX_REDOWNLOAD}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise LoaderError(f"{index_path}: has no \"weight_map\" object mapping tensor names to file "
                              f"names; {FIX_REDOWNLOAD}")
        by_file: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            by_file.setdefault(fname, []).append(name)
        for fname, names in by_file.items():
            path = self.directory / fname
            if Path(fname).is_absolute() or ".." in Path(fname).parts:
                raise LoaderError(f"{index_path}: shard name {fname!r} points outside the model directory; "
                                  f"{FIX_REDOWNLOAD}")
            if not path.is_file():
                raise LoaderError(
                    f"{path}: shard listed in {index_path.name} (for {len(names)} tensors, e.g. "
                    f"{names[0]!r}) is missing; the download is incomplete: {FIX_REDOWNLOAD}"
                )
            shard = _Shard(parse_header(path))
            self._shards[path] = shard
            for name in names:
                info = shard.header.tensors.get(name)
                if info is None:
                    raise LoaderError(
                        f"tensor {name!r} is listed in {index_path.name} as stored in {path}, but that "
                        f"file does not contain it; the index and shards do not match: {FIX_REDOWNLOAD}"
                    )
        # Storage order (file, offset) makes sequential loads read each file front to back.
        for fname in by_file:
            for name, info in self._shards[self.directory / fname].header.tensors.items():
                if weight_map.get(name) == fname:
                    self._tensors[name] = info

    # -- queries ----------------------------------------------------------------------------------

    def _info(self, name: str) -> TensorInfo:
        info = self._tensors.get(name)
        if info is None:
            close = difflib.get_close_matches(name, list(self._tensors), n=3)
            hint = f" (similar: {', '.join(map(repr, close))})" if close else ""
            raise LoaderError(f"tensor {name!r} is not in the model at {self.directory}{hint}; check the "
                              f"tensor name, or that this checkpoint matches the architecture")
        return info

    def keys(self) -> list[str]:
        """All tensor names, in storage order (file, then offset)."""
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._tensors))

    def __len__(self) -> int:
        return len(self._tensors)

    def info(self, name: str) -> TensorInfo:
        """Header facts about one tensor (file, dtype, shape, byte range)."""
        return self._info(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self._info(name).dtype

    def nbytes(self, name: str) -> int:
        return self._info(name).nbytes

    def file_of(self, name: str) -> Path:
        return self._info(name).path

    @property
    def files(self) -> list[Path]:
        return list(self._shards)

    def metadata(self, file: str | os.PathLike[str] | None = None) -> dict[str, str] | None:
        """The ``__metadata__`` of ``file`` (default: the first file), or None when absent."""
        path = next(iter(self._shards)) if file is None else Path(file)
        if path not in self._shards:
            path = self.directory / path
        if path not in self._shards:
            raise LoaderError(f"{file}: not one of the files of {self.directory} "
                              f"({', '.join(p.name for p in self._shards)})")
        md = self._shards[path].header.metadata
        return dict(md) if md is not None else None

    def list_prefix(self, prefix: str) -> list[str]:
        """Names under ``prefix`` (module-aware, see :func:`match_prefix`), in storage order."""
        return [n for n in self._tensors if match_prefix(n, prefix)]

    def total_bytes(self, names: Collection[str] | None = None) -> int:
        """Data bytes of ``names`` (default: every tensor)."""
        if names is None:
            return sum(t.nbytes for t in self._tensors.values())
        return sum(self._info(n).nbytes for n in names)

    # -- reading ----------------------------------------------------------------------------------

    def check(
        self,
        name: str,
        expect_shape: Collection[int | None] | None = None,
        expect_dtype: torch.dtype | Collection[torch.dtype] | None = None,
    ) -> TensorInfo:
        """Validate a tensor against expectations from its header alone (no data is read).

        :raises LoaderError: naming the file, the tensor, what was expected and what was found.
        """
        info = self._info(name)
        if expect_shape is not None and not shape_matches(info.shape, expect_shape):
            raise LoaderError(
                f"tensor {name!r} in {info.path} has shape {list(info.shape)}, expected "
                f"{[(-1 if d is None else d) for d in expect_shape]}; the checkpoint does not match the "
                f"model config (wrong config.json, or {FIX_REDOWNLOAD})"
            )
        if expect_dtype is not None:
            allowed = (expect_dtype,) if isinstance(expect_dtype, torch.dtype) else tuple(expect_dtype)
            if info.dtype not in allowed:
                raise LoaderError(
                    f"tensor {name!r} in {info.path} has dtype {_dtype_name(info.dtype)}, expected "
                    f"{' or '.join(_dtype_name(d) for d in allowed)}; the checkpoint was made by an "
                    f"incompatible tool or version: {FIX_REDOWNLOAD}"
                )
        return info

    def get_tensor(
        self,
        name: str,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        expect_shape: Collection[int | None] | None = None,
        expect_dtype: torch.dtype | Collection[torch.dtype] | None = None,
    ) -> torch.Tensor:
        """Read one tensor onto ``device``, optionally converting to ``dtype``.

        Expectations are checked against the header before any data is read. ``expect_dtype`` is
        the *stored* dtype (before conversion). The result owns its memory.
        """
        info = self.check(name, expect_shape, expect_dtype)
        device = torch.device(device)
        if info.numel == 0:
            return torch.empty(info.shape, dtype=dtype or info.dtype, device=device)
        view = self._view(info)
        try:
            if device.type == "cpu":
                out = view.to(dtype) if dtype is not None and dtype != info.dtype else view.clone()
            else:
                # Convert after the copy: the device converts faster, and only stored bytes cross the bus.
                out = view.to(device)
                if dtype is not None and dtype != info.dtype:
                    out = out.to(dtype)
        finally:
            del view  # drop the mmap export at once so close() never finds a live buffer
        return out

    def _view(self, info: TensorInfo) -> torch.Tensor:
        if self._closed:
            raise LoaderError(f"{self.directory}: collection is closed; open a new SafetensorsCollection")
        with self._lock:
            shard = self._shards[info.path]
            mm = shard.mapping()
        shard.check_unchanged()
        flat = torch.frombuffer(mm, dtype=info.dtype, count=info.numel, offset=info.begin)
        return flat.view(info.shape)

    def get_tensors(
        self,
        prefix: str,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> dict[str, torch.Tensor]:
        """Every tensor under ``prefix`` (see :meth:`list_prefix`), keyed by full name."""
        return {n: self.get_tensor(n, device, dtype) for n in self.list_prefix(prefix)}

    # -- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap every file. Tensors already returned stay valid (they own their memory)."""
        with self._lock:
            self._closed = True
            for shard in self._shards.values():
                shard.close()

    def __enter__(self) -> SafetensorsCollection:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"SafetensorsCollection({str(self.directory)!r}, files={len(self._shards)}, "
                f"tensors={len(self._tensors)})")


__all__ = [
    "INDEX_FILE", "SINGLE_FILE", "LoaderError", "SafetensorsCollection", "match_prefix", "shape_matches",
]
