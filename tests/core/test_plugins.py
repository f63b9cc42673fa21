"""Plugin manager, registry and entry-point discovery (incl. the installed dummy plugins)."""
from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from exl3_core import hookimpl
from exl3_core.plugins import (
    ArchSpec,
    AttentionBackendSpec,
    PluginLoadError,
    RegistryError,
    UnknownArchitecture,
    load_plugins,
)
from exl3_core.plugins.specs import SamplerSpec


def _module(name: str, **hooks: object) -> types.ModuleType:
    m = types.ModuleType(name)
    for k, v in hooks.items():
        setattr(m, k, v)
    return m


def test_builtins_are_plugins(plugins) -> None:
    assert "torch" in plugins.attention_backend_specs()
    assert ("kv", "fp16") in plugins.cache_layer_specs()
    assert ("mla", "fp16") in plugins.cache_layer_specs()
    assert all(i.builtin for i in plugins.infos.values())


def test_extra_plugin_and_lazy_resolution() -> None:
    @hookimpl
    def exl3_architectures() -> list[ArchSpec]:
        return [ArchSpec(hf_arch="ZedForCausalLM", model="collections:OrderedDict", aliases=("ZedLM",))]

    p = load_plugins(autoload=False, extra=[_module("zed_plugin", exl3_architectures=exl3_architectures)])
    spec = p.arch("ZedLM")
    assert spec.hf_arch == "ZedForCausalLM"
    import collections

    assert p.resolve(spec.model) is collections.OrderedDict
    with pytest.raises(RegistryError, match="no attribute 'Nope'"):
        p.resolve("collections:Nope")
    with pytest.raises(RegistryError, match="cannot import module 'no_such_mod_xyz'"):
        p.resolve("no_such_mod_xyz:X")


def test_duplicate_architecture_names_both_plugins() -> None:
    def mk(name: str) -> types.ModuleType:
        @hookimpl
        def exl3_architectures() -> list[ArchSpec]:
            return [ArchSpec(hf_arch="DupForCausalLM", model=f"{name}:M")]

        return _module(name, exl3_architectures=exl3_architectures)

    p = load_plugins(autoload=False, extra=[mk("plug_one"), mk("plug_two")])
    with pytest.raises(RegistryError, match="plug_one.*plug_two|plug_two.*plug_one"):
        p.architectures()


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="module:attribute"):
        ArchSpec(hf_arch="X", model="no_colon_here")
    with pytest.raises(ValueError, match="'step' or 'preset'"):
        SamplerSpec(name="x", impl="a:b", kind="other")  # type: ignore[arg-type]


def test_api_version_check() -> None:
    bad = _module("future_plugin", EXL3_PLUGIN_API=(2, 0))
    with pytest.raises(PluginLoadError, match="plugin API 2.0"):
        load_plugins(autoload=False, extra=[bad])
    newer_minor = _module("newer_plugin", EXL3_PLUGIN_API=(1, 99))
    with pytest.raises(PluginLoadError, match="1.99"):
        load_plugins(autoload=False, extra=[newer_minor])


def test_hook_error_recorded_not_raised() -> None:
    @hookimpl
    def exl3_attention_backends() -> list[AttentionBackendSpec]:
        raise RuntimeError("boom in hook")

    p = load_plugins(autoload=False, extra=[_module("explodes", exl3_attention_backends=exl3_attention_backends)])
    assert "torch" in p.attention_backend_specs()
    assert any("boom in hook" in str(e) for e in p.load_errors.values())


def test_unknown_architecture_lists_installed_and_provider(plugins) -> None:
    with pytest.raises(UnknownArchitecture) as ei:
        plugins.arch("MistralForCausalLM")
    msg = str(ei.value)
    assert "'MistralForCausalLM'" in msg and "pip install exl3-arch-llama" in msg
    with pytest.raises(UnknownArchitecture, match="'TotallyNewForCausalLM'"):
        plugins.arch("TotallyNewForCausalLM")


def test_cache_layer_unknown_variant_lists_variants(plugins) -> None:
    with pytest.raises(RegistryError, match="variants for 'kv': fp16"):
        plugins.cache_layer("kv", "q3")


# -- real entry points: the dummy and the broken distributions in tests/plugins/ --------------

def test_dummy_entry_point_discovered(clean_settings) -> None:
    p = load_plugins()
    assert "DummyForCausalLM" in p.architectures()
    assert p.infos["dummy"].distribution == "exl3-dummy-arch"
    cls = p.resolve(p.arch("DummyForCausalLM").model)
    assert cls.__name__ == "DummyModel"


def test_dummy_blocked_by_env(clean_settings) -> None:
    from exl3_core import settings

    clean_settings.setenv("EXL3_DISABLE_PLUGINS", "dummy")
    settings.reload()
    p = load_plugins()
    assert "DummyForCausalLM" not in p.architectures()
    assert p.infos["dummy"].blocked
    assert "LlamaForCausalLM" in p.architectures()  # others unaffected


def test_allow_list_by_env(clean_settings) -> None:
    from exl3_core import settings

    clean_settings.setenv("EXL3_PLUGINS", "dummy")
    settings.reload()
    p = load_plugins()
    assert set(p.architectures()) == {"DummyForCausalLM"}
    assert p.infos["llama"].blocked


def test_broken_plugin_does_not_stop_others(clean_settings, broken_plugin) -> None:
    p = load_plugins()
    assert "broken" in p.load_errors
    assert "DummyForCausalLM" in p.architectures()
    with pytest.raises(UnknownArchitecture) as ei:
        p.arch("BrokenForCausalLM")
    assert "broken" in str(ei.value) and "exl3_nonexistent_dependency_for_tests" in str(ei.value)


def test_cli_plugins_lists_dummy_and_error(broken_plugin: dict[str, str]) -> None:
    out = subprocess.run([sys.executable, "-m", "exl3_core", "plugins", "--json"], capture_output=True,
                         text=True, check=True, env={**broken_plugin, "EXL3_LOG_LEVEL": "ERROR"})
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["dummy"]["provides"]["architectures"] == ["DummyForCausalLM"]
    assert rows["dummy"]["distribution"] == "exl3-dummy-arch"
    assert "exl3_nonexistent_dependency_for_tests" in rows["broken"]["error"]
    assert rows["exl3_core.builtins.attn_torch"]["builtin"]
    text = subprocess.run([sys.executable, "-m", "exl3_core", "plugins"], capture_output=True, text=True,
                          check=True, env=broken_plugin).stdout
    assert "DummyForCausalLM" in text and "LOAD ERROR" in text


def test_cli_plugins_respects_block_list() -> None:
    env = {**__import__("os").environ, "EXL3_DISABLE_PLUGINS": "dummy"}
    out = subprocess.run([sys.executable, "-m", "exl3_core", "plugins", "--json"], capture_output=True,
                         text=True, check=True, env=env)
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["dummy"]["blocked"] and not rows["dummy"]["provides"]
