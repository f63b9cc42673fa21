"""Device-memory accounting for :meth:`Model.load`: plan before allocating, report after.

The plan is a *dry run* of every module's ``load_weights`` against a stand-in source that hands
out ``meta`` tensors with the shape and dtype from the safetensors headers, so the bytes counted
are the ones the real load will hold, in the dtype each module stores them at (EXL3 trellis and
scales as stored, dense weights in the model dtype, norms in fp32, derived buffers such as RoPE
tables included). Nothing is read from disk and nothing is allocated. Caches handed to the load add
:meth:`~exl3_core.cache.Cache.bytes_for`.
"""
from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from exl3_core.devmem import InsufficientDeviceMemory, fmt_bytes, free_bytes

if TYPE_CHECKING:
    from exl3_core.cache.cache import Cache
    from exl3_core.nn.shard import ModuleSharder

log = logging.getLogger(__name__)

#: tensors at most this large are read for real during the dry run (codebook markers are 0-dim
#: ints whose *value* a loader may inspect; a meta tensor has none)
_READ_REAL_NUMEL = 16


class _MetaSource:
    """A TensorSource that answers every request with a meta tensor of the stored shape."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.directory: Path = source.directory
        self._stored_dtype = getattr(source, "dtype", None)

    def __contains__(self, name: object) -> bool:
        return name in self.source

    def keys(self) -> list[str]:
        return list(self.source.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.source.shape(name))

    def file_of(self, name: str) -> Any:
        f = getattr(self.source, "file_of", None)
        return f(name) if f is not None else self.directory

    def get_tensor(self, name: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                   expect_shape: Collection[int | None] | None = None) -> torch.Tensor:
        shape = self.shape(name)
        numel = 1
        for s in shape:
            numel *= s
        if numel <= _READ_REAL_NUMEL or self._stored_dtype is None:
            # tiny (markers) or a source without header dtypes: read it, on the CPU
            t = self.source.get_tensor(name, device="cpu", dtype=dtype, expect_shape=expect_shape)
            return t if numel <= _READ_REAL_NUMEL else t.to("meta")
        stored = self._stored_dtype(name)
        return torch.empty(shape, dtype=dtype if dtype is not None else stored, device="meta")


def _unique_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    seen: set[int] = set()
    for m in model.modules():
        for t in list(m._buffers.values()) + list(m._parameters.values()):
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            yield t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weight_bytes_required(model: Any, source: Any, dtype: torch.dtype, shard: ModuleSharder | None = None) -> int:
    """Bytes the weights of ``model`` will take on the device when loaded from ``source`` at ``dtype`` (one
    rank's share with ``shard``: each module is cut as the load will cut it).

    The model must not be loaded (the dry run fills and then empties its module slots).
    """
    from exl3_core.nn.module import LoadContext

    before = {id(t) for t in _unique_tensors(model)}  # config-derived buffers that exist already
    ctx = LoadContext(_MetaSource(source), torch.device("meta"), dtype)
    modules = list(model.exl3_modules())
    try:
        for m in modules:
            m.load_weights(ctx)
            if shard is not None:
                shard.shard_module(m)
        total = 0
        for t in _unique_tensors(model):
            if id(t) in before:
                continue
            total += _nbytes(t)
        return total
    finally:
        for m in modules:
            m.unload_weights()


def cache_bytes_required(caches: Sequence[Cache], dtype: torch.dtype) -> int:
    """Bytes ``caches`` (not yet allocated) will take for a model of ``dtype`` (scratch pages included)."""
    return sum(c.bytes_for(dtype) for c in caches if not c.allocated)


def plan_load(model: Any, source: Any, device: torch.device, dtype: torch.dtype,
              caches: Sequence[Cache] = (), shard: ModuleSharder | None = None) -> dict[str, int]:
    """``{"weights", "caches", "total"}`` bytes, plus ``"free"``/``"device_total"`` on CUDA.

    :raises InsufficientDeviceMemory: on CUDA, when ``total`` exceeds the free device memory.
    """
    plan = {"weights": weight_bytes_required(model, source, dtype, shard),
            "caches": cache_bytes_required(caches, dtype)}
    plan["total"] = plan["weights"] + plan["caches"]
    info = free_bytes(device)
    if info is not None:
        free, dev_total = info
        plan["free"], plan["device_total"] = free, dev_total
        check_fits(plan, free=free, total=dev_total, device=str(device),
                   what=str(getattr(getattr(model, "config", None), "directory", type(model).__name__)))
    return plan


def check_fits(plan: dict[str, int], *, free: int, total: int, what: str, device: str) -> None:
    """Raise :class:`InsufficientDeviceMemory` when ``plan["total"]`` exceeds ``free`` bytes."""
    if plan["total"] > free:
        raise InsufficientDeviceMemory(
            f"loading {what} on {device} needs {fmt_bytes(plan['total'])} (weights {fmt_bytes(plan['weights'])} + "
            f"caches {fmt_bytes(plan['caches'])}) but only {fmt_bytes(free)} of {fmt_bytes(total)} is free; "
            f"create the Cache with a smaller max_num_tokens, free other GPU memory, or use another device")


def measure_loaded(model: Any, device: torch.device | None = None, caches: Sequence[Cache] = ()) -> dict[str, int]:
    """Bytes actually held after loading: unique weight storages (on ``device``, default the model's)
    and cache storage."""
    device = torch.device(device if device is not None else model.device)
    weights = 0
    seen: set[tuple[int, int]] = set()
    for t in _unique_tensors(model):
        if t.device.type != device.type:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        weights += _nbytes(t)
    cache_bytes = sum(c.storage_size() for c in caches)
    return {"weights": weights, "caches": cache_bytes, "total": weights + cache_bytes}


def load_report(model: Any, plan: dict[str, int] | None, device: torch.device,
                caches: Sequence[Cache] = ()) -> dict[str, Any]:
    """What :meth:`Model.memory_report` returns: the plan, what was measured, and the device's state."""
    out: dict[str, Any] = {"device": str(device), "planned": dict(plan or {}),
                           "allocated": measure_loaded(model, device, caches)}
    if device.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(device)
        out["device_free_after"] = free
        out["device_total"] = total
        out["torch_allocated"] = torch.cuda.memory_allocated(device)
    log.info("loaded %s: weights %s, caches %s", type(model).__name__, fmt_bytes(out["allocated"]["weights"]),
             fmt_bytes(out["allocated"]["caches"]))
    return out


def checked_plan(model: Any, source: Any, device: torch.device, dtype: torch.dtype,
                 caches: Sequence[Cache] = (), shard: ModuleSharder | None = None) -> dict[str, int] | None:
    """:func:`plan_load`, except that a module the dry run cannot handle skips the plan (logged).

    Only :class:`InsufficientDeviceMemory` propagates: an architecture whose loader inspects tensor
    values must still load, just without the up-front check.
    """
    try:
        return plan_load(model, source, device, dtype, caches, shard)
    except InsufficientDeviceMemory:
        raise
    except Exception as e:  # noqa: BLE001 - the plan is advisory for such modules
        log.warning("memory plan skipped for %s (dry run failed: %s: %s); loading without the free-memory check",
                    type(model).__name__, type(e).__name__, e)
        return None
