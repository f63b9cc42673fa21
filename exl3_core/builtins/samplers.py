"""Built-in plugin: the stock sampling steps and presets (filled in by the sampling module)."""
from __future__ import annotations

from exl3_core.plugins import hookimpl
from exl3_core.plugins.specs import SamplerSpec


@hookimpl
def exl3_samplers() -> list[SamplerSpec]:
    return []
