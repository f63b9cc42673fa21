"""What every exl3 building block shares: weight loading/unloading and per-forward state.

A model's module tree is built from the config alone (cheap Python objects, no tensors), so
cache sizing and backend planning work before any weight is read. :meth:`Module.load_weights`
then fills each module from a :class:`LoadContext`; :meth:`Module.unload_weights` drops them
again. :class:`ForwardState` carries the batch metadata, the cache and per-forward memos (RoPE
cos/sin) through the blocks without any host synchronisation.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from exl3_core.nn.source import TensorSource, WeightError, fetch

if TYPE_CHECKING:
    from exl3_core.archkit.batch import BatchMeta
    from exl3_core.cache.layer import CacheLayer, CacheLayers, CacheStep
    from exl3_core.nn.linear import LinearBase
    from exl3_core.plugins.registry import Plugins


class LoadContext:
    """Everything a module needs to load itself: the source, the target device and dtype.

    :param source: the checkpoint's tensors.
    :param device: where weights go.
    :param dtype: floating-point dtype for dense weights (norms are kept in fp32, they are tiny and
        the fp32 compute path wants them there).
    """

    def __init__(self, source: TensorSource, device: torch.device, dtype: torch.dtype,
                 progress: Any = None) -> None:
        self.source = source
        self.device = device
        self.dtype = dtype
        self.progress = progress
        self._names: frozenset[str] | None = None

    @property
    def names(self) -> frozenset[str]:
        if self._names is None:
            self._names = frozenset(self.source.keys())
        return self._names

    def has(self, name: str) -> bool:
        return name in self.names

    def where(self, name: str) -> str:
        """Human-readable location of a tensor (its file when the source knows it)."""
        file_of = getattr(self.source, "file_of", None)
        if file_of is not None and name in self.names:
            return str(file_of(name))
        return str(self.source.directory)

    def missing(self, name: str, what: str) -> WeightError:
        # Suggest the tensors that share the longest prefix: a renamed key is the usual cause.
        stem = name.rsplit(".", 1)[0]
        near = sorted(n for n in self.names if n.startswith(stem.rsplit(".", 1)[0] + "."))[:8]
        hint = f"; tensors nearby: {', '.join(near)}" if near else ""
        return WeightError(f"tensor {name!r} ({what}) is missing from the checkpoint at {self.source.directory}"
                           f"{hint}. The checkpoint does not match its config.json, or is incomplete: re-download "
                           f"or re-convert it")

    def tensor(self, name: str, *, shape: tuple[int | None, ...] | None = None, dtype: torch.dtype | None = None,
               optional: bool = False, what: str = "weight") -> torch.Tensor | None:
        """Read ``name`` onto the device (converted to ``dtype`` if given); None if optional and absent."""
        if name not in self.names:
            if optional:
                return None
            raise self.missing(name, what)
        t = fetch(self.source, name, self.device, dtype, shape)
        if self.progress is not None:
            self.progress(name, t)
        return t

    def linear(self, key: str, in_features: int, out_features: int, *, bias: bool | None = None) -> LinearBase:
        """A linear layer from ``key.*`` (EXL3 or dense), see :func:`exl3_core.nn.linear.make_linear`."""
        from exl3_core.nn.linear import make_linear

        return make_linear(key, in_features, out_features, bias=bias, source=self.source, device=self.device,
                           dtype=self.dtype, names=self.names)


class Module(torch.nn.Module):
    """Base of exl3 building blocks: built without tensors, then loaded and unloaded in place.

    Subclasses load their own tensors in :meth:`load_weights` (children are visited by the
    model, not by the parent) and register tensor slots with ``register_buffer(name, None)`` in
    ``__init__`` so the default :meth:`unload_weights` can clear them. Submodules created during
    loading (linears, whose class depends on the checkpoint) are attached with
    :meth:`attach_loaded` and dropped on unload.
    """

    #: buffers computed from the config (not the checkpoint) that survive :meth:`unload_weights`
    static_buffers: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        super().__init__()
        self._loaded_children: list[str] = []

    def load_weights(self, ctx: LoadContext) -> None:
        """Read this module's own tensors (not its children's) from ``ctx``."""

    def unload_weights(self) -> None:
        for name in list(self._buffers):
            if name not in self.static_buffers:
                self._buffers[name] = None
        for name in self._loaded_children:
            self._modules[name] = None
        self._loaded_children = []

    def declare_slots(self, *names: str) -> None:
        """Empty submodule slots that :meth:`load_weights` fills with :meth:`attach_loaded`."""
        for n in names:
            self.register_module(n, None)

    def attach_loaded(self, name: str, module: torch.nn.Module | None) -> None:
        self._modules[name] = module
        if name not in self._loaded_children:
            self._loaded_children.append(name)

    def exl3_modules(self) -> Iterator[Module]:
        """Every :class:`Module` in this tree (pre-order), including self."""
        for m in self.modules():
            if isinstance(m, Module):
                yield m


class Communicator(Protocol):
    """The collectives a tensor-parallel forward needs (a torch.distributed process group's, or a test's)."""

    rank: int
    world: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of ``t`` over all ranks (every rank gets it)."""
        ...


@dataclass
class ForwardState:
    """Per-forward context handed to every block.

    :param meta: the batch (positions, sequence bounds, cache slots: all tensors).
    :param cache: the cache (``exl3_core.cache.Cache``) or None for a full, cache-less forward.
    :param allowed_backends: explicit attention backend order, or None for priority order.
    :param plugins: the plugin set whose attention backends are used.
    :param comm: the tensor-parallel group (None: one rank, nothing to reduce).
    """

    meta: BatchMeta
    cache: CacheLayers | None = None
    allowed_backends: tuple[str, ...] | None = None
    plugins: Plugins | None = None
    comm: Communicator | None = None
    memo: dict[object, Any] = field(default_factory=dict)

    def cache_layer(self, cache_index: int | None) -> CacheLayer | None:
        """Cache layer ``cache_index``, bound to this forward (:meth:`~exl3_core.cache.layer.CacheLayer.bind_step`)."""
        if self.cache is None or cache_index is None:
            return None
        layer = self.cache.layers[cache_index]
        layer.bind_step(self.cache_step())
        return layer

    def cache_step(self) -> CacheStep:
        """This forward as cache layers see it (built once per forward)."""
        from exl3_core.cache.layer import CacheStep

        return self.memoize("cache_step", lambda: CacheStep(
            self.meta.positions, self.meta.cu_seqlens_q, self.meta.seq_lens_k, self.meta.ring_slots,
            self.meta.q_per_seq))

    def slots(self) -> torch.Tensor:
        """This step's flat cache slots; a forward with a cache needs them."""
        if self.meta.slot_mapping is None or self.meta.page_table is None:
            raise ValueError("a forward with a cache needs BatchMeta.slot_mapping and page_table")
        return self.meta.slot_mapping

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of a row-parallel layer's partial outputs over the tensor-parallel group."""
        return t if self.comm is None else self.comm.all_reduce(t)

    def memoize(self, key: object, fn: Callable[[], Any]) -> Any:
        """``fn()`` once per forward for ``key`` (e.g. RoPE cos/sin shared by all layers)."""
        if key not in self.memo:
            self.memo[key] = fn()
        return self.memo[key]
