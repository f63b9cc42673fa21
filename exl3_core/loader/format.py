"""The safetensors file format: dtype table, header parsing and validation.

A safetensors file is ``u64 little-endian N`` + ``N bytes of UTF-8 JSON`` + a data buffer. The JSON
maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to
the data buffer) plus an optional ``"__metadata__": {str: str}``. The buffer must be covered
exactly: no overlaps, no holes, nothing after the last tensor. The reference implementation refuses
files that break any of these, so we refuse them too, but with messages that name the file, the
tensor and the fix, and before a single tensor byte is touched (a truncated file read through mmap
would otherwise kill the process with SIGBUS instead of raising).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

FIX_REDOWNLOAD = "re-download or re-convert the model"

# Header sizes beyond this are corruption, not models (the reference reader uses the same cap).
MAX_HEADER_BYTES = 100 * 1024 * 1024


class LoaderError(ValueError):
    """A checkpoint file or directory is unusable, or a tensor is not what the caller expected.

    The message always names the file (and the tensor, where one is involved) and says what to do.
    """


def _dtype_table() -> dict[str, torch.dtype]:
    table = {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
        "U8": torch.uint8, "BOOL": torch.bool,
        "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    }
    # Wider unsigned types exist only in newer torch builds; accept them where torch can hold them.
    for name, attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
        if hasattr(torch, attr):
            table[name] = getattr(torch, attr)
    return table


ST_TO_TORCH: dict[str, torch.dtype] = _dtype_table()
TORCH_TO_ST: dict[torch.dtype, str] = {v: k for k, v in ST_TO_TORCH.items()}
# Precomputed: headers can list tens of thousands of tensors.
_ITEMSIZE: dict[torch.dtype, int] = {d: torch.empty((), dtype=d).element_size() for d in TORCH_TO_ST}


def itemsize(dtype: torch.dtype) -> int:
    return _ITEMSIZE.get(dtype) or torch.empty((), dtype=dtype).element_size()


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: absolute byte range ``[begin, end)`` inside ``path``."""

    name: str
    path: Path
    st_dtype: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Header:
    """A parsed, validated safetensors header."""

    path: Path
    file_size: int
    data_start: int
    tensors: dict[str, TensorInfo]  # in storage (offset) order
    metadata: dict[str, str] | None


def _fail(path: Path, what: str, tensor: str | None = None) -> LoaderError:
    where = f"tensor {tensor!r} in {path}" if tensor is not None else str(path)
    return LoaderError(f"{where}: {what}; the file is corrupt or incomplete: {FIX_REDOWNLOAD}")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def parse_header(path: str | os.PathLike[str]) -> Header:
    """Read and validate the header of one safetensors file (reads only the header bytes).

    :raises LoaderError: for every structural problem, naming the file and tensor.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            if file_size < 8:
                raise _fail(path, f"file is {file_size} bytes, too short to hold a safetensors header")
            n = int.from_bytes(f.read(8), "little")
            if n > MAX_HEADER_BYTES:
                raise _fail(path, f"header length field says {n} bytes, which is implausible")
            if 8 + n > file_size:
                raise _fail(path, f"header length field says {n} bytes but the file has only "
                                  f"{file_size - 8} bytes after it (truncated file?)")
            raw = f.read(n)
    except OSError as e:
        raise LoaderError(f"{path}: cannot read ({e.strerror or e}); check the path and permissions") from e

    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as e:
        raise _fail(path, f"header is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise _fail(path, f"header is a JSON {type(obj).__name__}, expected an object")

    metadata = obj.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise _fail(path, "__metadata__ must map strings to strings")

    data_start = 8 + n
    data_len = file_size - data_start
    infos: list[TensorInfo] = []
    for name, entry in obj.items():
        if not isinstance(entry, dict):
            raise _fail(path, "header entry is not an object", name)
        st = entry.get("dtype")
        shape = entry.get("shape")
        offs = entry.get("data_offsets")
        if st not in ST_TO_TORCH:
            raise _fail(path, f"unknown dtype {st!r} (supported: {', '.join(ST_TO_TORCH)})", name)
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise _fail(path, f"shape {shape!r} is not a list of non-negative integers", name)
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int and o >= 0 for o in offs)):
            raise _fail(path, f"data_offsets {offs!r} is not a pair of non-negative integers", name)
        begin, end = offs
        if end < begin:
            raise _fail(path, f"data_offsets [{begin}, {end}] end before they begin", name)
        dtype = ST_TO_TORCH[st]
        want = math.prod(shape) * itemsize(dtype)
        if end - begin != want:
            raise _fail(path, f"data_offsets [{begin}, {end}] span {end - begin} bytes but "
                              f"{st}{shape} needs {want}", name)
        if end > data_len:
            raise _fail(path, f"data ends at byte {data_start + end} but the file has only {file_size} "
                              f"bytes (truncated file)", name)
        infos.append(TensorInfo(name, path, st, dtype, tuple(shape), data_start + begin, data_start + end))

    # The buffer must be tiled exactly; sorting by offset makes overlaps and holes adjacent.
    # Zero-size tensors occupy no bytes and may sit anywhere, so they do not take part.
    infos.sort(key=lambda t: (t.begin, t.end))
    cursor = data_start
    prev: str | None = None
    for t in infos:
        if t.nbytes == 0:
            continue
        if t.begin < cursor:
            raise _fail(path, f"data [{t.begin - data_start}, {t.end - data_start}) overlaps tensor {prev!r}",
                        t.name)
        if t.begin > cursor:
            raise _fail(path, f"{t.begin - cursor} unused bytes before this tensor's data "
                              f"(offsets out of order or edited)", t.name)
        cursor, prev = t.end, t.name
    if cursor != file_size:
        raise _fail(path, f"{file_size - cursor} bytes after the last tensor's data are not described by "
                          f"the header")
    return Header(path, file_size, data_start, {t.name: t for t in infos}, metadata)
