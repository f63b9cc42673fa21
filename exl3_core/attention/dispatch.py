"""Attention dispatcher: rank backends per static spec, take the first that accepts, cache it."""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from exl3_core.attention.backend import AttentionBackend
from exl3_core.attention.spec import AttnSpec
from exl3_core.plugins.registry import Plugins, missing_requires


class NoAttentionBackend(RuntimeError):
    """No registered backend accepts a spec; the message is a table of every backend's reasons."""

    def __init__(self, spec: AttnSpec, rejected: dict[str, list[str]], unavailable: dict[str, str]) -> None:
        self.spec, self.rejected, self.unavailable = spec, rejected, unavailable
        lines = ["no attention backend supports this configuration:"]
        lines += [f"  {f} = {getattr(spec, f)!r}" for f in spec._fields]
        lines.append("backends (in the order tried):")
        lines += [f"  {name}: {'; '.join(r)}" for name, r in rejected.items()] or ["  (none registered)"]
        if unavailable:
            lines.append("backends not available:")
            lines += [f"  {name}: {why}" for name, why in unavailable.items()]
        super().__init__("\n".join(lines))


class Dispatcher:
    """Per plugin set: instantiates backends lazily and caches the choice per (spec, allowed)."""

    def __init__(self, plugins: Plugins) -> None:
        self.plugins = plugins
        self._backends: dict[str, AttentionBackend] | None = None
        self._unavailable: dict[str, str] = {}
        self._cache: dict[tuple[AttnSpec, tuple[str, ...] | None], AttentionBackend] = {}
        self._lock = threading.Lock()

    def backends(self) -> dict[str, AttentionBackend]:
        if self._backends is None:
            out: dict[str, AttentionBackend] = {}
            for name, spec in self.plugins.attention_backend_specs().items():
                if miss := missing_requires(spec.requires):
                    self._unavailable[name] = f"module(s) {', '.join(miss)} not installed"
                    continue
                try:
                    cls = self.plugins.resolve(spec.impl, what="attention backend")
                    out[name] = cls()
                except Exception as e:  # noqa: BLE001 - reported in NoAttentionBackend
                    self._unavailable[name] = f"failed to load: {type(e).__name__}: {e}"
            for plugin, err in self.plugins.load_errors.items():
                self._unavailable.setdefault(f"plugin {plugin}", f"failed to load: {err}")
            self._backends = out
        return self._backends

    def select(self, spec: AttnSpec, allowed: tuple[str, ...] | None = None) -> AttentionBackend:
        """The backend for ``spec``; ``allowed`` is an explicit user order overriding priority."""
        key = (spec, allowed)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        with self._lock:
            backends = self.backends()
            if allowed is not None:
                unknown = [n for n in allowed if n not in backends and n not in self._unavailable]
                if unknown:
                    raise ValueError(f"unknown attention backend(s) {unknown}; registered: "
                                     f"{sorted(backends) + sorted(self._unavailable)}")
                ranked = [backends[n] for n in allowed if n in backends]
            else:
                ranked = sorted(backends.values(), key=lambda b: (-b.priority(spec), b.name))
            rejected: dict[str, list[str]] = {}
            for b in ranked:
                reasons = b.unsupported_reasons(spec)
                if not reasons:
                    self._cache[key] = b
                    return b
                rejected[b.name] = list(reasons)
            unavailable = dict(self._unavailable)
            if allowed is not None:
                for n in backends:
                    if n not in allowed:
                        unavailable[n] = "not in the requested backend list"
            raise NoAttentionBackend(spec, rejected, unavailable)

    def select_view(self, spec_of: Callable[[str], AttnSpec], views: Sequence[str],
                    allowed: tuple[str, ...] | None = None) -> tuple[AttentionBackend, str]:
        """The backend and cache view for a call over a cache layer offering ``views`` (native first):
        every backend is tried on the native view before any conversion is considered."""
        if not views:
            raise ValueError("a cache layer offers no view for attention to read")
        failures: list[NoAttentionBackend] = []
        for view in views:
            try:
                return self.select(spec_of(view), allowed), view
            except NoAttentionBackend as e:
                failures.append(e)
        if len(failures) == 1:
            raise failures[0]
        raise NoAttentionBackend(failures[0].spec, {f"{name} (view {f.spec.cache})": r for f in failures
                                                   for name, r in f.rejected.items()}, failures[0].unavailable)


_dispatchers: dict[int, Dispatcher] = {}


def get_dispatcher(plugins: Plugins | None = None) -> Dispatcher:
    """The dispatcher of a plugin set (default: the process-wide one)."""
    if plugins is None:
        from exl3_core.plugins import get_plugins

        plugins = get_plugins()
    d = _dispatchers.get(id(plugins))
    if d is None or d.plugins is not plugins:
        d = _dispatchers[id(plugins)] = Dispatcher(plugins)
    return d


def select(spec: AttnSpec, allowed: tuple[str, ...] | None = None, plugins: Plugins | None = None) -> AttentionBackend:
    """Convenience: ``get_dispatcher(plugins).select(spec, allowed)``; ``EXL3_ATTN_BACKENDS`` applies."""
    if allowed is None:
        from exl3_core import settings

        allowed = settings.get().attn_backends
    return get_dispatcher(plugins).select(spec, allowed)
