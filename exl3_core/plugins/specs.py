"""Frozen declarations that plugins return from their hooks.

Specs are plain data: hashable, comparable, cheap to build. They point at code with lazy
``"module:attr"`` references that the registry resolves only when the thing is used, so loading
a plugin never imports torch, kernels or model code.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

#: Version of the plugin API (hookspecs + specs). A plugin may declare the version it was
#: written against as a module attribute ``EXL3_PLUGIN_API = (major, minor)``; the manager
#: refuses plugins with another major version or a newer minor version than this core's.
PLUGIN_API_VERSION: tuple[int, int] = (1, 0)


def _check_ref(cls: str, field: str, ref: str | None) -> None:
    if ref is None:
        return
    mod, sep, attr = ref.partition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"{cls}.{field}={ref!r} must be a lazy reference of the form 'package.module:attribute'")


@dataclass(frozen=True, kw_only=True)
class ArchSpec:
    """A model architecture, keyed by the HF ``config.json`` ``architectures[0]`` string.

    :param hf_arch: exact HF class string, e.g. ``"FooForCausalLM"``.
    :param model: ``"module:Class"`` of the :class:`exl3_core.archkit.Model` subclass.
    :param aliases: further HF strings served by the same class.
    :param test_config: ``"module:fn"`` returning ``{variant name: transformers PretrainedConfig}``,
        tiny random configs that the conformance suite in :mod:`exl3_core.testing` builds with
        transformers and compares exl3 against (no model hub needed).
    :param gguf_arch: llama.cpp ``general.architecture`` values this architecture imports from.
    :param gguf_adapter: ``"module:attr"`` of a :class:`exl3_core.convert.gguf_import.GGUFAdapter`
        that maps GGUF metadata to an HF ``config.json`` and states the tensor quirks.
    """

    hf_arch: str
    model: str
    aliases: tuple[str, ...] = ()
    test_config: str | None = None
    gguf_arch: tuple[str, ...] = ()
    gguf_adapter: str | None = None

    def __post_init__(self) -> None:
        for f in ("model", "test_config", "gguf_adapter"):
            _check_ref("ArchSpec", f, getattr(self, f))


@dataclass(frozen=True, kw_only=True)
class AttentionBackendSpec:
    """An attention backend. ``requires`` are import names checked with ``find_spec`` only.

    :param name: user-facing selector string, e.g. ``"triton_paged"``.
    :param impl: ``"module:Class"`` implementing :class:`exl3_core.attention.AttentionBackend`.
    :param requires: importable module names the backend needs; a missing one makes the backend
        unavailable (reported in dispatcher errors), never an import error.
    """

    name: str
    impl: str
    requires: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_ref("AttentionBackendSpec", "impl", self.impl)


@dataclass(frozen=True, kw_only=True)
class CacheLayerSpec:
    """Cache storage for one ``(kind, variant)`` pair, e.g. ``("kv", "fp16")``.

    :param kind: what an attention module stores: ``"kv"``, ``"mla"``, ...
    :param variant: how it is stored: ``"fp16"``, ``"quant"``, ...
    :param impl: ``"module:Class"`` of a :class:`exl3_core.cache.CacheLayer` subclass.
    """

    kind: str
    variant: str
    impl: str

    def __post_init__(self) -> None:
        _check_ref("CacheLayerSpec", "impl", self.impl)


@dataclass(frozen=True, kw_only=True)
class SamplerSpec:
    """A sampling step (``kind="step"``) or a named preset factory (``kind="preset"``)."""

    name: str
    impl: str
    kind: Literal["step", "preset"] = "step"

    def __post_init__(self) -> None:
        _check_ref("SamplerSpec", "impl", self.impl)
        if self.kind not in ("step", "preset"):
            raise ValueError(f"SamplerSpec.kind={self.kind!r} must be 'step' or 'preset'")


@dataclass(frozen=True, kw_only=True)
class FilterSpec:
    """A constrained-generation filter (grammar, JSON schema, ...)."""

    name: str
    impl: str
    requires: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_ref("FilterSpec", "impl", self.impl)


ALL_SPECS = (ArchSpec, AttentionBackendSpec, CacheLayerSpec, SamplerSpec, FilterSpec)


def replace(spec, **changes):
    """``dataclasses.replace`` re-exported for plugin authors."""
    return dataclasses.replace(spec, **changes)
