"""Lazy access to the optional compiled extension ``exl3_core._C``.

The extension registers its ops under ``torch.ops.exl3``. Nothing here imports it at module
import time; callers ask ``has_op(name)`` and fall back to the torch reference otherwise.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util

import torch


@functools.cache
def load() -> bool:
    """Import the extension once; True when it loaded. Failures are remembered, not raised."""
    from exl3_core import settings

    if settings.get().disable_ext:
        return False
    try:
        importlib.import_module("exl3_core._C")
    except ImportError as e:
        # The sources only register torch ops (no PyInit__C), so Python's import refuses the .so;
        # load it as a plain torch op library instead.
        spec = importlib.util.find_spec("exl3_core._C")
        if spec is None or spec.origin is None:
            load_error.append(str(e))
            return False
        try:
            torch.ops.load_library(spec.origin)
        except (OSError, RuntimeError) as e2:
            load_error.append(f"{e}; torch.ops.load_library: {e2}")
            return False
    return True


load_error: list[str] = []


def has_op(name: str) -> bool:
    """True when ``torch.ops.exl3.<name>`` exists (extension built with that op)."""
    return load() and hasattr(torch.ops.exl3, name)


def op(name: str):
    """The compiled op ``torch.ops.exl3.<name>``; call ``has_op`` first."""
    return getattr(torch.ops.exl3, name)
