"""``model.load(tensor_parallel_size=N)`` / ``devices=[...]`` / ``parallel_group=``: every rank loads its share.

Before any worker starts, rank 0 checks everything it can on its own: the model is a standard decoder, each
rank's cuts exist (heads, KV heads, 128-feature blocks of EXL3 linears, experts, the vocabulary), and the
shares fit (a dry run per rank, see :mod:`exl3_core.parallel.memory`). Then the workers load their shares
while rank 0 loads its own; a rank that fails is reported by rank and its error, and every rank drops what
it loaded: all or nothing, as a single-device load.
"""
from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import torch

from exl3_core.archkit.memory import weight_bytes_required
from exl3_core.archkit.model import Model
from exl3_core.cache.cache import Cache
from exl3_core.parallel.group import WorkerGroup, resolve_devices
from exl3_core.parallel.memory import RankShare, check_shares
from exl3_core.parallel.protocol import LoadModel, ModelRecipe, ParallelError, PluginRecipe, UnloadModel
from exl3_core.parallel.runtime import ParallelModel, cache_spec
from exl3_core.parallel.sharding import RankSharder, check_model, rank_geometry


def rank_devices(device: str | torch.device | None, devices: Sequence[str | torch.device] | None,
                 size: int | None) -> list[torch.device]:
    """One device per rank from ``load``'s arguments: ``devices`` as given, or ``size`` devices from
    ``device`` on (``"cuda"``/``"cuda:k"``: consecutive GPUs; ``"cpu"``: N processes on the CPU).

    :raises ValueError: naming the arguments that disagree."""
    if devices is not None:
        if size is not None and size != len(devices):
            raise ValueError(f"tensor_parallel_size={size} but {len(devices)} devices given; give one of them, or "
                             f"one device per rank")
        if device is not None:
            raise ValueError("give device= or devices=, not both")
        return resolve_devices(devices)
    n = 1 if size is None else size
    if n < 1:
        raise ValueError(f"tensor_parallel_size={n}: must be at least 1")
    dev = torch.device(device if device is not None else "cpu")
    if dev.type == "cuda":
        first = dev.index or 0
        return resolve_devices([torch.device("cuda", first + i) for i in range(n)])
    return resolve_devices([dev] * n)


def _open_source(model: Model) -> Any:
    from exl3_core.loader import SafetensorsCollection

    return SafetensorsCollection(model.config.directory)


def _shippable(source: Any) -> Any:
    """``source`` as the workers get it (None: they open the model directory themselves)."""
    if source is None:
        return None
    try:
        pickle.dumps(source)
    except Exception as e:  # noqa: BLE001 - any pickling failure means the same thing here
        raise ParallelError(f"source={type(source).__name__} cannot be sent to the tensor-parallel workers "
                            f"({type(e).__name__}: {e}); pass a picklable TensorSource, or none to read the model "
                            f"directory") from None
    return source


def plan_shares(model: Model, source: Any, devs: list[torch.device], dtype: torch.dtype, expert_parallel: bool,
                caches: Sequence[Cache]) -> list[RankShare]:
    """Every rank's bytes (a dry run of its load); the cuts are checked on the way.

    :raises ValueError, TypeError: for a cut that does not exist, prefixed with the size that asked for it."""
    world = len(devs)
    out = []
    for r, dev in enumerate(devs):
        try:
            geo = rank_geometry(model, r, world)
            weights = weight_bytes_required(model, source, dtype, RankSharder(r, world, expert_parallel))
        except (ValueError, TypeError) as e:
            raise type(e)(f"cannot split {model.config.directory.name} over tensor_parallel_size={world}"
                          f"{' with expert parallelism' if expert_parallel else ''}: {e}") from None
        cache_bytes = sum(Cache(geo, c.max_num_tokens, c.variant, c.page_size, c.plugins, **c.layer_kwargs)
                          .bytes_for(dtype) for c in caches)
        out.append(RankShare(r, dev, weights, cache_bytes))
    return out


def load_parallel(model: Model, *, device: str | torch.device | None, devices: Sequence[str | torch.device] | None,
                  tensor_parallel_size: int | None, expert_parallel: bool, group: WorkerGroup | None,
                  dtype: torch.dtype | None, progressbar: bool, attention: Sequence[str] | None, source: Any,
                  caches: Sequence[Cache]) -> Model:
    """See :meth:`Model.load`."""
    if group is not None:
        if not isinstance(group, WorkerGroup):
            raise TypeError(f"parallel_group must be an exl3_core.parallel.WorkerGroup, got {type(group).__name__}")
        if device is not None or devices is not None or tensor_parallel_size not in (None, group.world):
            raise ValueError(f"parallel_group has its devices {[str(d) for d in group.devices]}; give no device=, "
                             f"devices= or another tensor_parallel_size with it")
        group.check()
        devs = list(group.devices)
    else:
        devs = rank_devices(device, devices, tensor_parallel_size)
    world = len(devs)
    if model.loaded:
        model.unload()
    check_model(model)
    if dtype is None:
        dtype = torch.float32 if devs[0].type == "cpu" else torch.float16
    for c in caches:
        if c.allocated:
            raise ValueError("a tensor-parallel load takes caches that are not allocated yet (each rank allocates "
                             "its share); create the Cache and pass it before using it")
    own_source = source is None
    src = _open_source(model) if own_source else source
    try:
        shares = plan_shares(model, src, devs, dtype, expert_parallel, caches)
    finally:
        if own_source:
            close = getattr(src, "close", None)
            if close is not None:
                close()
    check_shares(shares, str(model.config.directory))
    sharder = RankSharder(0, world, expert_parallel)
    attn = tuple(attention) if attention is not None else None
    planned = [c.geometry for c in caches]
    for c in caches:
        c.reshape(rank_geometry(model, 0, world))
    try:
        if world == 1:
            return model.load(device=devs[0], dtype=dtype, progressbar=progressbar, attention=attn, source=source,
                              caches=caches, shard=sharder)
        # what the workers need is checked before any of them starts
        recipe = ModelRecipe(f"{type(model).__module__}:{type(model).__qualname__}", model.config.directory,
                             model.config.raw, PluginRecipe.of(model.plugins))
        shipped = _shippable(source)
        owns = group is None
        g = group if group is not None else WorkerGroup(devs)
        try:
            return _load_ranks(model, g, owns, recipe, shipped, dtype, progressbar, attn, source, caches,
                               expert_parallel, sharder)
        except BaseException:
            if owns:
                g.close()
            raise
    except BaseException:
        for c, geo in zip(caches, planned):  # all or nothing: the caches are as they were given
            if not c.allocated:
                c.reshape(geo)
        raise


def _load_ranks(model: Model, g: WorkerGroup, owns: bool, recipe: ModelRecipe, shipped: Any, dtype: torch.dtype,
                progressbar: bool, attention: tuple[str, ...] | None, source: Any, caches: Sequence[Cache],
                expert_parallel: bool, sharder: RankSharder) -> Model:
    model_id = g.new_id()
    ids = [g.new_id() for _ in caches]
    g.send(LoadModel(model_id, recipe, shipped, dtype, attention, expert_parallel,
                     tuple(cache_spec(c, i) for c, i in zip(caches, ids))))
    mine: BaseException | None = None
    try:
        model.load(device=g.devices[0], dtype=dtype, progressbar=progressbar, attention=attention, source=source,
                   caches=caches, shard=sharder)
    except BaseException as e:  # noqa: BLE001 - re-raised below, once the workers answered
        mine = e
    try:
        answers = g.collect("load its share of the model", g.load_timeout)
        failed = [d.error for d in answers if d.error is not None]
        if mine is None and failed:
            g.send(UnloadModel(model_id))
            raise ParallelError(f"loading {model.config.directory} over tensor_parallel_size={g.world} failed: "
                                + "; ".join(failed))
        if mine is not None:
            g.send(UnloadModel(model_id))
            raise mine
    except BaseException:
        if model.loaded:
            model.unload()
        for c in caches:  # rank 0 allocated them with its share; they were unallocated when given
            c.free()
        raise
    runtime = ParallelModel(model, g, model_id, owns, [d.report or {} for d in answers])  # type: ignore[arg-type]
    for c, i in zip(caches, ids):
        runtime.adopt(c, i)
    model.parallel = runtime
    return model
