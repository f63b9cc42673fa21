"""What rank 0 tells its workers, and what they answer: small picklable dataclasses sent over each worker's
pipe. Tensors never travel this way (they go through the process group's collectives); a command carries
only what a worker needs to take part in the next collectives.
"""
from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import torch

from exl3_core.tuning import Tuning


class ParallelError(RuntimeError):
    """A tensor-parallel group failed (a worker died, timed out or raised) or refused a request; the message
    names the rank and what it reported."""


@dataclass(frozen=True)
class WorkerBoot:
    """What a worker process starts from: its rank, every rank's device, the rendezvous store's port on this
    host, the collective and start-up timeouts (seconds), its CPU thread count and rank 0's process id."""

    rank: int
    devices: tuple[str, ...]
    port: int
    timeout: float
    startup_timeout: float
    threads: int
    parent_pid: int


# -- what a worker rebuilds a model from ----------------------------------------------------------------------
@dataclass(frozen=True)
class PluginRecipe:
    """The plugin set of rank 0, as names a worker can load again: entry points allowed and blocked, and
    plugin modules registered directly."""

    allow: tuple[str, ...]
    block: tuple[str, ...]
    extra: tuple[str, ...]

    @classmethod
    def of(cls, plugins: Any) -> PluginRecipe:
        """The recipe of an :class:`exl3_core.plugins.registry.Plugins`.

        :raises ParallelError: for a plugin registered as an object rather than an importable module."""
        entry_points = {ep.name for ep in md.entry_points(group="exl3")}
        allow: list[str] = []
        block: list[str] = []
        extra: list[str] = []
        for name, info in plugins.infos.items():
            if info.builtin:
                continue
            if name in entry_points:
                (block if info.blocked or info.error is not None else allow).append(name)
                continue
            obj = plugins.pm.get_plugin(name)
            if not isinstance(obj, ModuleType):
                raise ParallelError(f"plugin {name!r} was registered as a {type(obj).__name__} object; tensor-parallel "
                                    f"workers rebuild the plugin set by importing modules, so register a module")
            extra.append(obj.__name__)
        return cls(tuple(allow), tuple(block), tuple(extra))


@dataclass(frozen=True)
class ModelRecipe:
    """How a worker builds the same (unloaded) model: its class, directory and ``config.json`` contents."""

    model_class: str  # "module:qualname"
    directory: Path
    config: dict[str, Any]
    plugins: PluginRecipe


@dataclass(frozen=True)
class CacheSpec:
    """A paged cache a worker creates for its share of the KV heads (its own geometry, the same pages)."""

    cache_id: int
    max_num_tokens: int
    variant: str
    page_size: int
    layer_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MetaHeader:
    """The host-side shape of a step's :class:`~exl3_core.archkit.batch.BatchMeta`; its tensors follow as one
    int64 broadcast (:func:`exl3_core.parallel.comm.pack_meta`)."""

    tokens: int
    seqs: int
    table_width: int  # 0: no page table
    logits_rows: int  # -1: every row
    has_slots: bool
    max_seqlen_q: int
    max_seqlen_k: int
    phase: Literal["prefill", "decode"]

    @property
    def out_rows(self) -> int:
        """Rows of the step's logits."""
        return self.tokens if self.logits_rows < 0 else self.logits_rows

    @property
    def numel(self) -> int:
        t, b = self.tokens, self.seqs
        return 2 * t + (b + 1) + b + b * self.table_width + (t if self.has_slots else 0) + max(self.logits_rows, 0)


# -- commands (rank 0 -> worker) ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadModel:
    """Build the model, load this rank's share (and its caches); answered by :class:`Done`."""

    model_id: int
    recipe: ModelRecipe
    source: Any  # a picklable TensorSource, or None: the model directory's safetensors
    dtype: torch.dtype
    attention: tuple[str, ...] | None
    expert_parallel: bool
    caches: tuple[CacheSpec, ...]


@dataclass(frozen=True)
class UnloadModel:
    model_id: int


@dataclass(frozen=True)
class NewCache:
    """Create and allocate a cache for the model's share; answered by :class:`Done`."""

    model_id: int
    spec: CacheSpec


@dataclass(frozen=True)
class FreeCache:
    model_id: int
    cache_id: int


@dataclass(frozen=True)
class CopyPage:
    model_id: int
    cache_id: int
    src: int
    dst: int


@dataclass(frozen=True)
class Forward:
    """Run one step: receive the metadata broadcast, run this rank's share, send its logits slice to rank 0."""

    model_id: int
    cache_id: int | None
    header: MetaHeader
    tuning: Tuning


@dataclass(frozen=True)
class Stop:
    """Leave the process group and exit."""


Command = LoadModel | UnloadModel | NewCache | FreeCache | CopyPage | Forward | Stop


# -- answers (worker -> rank 0) ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    """Sent once the worker runs, before it joins the process group."""

    pid: int


@dataclass(frozen=True)
class Ready:
    """Sent once the worker joined the process group."""


@dataclass(frozen=True)
class Done:
    """The answer to a command that may fail: ``error`` None, or what went wrong (type, message, where)."""

    error: str | None = None
    report: dict[str, Any] | None = None


@dataclass(frozen=True)
class Fatal:
    """Sent by a worker that cannot continue (a step raised); it exits right after."""

    error: str


Answer = Hello | Ready | Done | Fatal
