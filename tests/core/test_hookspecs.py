"""The plugin API is documented: every hook has a docstring naming what it returns."""
from __future__ import annotations

import inspect

from exl3_core.plugins import hookspecs, specs


def _hooks() -> list[tuple[str, object]]:
    return [(n, f) for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("exl3_")]


def test_there_are_hooks() -> None:
    names = {n for n, _ in _hooks()}
    assert {"exl3_architectures", "exl3_attention_backends", "exl3_cache_layer_types", "exl3_samplers",
            "exl3_filters", "exl3_resolve_architecture"} <= names


def test_every_hookspec_is_documented() -> None:
    for name, fn in _hooks():
        doc = inspect.getdoc(fn) or ""
        assert len(doc.split()) >= 12, f"hookspec {name} needs a real docstring (who calls it, when, what it returns)"
        assert ":return:" in doc, f"hookspec {name} must document its return value with ':return:'"


def test_every_hook_is_marked_as_spec() -> None:
    for name, fn in _hooks():
        assert hasattr(fn, "exl3_spec"), f"{name} is in hookspecs.py but not decorated with @hookspec"


def test_every_spec_class_is_documented_and_frozen() -> None:
    import dataclasses

    for cls in specs.ALL_SPECS:
        assert (cls.__doc__ or "").strip(), f"{cls.__name__} needs a docstring"
        assert cls.__dataclass_params__.frozen, f"{cls.__name__} must be frozen"  # type: ignore[attr-defined]
        assert all(f.kw_only for f in dataclasses.fields(cls))
