"""Lazy access to the optional compiled extension ``exl3_core._C``.

The extension registers its ops under ``torch.ops.exl3``. Nothing here imports it at module
import time; callers ask ``has_op(name)`` and fall back to the torch reference otherwise.
"""
from __future__ import annotations

import functools
import importlib

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
        load_error.append(str(e))
        return False
    return True


load_error: list[str] = []


def has_op(name: str) -> bool:
    """True when ``torch.ops.exl3.<name>`` exists (extension built with that op)."""
    return load() and hasattr(torch.ops.exl3, name)


def op(name: str):  # noqa: ANN201 - returns a torch OpOverloadPacket
    """The compiled op ``torch.ops.exl3.<name>``; call ``has_op`` first."""
    return getattr(torch.ops.exl3, name)
