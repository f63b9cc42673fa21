"""Constrained generation filters (llguidance, formatron) for exl3.

``LLGuidanceFilter`` and ``FormatronFilter`` are imported on first access, so importing this
package (as the plugin loader does) never imports either engine.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["FormatronFilter", "LLGuidanceFilter"]

_LAZY = {"LLGuidanceFilter": "exl3_filters.llg", "FormatronFilter": "exl3_filters.formatron_filter"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'exl3_filters' has no attribute {name!r}")
