"""exl3 plugin: constrained-generation filters (llguidance, formatron)."""
from __future__ import annotations

from exl3_core.plugins import hookimpl
from exl3_core.plugins.specs import FilterSpec

EXL3_PLUGIN_API = (1, 0)


@hookimpl
def exl3_filters() -> list[FilterSpec]:
    return []
