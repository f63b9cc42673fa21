"""Package attributes imported on first use (PEP 562), so that ``import exl3_core`` and the command line's option
parsing stay free of torch."""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, refs: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: each name of ``refs`` resolves its ``"module:attribute"`` reference
    on first use and is kept in the package from then on; any other name is an AttributeError."""
    def __getattr__(name: str) -> Any:
        ref = refs.get(name)
        if ref is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attr = ref.partition(":")
        value = getattr(importlib.import_module(module), attr)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


def refs_of(module: str, *names: str) -> dict[str, str]:
    """``{name: "module:name"}`` for each name."""
    return {n: f"{module}:{n}" for n in names}
