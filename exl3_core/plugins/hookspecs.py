"""Hook specifications: the whole exl3 plugin API.

A plugin is any module or object with functions decorated ``@exl3_core.hookimpl`` whose names
match the hooks below. Installed plugins are found through the entry-point group ``exl3``; the
core registers its own built-ins (torch attention, fp16 cache, stock samplers) through the very
same hooks.

Rules for implementations:

* Hooks *declare*: they return frozen specs from :mod:`exl3_core.plugins.specs` that point at
  code lazily (``"module:attr"``). They must not import torch, allocate memory or touch a GPU,
  because plugins are loaded by every process (CLI start-up, tensor-parallel workers).
* Implementations must be pure and cheap; the manager may call them more than once.
* A plugin module may set ``EXL3_PLUGIN_API = (major, minor)``; the manager refuses a plugin
  built for another major version, or for a newer minor version than this core.

Evolution: adding an argument to a hook is backwards compatible (pluggy passes only the arguments
an implementation names); adding a spec field with a default is backwards compatible; anything
else is a breaking change and bumps ``PLUGIN_API_VERSION``'s major number.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from exl3_core.plugins.specs import (
        ArchSpec,
        AttentionBackendSpec,
        CacheLayerSpec,
        FilterSpec,
        SamplerSpec,
    )

hookspec = pluggy.HookspecMarker("exl3")


@hookspec
def exl3_architectures() -> list[ArchSpec]:
    """Declare the model architectures this plugin provides.

    Called once per plugin set when something asks for an architecture (model loading,
    ``exl3 plugins``, GGUF import). Two plugins declaring the same ``hf_arch`` is an error
    reported at lookup time, naming both plugins.

    :return: one :class:`~exl3_core.plugins.specs.ArchSpec` per HF ``architectures[0]`` string
        (plus ``aliases``). Return ``[]`` to declare nothing.
    """


@hookspec
def exl3_attention_backends() -> list[AttentionBackendSpec]:
    """Declare attention backends.

    The dispatcher instantiates a backend lazily the first time it is ranked, after checking
    its ``requires`` with ``importlib.util.find_spec`` (never importing them). For each static
    :class:`~exl3_core.attention.AttnSpec` it ranks available backends by their
    ``priority(spec)`` (ties by name) and takes the first whose ``unsupported_reasons(spec)`` is
    empty; the choice is cached per spec.

    :return: one :class:`~exl3_core.plugins.specs.AttentionBackendSpec` per backend.
    """


@hookspec
def exl3_cache_layer_types() -> list[CacheLayerSpec]:
    """Declare KV-cache layer storage for ``(kind, variant)`` pairs.

    Attention modules say which ``kind`` they store (``"kv"``, ``"mla"``); users pick a
    ``variant`` (``"fp16"`` by default). The registry resolves the pair when a
    :class:`~exl3_core.cache.Cache` is built and, for an unknown pair, lists what exists.

    :return: one :class:`~exl3_core.plugins.specs.CacheLayerSpec` per pair.
    """


@hookspec
def exl3_samplers() -> list[SamplerSpec]:
    """Declare sampling steps (``kind="step"``) and named presets (``kind="preset"``).

    Steps are :class:`exl3_core.sampling.SamplingStep` subclasses, composed into a pipeline by
    the user; presets are factories returning a ready :class:`exl3_core.sampling.Sampler`.
    Names must be unique across plugins.

    :return: a list of :class:`~exl3_core.plugins.specs.SamplerSpec`.
    """


@hookspec
def exl3_filters() -> list[FilterSpec]:
    """Declare constrained-generation filters (JSON schema, regex, grammars...).

    A filter whose ``requires`` are missing stays listed as unavailable; asking for it raises
    an error naming the missing modules, before any generation starts.

    :return: a list of :class:`~exl3_core.plugins.specs.FilterSpec`.
    """


@hookspec(firstresult=True)
def exl3_resolve_architecture(hf_config: Mapping[str, Any], model_dir: Path) -> ArchSpec | None:
    """Claim a checkpoint that ``architectures[0]`` alone cannot identify.

    Called only when no ArchSpec matches by name, or when several do; the first non-None
    answer wins. Needed e.g. when one HF class string covers several ``model_type`` variants.

    :param hf_config: the parsed ``config.json``.
    :param model_dir: the model directory (read-only: do not load weights here).
    :return: the ArchSpec to use, or None to pass.
    """
