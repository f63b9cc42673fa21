"""Plugin manager: loads the built-ins and entry-point plugins into one pluggy manager.

Entry points are loaded by hand rather than with ``pm.load_setuptools_entrypoints`` because
pluggy stops at the first broken plugin; exl3 records each failure and reports it when something
that plugin might provide is asked for, and start-up never crashes because of a plugin.
"""
from __future__ import annotations

import importlib
import importlib.metadata as md
import logging
import threading
from collections.abc import Collection, Iterable
from types import ModuleType

import pluggy

from exl3_core import settings
from exl3_core.plugins import hookspecs
from exl3_core.plugins.info import PluginInfo, PluginLoadError
from exl3_core.plugins.registry import Plugins
from exl3_core.plugins.specs import PLUGIN_API_VERSION

log = logging.getLogger("exl3.plugins")

ENTRY_POINT_GROUP = "exl3"
DEFAULT_PLUGINS = (
    "exl3_core.builtins.attn_torch",
    "exl3_core.builtins.cache_kv",
    "exl3_core.builtins.samplers",
)


def _check_api(name: str, obj: object) -> None:
    want = getattr(obj, "EXL3_PLUGIN_API", None)
    if want is None:
        return
    try:
        major, minor = int(want[0]), int(want[1])
    except (TypeError, ValueError, IndexError):
        raise PluginLoadError(f"plugin {name!r}: EXL3_PLUGIN_API={want!r} must be a (major, minor) tuple") from None
    cmaj, cmin = PLUGIN_API_VERSION
    if major != cmaj or minor > cmin:
        raise PluginLoadError(
            f"plugin {name!r} was written for exl3 plugin API {major}.{minor}, but this exl3-core "
            f"provides {cmaj}.{cmin}; upgrade the plugin or exl3-core so they match"
        )


def load_plugins(
    *,
    autoload: bool | None = None,
    allow: Collection[str] | None = None,
    block: Collection[str] = (),
    extra: Iterable[object] = (),
) -> Plugins:
    """Build a plugin set.

    :param autoload: load entry-point plugins (default: not ``EXL3_DISABLE_PLUGIN_AUTOLOAD``).
    :param allow: only these entry-point names (default: ``EXL3_PLUGINS``, or all).
    :param block: never these names (added to ``EXL3_DISABLE_PLUGINS``).
    :param extra: plugin objects/modules to register directly (no entry point needed).
    """
    s = settings.get()
    pm = pluggy.PluginManager("exl3")
    pm.add_hookspecs(hookspecs)
    infos: dict[str, PluginInfo] = {}
    blocked = set(block) | set(s.disable_plugins)
    for name in blocked:
        pm.set_blocked(name)
    for mod in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(mod), name=mod)
        infos[mod] = PluginInfo(name=mod, module=mod, distribution="exl3-core", builtin=True,
                                version=_dist_version("exl3-core"))
    if autoload if autoload is not None else not s.disable_plugin_autoload:
        allow = allow if allow is not None else s.plugins
        for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if ep.name in infos:
                continue
            dist = ep.dist.name if ep.dist is not None else None
            ver = ep.dist.version if ep.dist is not None else None
            info = PluginInfo(name=ep.name, module=ep.value, distribution=dist, version=ver)
            infos[ep.name] = info
            if (allow is not None and ep.name not in allow) or ep.name in blocked:
                info.blocked = True
                continue
            try:
                obj = ep.load()
                _check_api(ep.name, obj)
                pm.register(obj, name=ep.name)
            except Exception as e:  # noqa: BLE001 - a broken plugin must not stop the others
                info.error = e
                log.warning("exl3 plugin %r (%s) failed to load: %s", ep.name, ep.value, e)
    for i, obj in enumerate(extra):
        name = getattr(obj, "__name__", None) or f"extra-{i}-{type(obj).__name__}"
        _check_api(name, obj)
        pm.register(obj, name=name)
        infos[name] = PluginInfo(name=name, module=name)
    pm.check_pending()
    if s.trace_plugins:
        pm.trace.root.setwriter(lambda msg: log.warning("%s", msg.rstrip()))
        pm.enable_tracing()
    for name, info in infos.items():
        plugin = pm.get_plugin(name)
        if plugin is not None:
            info.hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
    return Plugins(pm, infos)


def _dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


_default: Plugins | None = None
_lock = threading.Lock()


def get_plugins() -> Plugins:
    """The process-wide default plugin set (built on first use from the environment)."""
    global _default
    with _lock:
        if _default is None:
            _default = load_plugins()
        return _default


def set_plugins(plugins: Plugins | None) -> None:
    """Replace the process-wide default (``None`` rebuilds it on next use)."""
    global _default
    with _lock:
        _default = plugins


def plugin_module(obj: object) -> ModuleType | None:
    return obj if isinstance(obj, ModuleType) else None
