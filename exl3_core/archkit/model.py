"""The model base class: construction from a config, all-or-nothing loading, the forward contract.

A model is built from its :class:`~exl3_core.archkit.config.Config` alone (module tree, no
tensors), then :meth:`Model.load` reads every weight. Two forward entry points:

* :meth:`Model.forward` ``(input_ids [B, S]) -> fp32 logits [B, S, vocab]``: a full, cache-less
  pass (what conformance tests and perplexity use);
* :meth:`Model.forward_batch` ``(meta, cache) -> fp32 logits [N, vocab]``: the reference over a
  packed batch. Everything it reads from ``meta`` is a tensor or a static Python bound, so a
  decode step can be captured in a CUDA graph: no per-layer host syncs and no data-dependent
  Python shapes. The engine runs it through :class:`exl3_core.plan.ExecutionPlan`.

A model reports the geometry its cache needs (:meth:`Model.cache_geometry`); caches are built from
it and hold no reference to the model.

Loaded with ``tensor_parallel_size=N`` (or ``devices=[...]``), the model in the calling process is rank 0
of N: it holds its share of every layer and drives the other ranks' worker processes through
:attr:`Model.parallel` (see :mod:`exl3_core.parallel`).
"""
from __future__ import annotations

import gc
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.archkit.config import Config
from exl3_core.cache.geometry import CacheUser, LayerGeometry
from exl3_core.cache.layer import CacheLayers
from exl3_core.nn.module import Communicator, LoadContext, Module, TensorSource
from exl3_core.nn.shard import ModuleSharder

if TYPE_CHECKING:
    from exl3_core.cache.cache import Cache
    from exl3_core.tuning import Tuning

#: one rank's forward of a step: its logits slice (the head's dtype), reductions through the communicator
LocalForward = Callable[[BatchMeta, "CacheLayers | None", Communicator], torch.Tensor]

#: the tensor-parallel loader, named rather than imported: it sits above the model (it builds execution
#: plans and starts worker processes), so the model reaches it the way plugins' specs are reached
PARALLEL_LOADER = "exl3_core.parallel.loader:load_parallel"


@runtime_checkable
class ParallelRuntime(Protocol):
    """The ranks a model was loaded over, as the calling process (rank 0) drives them each step."""

    #: number of ranks (this process included)
    world: int

    def forward(self, meta: BatchMeta, cache: CacheLayers | None = None, *, fp32_logits: bool = True) -> torch.Tensor:
        """The whole model's logits for ``meta`` (every rank runs its share)."""
        ...

    def run(self, meta: BatchMeta, cache: CacheLayers | None, local: LocalForward, tuning: Tuning) -> torch.Tensor:
        """Every rank runs one step, rank 0 through ``local``; the gathered logits, in the head's dtype."""
        ...

    def close(self) -> None:
        """Drop every rank's share (and stop the workers the load started)."""
        ...

    def rank_reports(self) -> list[dict[str, Any]]:
        """Each other rank's memory report (as :meth:`Model.memory_report`), by rank."""
        ...


def _open_source(directory: Path) -> TensorSource:
    from exl3_core.loader import SafetensorsCollection

    return SafetensorsCollection(directory)  # type: ignore[return-value]


def _release(device: torch.device) -> None:
    # Only device memory needs prompt release (the caching allocator keeps freed blocks); a full
    # gc pass costs ~0.5 s in a process with transformers imported, so CPU skips it.
    if device.type == "cuda" and torch.cuda.is_available():
        gc.unfreeze()  # a generator froze the model's objects (generator/graphs.py: freeze_long_lived)
        gc.collect()
        torch.cuda.empty_cache()


class Model(torch.nn.Module):
    """Base of every architecture. Subclasses build their module tree in ``__init__``.

    :param config: the model directory's configuration.
    """

    #: the architecture's typed config, built from :class:`Config` by subclasses that use one
    config_class: ClassVar[type | None] = None

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__()
        if kwargs:
            raise TypeError(f"{type(self).__name__} got unexpected arguments {sorted(kwargs)}")
        self.config = config
        self.plugins = config.plugins
        self._device: torch.device | None = None
        self._dtype: torch.dtype | None = None
        self.allowed_backends: tuple[str, ...] | None = None
        #: counts loads: what was built from loaded modules (an execution plan) is current while it holds
        self.load_generation = 0
        #: the other ranks when loaded with tensor parallelism (None: this process holds the whole model)
        self.parallel: ParallelRuntime | None = None

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Config, **kwargs: Any) -> Model:
        """Build the model for ``config``; on :class:`Model` itself, dispatch to the architecture's class."""
        target: type = cls
        if cls is Model:
            target = config.model_class()
            if not (isinstance(target, type) and issubclass(target, Model)):
                raise TypeError(f"the model class registered for {config.arch_name!r} ({config.arch.model}) is "
                                f"not an exl3_core.archkit.Model subclass; fix the plugin's ArchSpec.model")
        return target(config, **kwargs)  # type: ignore[no-any-return]

    @classmethod
    def from_pretrained(cls, path: str | Path, *, plugins: Any = None, device: str | torch.device | None = None,
                        dtype: torch.dtype | None = None, attention: list[str] | None = None,
                        progressbar: bool = False) -> Model:
        """``Config.from_directory`` + :meth:`from_config` + :meth:`load`."""
        model = cls.from_config(Config.from_directory(path, plugins=plugins))
        return model.load(device=device, dtype=dtype, attention=attention, progressbar=progressbar)

    # -- loading --------------------------------------------------------------------------------
    def exl3_modules(self) -> Iterator[Module]:
        """Every loadable building block, in registration (pre-)order."""
        for m in self.modules():
            if isinstance(m, Module):
                yield m

    @property
    def loaded(self) -> bool:
        return self._device is not None

    @property
    def device(self) -> torch.device:
        if self._device is None:
            raise RuntimeError(f"{type(self).__name__} is not loaded; call .load() first")
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        if self._dtype is None:
            raise RuntimeError(f"{type(self).__name__} is not loaded; call .load() first")
        return self._dtype

    def load(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
             progressbar: bool = False, attention: list[str] | tuple[str, ...] | None = None,
             source: TensorSource | None = None, caches: Sequence[Cache] = (), *,
             tensor_parallel_size: int | None = None, devices: Sequence[str | torch.device] | None = None,
             expert_parallel: bool = False, parallel_group: Any = None,
             shard: ModuleSharder | None = None) -> Model:
        """Read every weight from ``config.directory`` onto ``device``. All or nothing.

        :param device: default ``"cpu"``.
        :param dtype: dense weight/activation dtype; default float32 on CPU, float16 on CUDA.
        :param progressbar: draw a progress bar over the modules.
        :param attention: explicit attention backend order (overrides priorities and
            ``EXL3_ATTN_BACKENDS``); None = by priority.
        :param source: read tensors from here instead of the directory's safetensors files.
        :param caches: caches built for this model and not yet allocated: counted in the memory check
            and allocated on ``device`` after the weights (the model keeps no reference to them).
        :param tensor_parallel_size: split the model over this many ranks (devices ``device``'s index onwards:
            ``"cuda"`` = cuda:0..N-1; ``"cpu"``: N processes on the CPU); this process is rank 0 and starts
            the others (:mod:`exl3_core.parallel`). 1 runs the sharded path in this process alone.
        :param devices: one device per rank instead (``tensor_parallel_size`` = its length).
        :param expert_parallel: mixture-of-experts layers divide their experts among the ranks instead of
            splitting every expert.
        :param parallel_group: a :class:`exl3_core.parallel.WorkerGroup` to load into (its devices, its
            workers; it outlives the model), instead of starting workers.
        :param shard: load one rank's share: each module is cut by ``shard`` as soon as it is loaded (the
            tensor-parallel loader passes it; the memory check counts the share).
        :raises exl3_core.nn.WeightError, exl3_core.loader.LoaderError: naming the tensor (and file);
            nothing loaded by this call stays on the device then.
        :raises exl3_core.parallel.ParallelError: a rank could not load its share (naming the rank).
        """
        if tensor_parallel_size is not None or devices is not None or expert_parallel or parallel_group is not None:
            if shard is not None:
                raise ValueError("Model.load: shard= is one rank's load; it cannot be combined with "
                                 "tensor_parallel_size/devices/parallel_group")
            from exl3_core.plugins.registry import resolve_ref

            load_parallel = resolve_ref(PARALLEL_LOADER, what="the tensor-parallel loader")
            return load_parallel(self, device=device, devices=devices, tensor_parallel_size=tensor_parallel_size,  # type: ignore[no-any-return]
                                 expert_parallel=expert_parallel, group=parallel_group, dtype=dtype,
                                 progressbar=progressbar, attention=attention, source=source, caches=caches)
        dev = torch.device(device if device is not None else "cpu")
        if dtype is None:
            dtype = torch.float32 if dev.type == "cpu" else torch.float16
        if self.loaded:
            self.unload()
        if attention is not None:
            allowed: tuple[str, ...] | None = tuple(attention)
        else:
            from exl3_core import settings

            allowed = settings.get().attn_backends
        own_source = source is None
        src = _open_source(self.config.directory) if source is None else source
        modules = list(self.exl3_modules())  # snapshot: loading attaches new children
        fresh = [c for c in caches if not c.allocated]
        bar = None
        if progressbar:
            from exl3_core.progress import Progress

            bar = Progress(len(modules), f"loading {self.config.directory.name}", unit=" modules")
        try:
            from exl3_core.archkit.memory import checked_plan
            from exl3_core.cache.readable import check_readable

            check_readable(self, fresh, dev, dtype, allowed)  # a cache no attention backend reads: before anything
            plan = checked_plan(self, src, dev, dtype, caches, shard)  # refuses before any allocation if it won't fit
            ctx = LoadContext(src, dev, dtype)
            for m in modules:
                m.load_weights(ctx)
                if shard is not None:
                    shard.shard_module(m)
                if bar is not None:
                    bar.advance(1)
            self.after_load()
            self._device, self._dtype = dev, dtype
            for c in fresh:
                c.allocate(dev, dtype)
        except BaseException as e:
            self._device = self._dtype = None
            for c in fresh:  # only what this call allocated
                c.free()
            for m in modules:
                m.unload_weights()
            # Frames of the failing call still reference tensors; clear them so memory is freed now.
            traceback.clear_frames(e.__traceback__)
            _release(dev)
            raise
        finally:
            if bar is not None:
                bar.close()
            if own_source:
                close = getattr(src, "close", None)
                if close is not None:
                    close()
        self._device, self._dtype, self.allowed_backends = dev, dtype, allowed
        self.load_generation += 1
        from exl3_core.archkit.memory import load_report

        self.__dict__["_memory_report"] = load_report(self, plan, dev, caches)
        return self

    def memory_report(self) -> dict[str, Any]:
        """What the last :meth:`load` planned and allocated (bytes); see :mod:`exl3_core.archkit.memory`."""
        report = self.__dict__.get("_memory_report")
        if report is None or not self.loaded:
            raise RuntimeError(f"{type(self).__name__} is not loaded; call .load() first")
        out = dict(report)
        if self.parallel is not None:
            out["ranks"] = [dict(report), *self.parallel.rank_reports()]
        return out

    def after_load(self) -> None:
        """Hook run once every module is loaded (tie weights, fuse projections ...)."""

    def unload(self) -> None:
        """Drop every weight (every rank's, when loaded over several) and every LoRA adapter; the module tree
        stays so :meth:`load` can run again."""
        from exl3_core.lora.registry import forget

        forget(self)
        dev = self._device
        if self.parallel is not None:
            runtime, self.parallel = self.parallel, None
            runtime.close()
        for m in self.exl3_modules():
            m.unload_weights()
        self._device = self._dtype = None
        self.__dict__.pop("_memory_report", None)
        if dev is not None:
            _release(dev)

    # -- forward --------------------------------------------------------------------------------
    def attention_layers(self) -> list[CacheUser]:
        """Modules that own a cache layer (:class:`~exl3_core.cache.geometry.CacheUser`), in model order.

        A :class:`~exl3_core.cache.Cache` holds ``cache.layers[i]`` for ``attention_layers()[i]``; each
        module's ``cache_index`` is set to its position here.
        """
        found: list[CacheUser] = [m for m in self.modules() if isinstance(m, CacheUser)]
        for i, m in enumerate(found):
            m.cache_index = i
        return found

    def cache_geometry(self) -> tuple[LayerGeometry, ...]:
        """What each cache layer stores (kind, KV heads, key and value widths), from the config alone."""
        return tuple(m.cache_geometry() for m in self.attention_layers())

    def forward(self, input_ids: torch.Tensor, loras: Any = None) -> torch.Tensor:  # type: ignore[override]
        """Full cache-less forward: ``input_ids [B, S]`` -> fp32 logits ``[B, S, vocab]``.

        :param loras: LoRA adapters to apply, ``{name: weight}`` for every sequence or a list of one such
            mapping (or None) per sequence; None: the base model (see :meth:`load_lora`).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {list(input_ids.shape)}")
        B, S = input_ids.shape
        meta = BatchMeta.full(input_ids.to(self.device))
        from exl3_core.lora.registry import attached, lora_set

        adapters = lora_set(self) if loras is not None else attached(self)
        if adapters is None:
            return self.forward_batch(meta).view(B, S, -1)
        with adapters.using(loras, S, B):
            return self.forward_batch(meta).view(B, S, -1)

    # -- LoRA -----------------------------------------------------------------------------------
    def load_lora(self, path: str | Path, name: str | None = None) -> str:
        """Attach the PEFT LoRA adapter in folder ``path`` as ``name`` (default: the folder's name) beside the
        base weights, which stay as they are; several may be loaded, and each forward or job chooses
        (``loras={name: weight}``). Returns the name.

        :raises exl3_core.lora.LoraError: naming the file and tensor; nothing is attached then.
        """
        from exl3_core.lora.registry import lora_set

        return lora_set(self).load(path, name)

    def unload_lora(self, name: str) -> None:
        """Detach LoRA adapter ``name`` (jobs still naming it end with an error)."""
        from exl3_core.lora.registry import lora_set

        lora_set(self).unload(name)

    def merge_lora(self, name: str, weight: float = 1.0) -> None:
        """Fold LoRA adapter ``name`` into the dense linears it targets (then unloaded: every forward has it).

        :raises exl3_core.lora.LoraError: for EXL3-quantized targets (convert with ``exl3 convert --lora``).
        """
        from exl3_core.lora.registry import lora_set

        lora_set(self).merge(name, weight)

    def lora_names(self) -> list[str]:
        """The LoRA adapters loaded now."""
        from exl3_core.lora.registry import attached

        s = attached(self)
        return s.names() if s is not None else []

    def forward_batch(self, meta: BatchMeta, cache: CacheLayers | None = None, *,
                      fp32_logits: bool = True) -> torch.Tensor:
        """Packed forward: fp32 logits ``[N, vocab]`` for ``meta.logits_indices`` (all T tokens if None).

        With ``cache``, new keys/values are written to ``cache.layers[i]`` at ``meta.slot_mapping``
        and attention reads the pages named by ``meta.page_table``. ``fp32_logits=False`` returns the
        head's output as it is (fp16): the decode graphs' greedy pick reads it without the cast.
        """
        raise NotImplementedError(f"{type(self).__name__}.forward_batch")

    def default_chat_prompt(self, prompt: str, system_prompt: str | None = None) -> str:
        """A single-turn prompt in the model's chat format (optional per architecture)."""
        raise NotImplementedError(f"{type(self).__name__} defines no default chat prompt; use the tokenizer's "
                                  f"chat template")
