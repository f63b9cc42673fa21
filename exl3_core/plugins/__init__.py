"""The plugin system: hook specs, frozen specs, manager and registry."""
from __future__ import annotations

import pluggy

from exl3_core.plugins.info import PluginInfo, PluginLoadError
from exl3_core.plugins.manager import ENTRY_POINT_GROUP, get_plugins, load_plugins, set_plugins
from exl3_core.plugins.registry import Plugins, RegistryError, UnknownArchitecture, resolve_ref
from exl3_core.plugins.specs import (
    PLUGIN_API_VERSION,
    ArchSpec,
    AttentionBackendSpec,
    CacheLayerSpec,
    FilterSpec,
    SamplerSpec,
)

hookimpl = pluggy.HookimplMarker("exl3")

__all__ = [
    "ENTRY_POINT_GROUP", "PLUGIN_API_VERSION", "ArchSpec", "AttentionBackendSpec", "CacheLayerSpec",
    "FilterSpec", "PluginInfo", "PluginLoadError", "Plugins", "RegistryError", "SamplerSpec",
    "UnknownArchitecture", "get_plugins", "hookimpl", "load_plugins", "resolve_ref", "set_plugins",
]
