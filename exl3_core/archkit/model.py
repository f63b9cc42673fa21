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
"""
from __future__ import annotations

import gc
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.archkit.config import Config
from exl3_core.cache.geometry import CacheUser, LayerGeometry
from exl3_core.cache.layer import CacheLayers
from exl3_core.nn.module import LoadContext, Module, TensorSource

if TYPE_CHECKING:
    from exl3_core.cache.cache import Cache


def _open_source(directory: Path) -> TensorSource:
    from exl3_core.loader import SafetensorsCollection

    return SafetensorsCollection(directory)  # type: ignore[return-value]


def _release(device: torch.device) -> None:
    # Only device memory needs prompt release (the caching allocator keeps freed blocks); a full
    # gc pass costs ~0.5 s in a process with transformers imported, so CPU skips it.
    if device.type == "cuda" and torch.cuda.is_available():
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
             source: TensorSource | None = None, caches: Sequence[Cache] = ()) -> Model:
        """Read every weight from ``config.directory`` onto ``device``. All or nothing.

        :param device: default ``"cpu"``.
        :param dtype: dense weight/activation dtype; default float32 on CPU, float16 on CUDA.
        :param progressbar: draw a progress bar over the modules.
        :param attention: explicit attention backend order (overrides priorities and
            ``EXL3_ATTN_BACKENDS``); None = by priority.
        :param source: read tensors from here instead of the directory's safetensors files.
        :param caches: caches built for this model and not yet allocated: counted in the memory check
            and allocated on ``device`` after the weights (the model keeps no reference to them).
        :raises exl3_core.nn.WeightError, exl3_core.loader.LoaderError: naming the tensor (and file);
            nothing loaded by this call stays on the device then.
        """
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
            plan = checked_plan(self, src, dev, dtype, caches)  # refuses before any allocation when it won't fit
            ctx = LoadContext(src, dev, dtype)
            for m in modules:
                m.load_weights(ctx)
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
        return dict(report)

    def after_load(self) -> None:
        """Hook run once every module is loaded (tie weights, fuse projections ...)."""

    def unload(self) -> None:
        """Drop every weight; the module tree stays so :meth:`load` can run again."""
        dev = self._device
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

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Full cache-less forward: ``input_ids [B, S]`` -> fp32 logits ``[B, S, vocab]``."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {list(input_ids.shape)}")
        B, S = input_ids.shape
        meta = BatchMeta.full(input_ids.to(self.device))
        return self.forward_batch(meta).view(B, S, -1)

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
