"""All-or-nothing loading of a set of tensors onto a device.

A model that fails to load halfway must not leave gigabytes stranded on the GPU: the caller would
have to restart the process to get them back. :func:`load_tensors` therefore validates every
request against the headers before allocating anything, and if a read still fails midway it drops
every tensor it made (including the ones pinned by the failing exception's traceback) and empties
the CUDA caching allocator before raising.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import traceback
from collections.abc import Mapping, Sequence

import torch

from exl3_core.loader.format import LoaderError
from exl3_core.loader.safetensors import SafetensorsCollection
from exl3_core.progress import Progress, ProgressCallback

log = logging.getLogger("exl3.loader")


@dataclasses.dataclass(frozen=True)
class TensorRequest:
    """One tensor to load.

    :param name: tensor name in the checkpoint.
    :param shape: expected stored shape (``None``/``-1`` entries match any size), or None.
    :param dtype: expected *stored* dtype (or several allowed ones), or None. Conversion is
        :func:`load_tensors`'s ``dtype`` argument.
    :param optional: when True a missing tensor is skipped (absent from the result) instead of an
        error. A present tensor with the wrong shape/dtype is an error even when optional.
    """

    name: str
    shape: tuple[int | None, ...] | None = None
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None
    optional: bool = False


Requests = Mapping[str, TensorRequest] | Sequence[str | TensorRequest]


def _normalize(requests: Requests) -> dict[str, TensorRequest]:
    if isinstance(requests, Mapping):
        return dict(requests)
    out: dict[str, TensorRequest] = {}
    for r in requests:
        req = TensorRequest(r) if isinstance(r, str) else r
        if req.name in out:
            raise LoaderError(f"tensor {req.name!r} is requested twice; request each tensor once")
        out[req.name] = req
    return out


def _release(device: torch.device) -> None:
    gc.collect()  # tensors caught in reference cycles (e.g. by traceback frames) go now, not later
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()


def load_tensors(
    collection: SafetensorsCollection,
    requests: Requests,
    device: str | torch.device,
    dtype: torch.dtype | None = None,
    progress: ProgressCallback | Progress | bool | None = None,
) -> dict[str, torch.Tensor]:
    """Load a set of tensors onto ``device``: all of them, or none.

    :param collection: where to read from.
    :param requests: ``{result_key: TensorRequest}`` (keys may differ from checkpoint names), or a
        list of names/requests (the result is keyed by name).
    :param device: target device.
    :param dtype: convert floating-point tensors to this dtype; integer/bool tensors (packed
        quantized data, markers) are never converted.
    :param progress: ``None``/``False``: silent. ``True``: a progress bar over this call's bytes. A
        :class:`~exl3_core.progress.Progress`: advanced by the bytes read (so one bar can span many
        calls). Any other callable: called as ``progress(done_bytes, total_bytes, tensor_name)``.
    :returns: the loaded tensors; optional tensors that are absent are left out.
    :raises LoaderError: on any problem. Nothing loaded by this call is still referenced then.
    """
    reqs = _normalize(requests)
    device = torch.device(device)

    # Phase 1: validate everything from the headers; no allocation yet, so failing here is free.
    plan: list[tuple[str, TensorRequest]] = []
    problems: list[str] = []
    for key, req in reqs.items():
        if req.name not in collection:
            if not req.optional:
                problems.append(f"tensor {req.name!r} is missing from the model at {collection.directory}")
            continue
        try:
            collection.check(req.name, req.shape, req.dtype)
        except LoaderError as e:
            problems.append(str(e))
            continue
        plan.append((key, req))
    if problems:
        head = f"{len(problems)} of {len(reqs)} requested tensors cannot be loaded:\n  "
        head = head if len(problems) > 1 else ""
        raise LoaderError(head + "\n  ".join(problems))

    total = collection.total_bytes([r.name for _, r in plan])
    own_bar: Progress | None = None
    if progress is True:
        own_bar = Progress(total, "loading", unit="B")
    done = 0

    # Phase 2: read. Any failure unwinds everything made so far before the error propagates.
    out: dict[str, torch.Tensor] = {}
    t: torch.Tensor | None = None
    current: str | None = None
    try:
        for key, req in plan:
            current = req.name
            conv = dtype if dtype is not None and collection.dtype(req.name).is_floating_point else None
            t = collection.get_tensor(req.name, device=device, dtype=conv)
            out[key] = t
            t = None
            n = collection.nbytes(req.name)
            done += n
            if own_bar is not None:
                own_bar.advance(n, req.name)
            elif isinstance(progress, Progress):
                progress.advance(n, req.name)
            elif callable(progress):
                progress(done, total, req.name)
    except BaseException as e:
        out.clear()
        t = None
        # The frames below us (get_tensor, .to(...)) may still hold the half-made tensor as a local;
        # the traceback keeps those frames alive as long as the caller keeps the exception.
        traceback.clear_frames(e.__traceback__)
        _release(device)
        if isinstance(e, LoaderError) or not isinstance(e, Exception):
            raise
        where = collection.file_of(current) if current is not None else collection.directory
        raise LoaderError(
            f"loading tensor {current!r} from {where} to {device} failed ({type(e).__name__}: {e}); "
            f"nothing from this load was kept on the device. Free device memory or pick another "
            f"device; if the file is damaged, re-download or re-convert the model"
        ) from e
    finally:
        if own_bar is not None:
            own_bar.close()
    return out


__all__ = ["TensorRequest", "load_tensors"]
