"""Writing safetensors files: one file atomically, or a sharded set with an index.

File naming and the index follow the EXL3 checkpoint layout (format spec 1.1): ``model.safetensors``
when everything fits in one shard, else ``model-00001-of-0000N.safetensors`` plus
``model.safetensors.index.json`` = ``{"metadata": {"total_size": bytes}, "weight_map": {...}}``.
Packing is greedy in the given order and never splits a group (a module). No ``__metadata__`` is
written unless the caller passes metadata.
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

from exl3_core.loader.format import TORCH_TO_ST, LoaderError
from exl3_core.loader.safetensors import INDEX_FILE, SINGLE_FILE

log = logging.getLogger("exl3.loader")

_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def shard_name(i: int, n: int) -> str:
    """File name of shard ``i`` (1-based) of ``n``."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_tensor(name: object, t: object, path: Path) -> None:
    if not isinstance(name, str):
        raise LoaderError(f"{path}: tensor name {name!r} is not a string")
    if not isinstance(t, torch.Tensor):
        raise LoaderError(f"{path}: value for {name!r} is a {type(t).__name__}, not a torch.Tensor")
    if t.dtype not in TORCH_TO_ST:
        raise LoaderError(f"{path}: tensor {name!r} has dtype {t.dtype}, which safetensors cannot store "
                          f"(supported: {', '.join(str(d) for d in TORCH_TO_ST)}); convert it first")


def _write(tensors: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str] | None) -> int:
    """Write ``tensors`` to ``path`` via a temporary file and an atomic rename. Returns data bytes."""
    if sys.byteorder != "little":
        raise LoaderError(f"{path}: safetensors is little-endian; big-endian hosts cannot write it")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str)
                                        for k, v in metadata.items()):
        raise LoaderError(f"{path}: metadata must map str to str (safetensors stores nothing else)")
    for name, t in tensors.items():
        _check_tensor(name, t, path)
    # Widest elements first: with an 8-aligned data start every tensor then starts at a multiple
    # of its element size, so readers can view the mmap without realigning.
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name in order:
        t = tensors[name]
        n = _nbytes(t)
        header[name] = {"dtype": TORCH_TO_ST[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-(8 + len(blob)) % 8)  # space padding is valid JSON whitespace

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            for name in order:
                t = tensors[name]
                if t.numel() == 0:
                    continue
                raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                f.write(raw.numpy().data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return offset


def save_tensors(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write one safetensors file atomically (temporary file + ``os.replace``).

    Tensors may live on any device; they are copied to CPU one at a time while writing.

    :param metadata: written as ``__metadata__`` (str -> str); omitted entirely when None.
    :returns: the number of tensor data bytes written.
    """
    return _write(tensors, Path(path), metadata)


def write_json_atomic(obj: object, path: Path, indent: int = 2, ensure_ascii: bool = True) -> None:
    """Write JSON through a temp file + fsync + rename: a crash leaves the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=indent, ensure_ascii=ensure_ascii)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_sharded(
    tensors_in_order: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike[str],
    max_shard_bytes: int,
    group_key: Callable[[str], str] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write tensors as one file or as numbered shards plus an index.

    Shards are filled greedily in the given order. A *group* is a run of consecutive tensors with
    the same ``group_key(name)`` (default: each tensor alone); a group is never split, so a group
    larger than ``max_shard_bytes`` gets a shard of its own (with a warning). Sizes count tensor
    data bytes. Only the current shard is held in memory, so ``tensors_in_order`` can be a
    generator that produces tensors as they are made.

    Shard files are written under temporary names and renamed once the shard count is known; the
    index is written last. Stale ``model.safetensors`` / ``model-NNNNN-of-NNNNN.safetensors`` /
    index files in ``out_dir`` that are not part of the new set are then removed, because a loader
    would otherwise mix them with the new ones.

    :returns: the paths of the weight files written, in shard order.
    """
    if max_shard_bytes <= 0:
        raise LoaderError(f"max_shard_bytes={max_shard_bytes}: the shard size must be positive")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp_files: list[Path] = []
    shard_names: list[list[str]] = []
    shard_bytes: list[int] = []
    current: dict[str, torch.Tensor] = {}
    cur_bytes = 0
    group: list[tuple[str, torch.Tensor]] = []
    group_bytes = 0
    group_id: str | None = None
    closed_groups: set[str] = set()
    seen: set[str] = set()
    pid = os.getpid()

    def flush_shard() -> None:
        nonlocal current, cur_bytes
        tmp = out / f".model-partial-{len(tmp_files) + 1:05d}.{pid}.safetensors"
        shard_bytes.append(_write(current, tmp, metadata))
        tmp_files.append(tmp)
        shard_names.append(list(current))
        current, cur_bytes = {}, 0

    def flush_group() -> None:
        nonlocal cur_bytes, group_bytes
        if not group:
            return
        if current and cur_bytes + group_bytes > max_shard_bytes:
            flush_shard()
        if group_bytes > max_shard_bytes:
            log.warning("group %r is %d bytes, more than the shard limit of %d; it gets a shard of its own",
                        group_id, group_bytes, max_shard_bytes)
        current.update(group)
        cur_bytes += group_bytes
        group.clear()
        group_bytes = 0

    try:
        for name, t in tensors_in_order:
            _check_tensor(name, t, out)
            if name in seen:
                raise LoaderError(f"{out}: tensor {name!r} is given twice; each name must be unique")
            seen.add(name)
            key = group_key(name) if group_key is not None else name
            if group and key != group_id:
                closed_groups.add(group_id)  # type: ignore[arg-type]
                flush_group()
            if not group:
                if key in closed_groups:
                    log.warning("tensor %r belongs to group %r, which was interrupted by other tensors; "
                                "keep a group's tensors consecutive so it is never split", name, key)
                group_id = key
            group.append((name, t))
            group_bytes += _nbytes(t)
        flush_group()
        if current or not tmp_files:
            flush_shard()

        n = len(tmp_files)
        finals = [out / SINGLE_FILE] if n == 1 else [out / shard_name(i + 1, n) for i in range(n)]
        for tmp, final in zip(tmp_files, finals, strict=True):
            os.replace(tmp, final)
        tmp_files.clear()
        if n > 1:
            weight_map = {name: final.name
                          for names, final in zip(shard_names, finals, strict=True) for name in names}
            # total_size counts tensor data bytes only, not headers (as HF writes it).
            total = sum(shard_bytes)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            write_json_atomic(index, out / INDEX_FILE)
    except BaseException:
        for tmp in tmp_files:
            tmp.unlink(missing_ok=True)
        raise

    keep = {f.name for f in finals} | ({INDEX_FILE} if n > 1 else set())
    for p in out.iterdir():
        if p.name not in keep and (p.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(p.name)):
            log.info("removing stale %s from %s", p.name, out)
            p.unlink()
    return finals


__all__ = ["save_sharded", "save_tensors", "shard_name"]
