"""Lazy registry over a loaded plugin set: specs by name, ``"module:attr"`` resolution, errors.

Every "not found" error lists what *is* registered, which plugins failed to load (with their
errors) and, where known, the distribution that would provide the missing thing.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pluggy

from exl3_core.plugins.info import PluginInfo
from exl3_core.plugins.specs import (
    ArchSpec,
    AttentionBackendSpec,
    CacheLayerSpec,
    FilterSpec,
    SamplerSpec,
)

T = TypeVar("T")


class RegistryError(LookupError):
    """Something asked of the plugin registry does not exist or cannot be loaded."""


class UnknownArchitecture(RegistryError):
    pass


@functools.cache
def known_providers() -> dict[str, str]:
    """HF architecture -> distribution that provides it (a data file; used only in messages)."""
    p = Path(__file__).resolve().parent.parent / "data" / "known_architectures.json"
    data = json.loads(p.read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def resolve_ref(ref: str, *, what: str = "object") -> Any:
    """Import ``"module:attr.sub"`` and return the attribute; errors name the reference."""
    mod_name, _, attr = ref.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except Exception as e:
        raise RegistryError(f"cannot import module {mod_name!r} for {what} {ref!r}: {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RegistryError(f"{what} {ref!r}: module {mod_name!r} has no attribute {attr!r}") from None
    return obj


def missing_requires(requires: tuple[str, ...]) -> list[str]:
    """Module names from ``requires`` that are not importable (checked without importing)."""
    out = []
    for name in requires:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out


class Plugins:
    """A loaded plugin set. Build with :func:`exl3_core.plugins.load_plugins`."""

    def __init__(self, pm: pluggy.PluginManager, infos: dict[str, PluginInfo]) -> None:
        self.pm = pm
        self.infos = infos
        self._collected: dict[str, list[tuple[str, Any]]] = {}
        self._hook_errors: list[tuple[str, str, BaseException]] = []

    # -- collection -------------------------------------------------------------------------
    def _collect(self, hook_name: str) -> list[tuple[str, Any]]:
        """(plugin name, spec) pairs from every implementation of a list-returning hook."""
        if hook_name in self._collected:
            return self._collected[hook_name]
        out: list[tuple[str, Any]] = []
        hook = getattr(self.pm.hook, hook_name)
        for impl in reversed(hook.get_hookimpls()):  # registration order
            try:
                res = impl.function()
            except Exception as e:  # noqa: BLE001 - recorded and reported on demand
                self._hook_errors.append((impl.plugin_name, hook_name, e))
                continue
            for spec in res or []:
                out.append((impl.plugin_name, spec))
        self._collected[hook_name] = out
        return out

    @property
    def load_errors(self) -> dict[str, BaseException]:
        """Plugins that failed to load or whose hooks raised, by plugin name."""
        errs = {n: i.error for n, i in self.infos.items() if i.error is not None}
        for plugin, hook, e in self._hook_errors:
            errs.setdefault(f"{plugin} ({hook})", e)
        return errs

    def _errors_text(self) -> str:
        errs = self.load_errors
        if not errs:
            return ""
        lines = [f"  {n}: {type(e).__name__}: {e}" for n, e in errs.items()]
        return "\nplugins that failed to load (they may have provided it):\n" + "\n".join(lines)

    def provider_of(self, spec: object) -> str | None:
        for hook in ("exl3_architectures", "exl3_attention_backends", "exl3_cache_layer_types",
                     "exl3_samplers", "exl3_filters"):
            for name, s in self._collect(hook):
                if s is spec:
                    return name
        return None

    # -- architectures ----------------------------------------------------------------------
    def architectures(self) -> dict[str, ArchSpec]:
        """HF architecture string (and aliases) -> ArchSpec. Duplicates raise."""
        out: dict[str, ArchSpec] = {}
        owner: dict[str, str] = {}
        for plugin, spec in self._collect("exl3_architectures"):
            if not isinstance(spec, ArchSpec):
                raise RegistryError(f"plugin {plugin!r} returned {spec!r} from exl3_architectures; expected ArchSpec")
            for key in (spec.hf_arch, *spec.aliases):
                if key in out and out[key] != spec:
                    raise RegistryError(
                        f"architecture {key!r} is declared by two plugins, {owner[key]!r} and {plugin!r}; "
                        f"block one with EXL3_DISABLE_PLUGINS"
                    )
                out[key] = spec
                owner[key] = plugin
        return out

    def arch(self, hf_arch: str, hf_config: dict | None = None, model_dir: Path | None = None) -> ArchSpec:
        """The ArchSpec for an HF architecture string, asking resolve hooks when no name matches."""
        archs = self.architectures()
        if hf_arch in archs:
            return archs[hf_arch]
        if hf_config is not None:
            claimed = self.pm.hook.exl3_resolve_architecture(hf_config=hf_config, model_dir=model_dir)
            if claimed is not None:
                return claimed
        installed = ", ".join(sorted(archs)) or "(none)"
        msg = f"unsupported architecture {hf_arch!r}; installed architectures: {installed}"
        dist = known_providers().get(hf_arch)
        if dist:
            msg += f"\n{hf_arch!r} is provided by the distribution {dist!r}: pip install {dist}"
        raise UnknownArchitecture(msg + self._errors_text())

    def arch_for_gguf(self, gguf_arch: str) -> ArchSpec:
        """The ArchSpec that imports llama.cpp files with ``general.architecture == gguf_arch``."""
        found = [s for _, s in self._collect("exl3_architectures") if gguf_arch in s.gguf_arch]
        if found:
            return found[0]
        supported = sorted({g for _, s in self._collect("exl3_architectures") for g in s.gguf_arch})
        raise UnknownArchitecture(
            f"GGUF architecture {gguf_arch!r} is not supported; supported GGUF architectures: "
            f"{', '.join(supported) or '(none)'}" + self._errors_text()
        )

    # -- other kinds ------------------------------------------------------------------------
    def _named(self, hook: str, cls: type[T], key: Callable[[T], Any]) -> dict[Any, T]:
        out: dict[Any, T] = {}
        for plugin, spec in self._collect(hook):
            if not isinstance(spec, cls):
                raise RegistryError(f"plugin {plugin!r} returned {spec!r} from {hook}; expected {cls.__name__}")
            k = key(spec)
            if k in out and out[k] != spec:
                raise RegistryError(f"{cls.__name__} {k!r} is declared twice (second by plugin {plugin!r})")
            out[k] = spec
        return out

    def attention_backend_specs(self) -> dict[str, AttentionBackendSpec]:
        return self._named("exl3_attention_backends", AttentionBackendSpec, lambda s: s.name)

    def cache_layer_specs(self) -> dict[tuple[str, str], CacheLayerSpec]:
        return self._named("exl3_cache_layer_types", CacheLayerSpec, lambda s: (s.kind, s.variant))

    def sampler_specs(self) -> dict[str, SamplerSpec]:
        return self._named("exl3_samplers", SamplerSpec, lambda s: s.name)

    def filter_specs(self) -> dict[str, FilterSpec]:
        return self._named("exl3_filters", FilterSpec, lambda s: s.name)

    def cache_layer(self, kind: str, variant: str) -> type:
        specs = self.cache_layer_specs()
        if (kind, variant) not in specs:
            have = sorted(v for k, v in specs if k == kind)
            raise RegistryError(
                f"no cache layer for kind {kind!r} variant {variant!r}; variants for {kind!r}: "
                f"{', '.join(have) or '(none)'}" + self._errors_text()
            )
        return self.resolve(specs[(kind, variant)].impl, what="cache layer")

    def sampler(self, name: str) -> Any:
        specs = self.sampler_specs()
        if name not in specs:
            raise RegistryError(f"unknown sampler {name!r}; registered: {', '.join(sorted(specs))}" + self._errors_text())
        return self.resolve(specs[name].impl, what="sampler")

    def filter(self, name: str) -> Any:
        specs = self.filter_specs()
        if name not in specs:
            raise RegistryError(f"unknown filter {name!r}; registered: {', '.join(sorted(specs)) or '(none)'}"
                                + self._errors_text())
        spec = specs[name]
        if miss := missing_requires(spec.requires):
            raise RegistryError(f"filter {name!r} needs module(s) {', '.join(miss)} which are not installed "
                                f"(pip install {' '.join(miss)})")
        return self.resolve(spec.impl, what="filter")

    # -- lazy references --------------------------------------------------------------------
    def resolve(self, ref: str, *, what: str = "object") -> Any:
        return resolve_ref(ref, what=what)
