"""exl3 plugin: constrained-generation filters (llguidance, formatron)."""

from __future__ import annotations

from exl3_core.plugins import hookimpl
from exl3_core.plugins.specs import FilterSpec

EXL3_PLUGIN_API = (1, 0)


@hookimpl
def exl3_filters() -> list[FilterSpec]:
    # impl strings are resolved lazily: neither engine is imported until a filter is created
    return [
        FilterSpec(name="llguidance", impl="exl3_filters.llg:LLGuidanceFilter", requires=("llguidance",)),
        FilterSpec(
            name="formatron", impl="exl3_filters.formatron_filter:FormatronFilter", requires=("formatron",)
        ),
    ]
