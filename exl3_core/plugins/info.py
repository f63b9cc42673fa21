"""What is known about each loaded plugin (``exl3 plugins`` shows it)."""
from __future__ import annotations

from dataclasses import dataclass, field


class PluginLoadError(RuntimeError):
    """A plugin could not be loaded (kept in :attr:`PluginInfo.error`, raised only on demand)."""


@dataclass
class PluginInfo:
    """What ``exl3 plugins`` shows about one plugin."""

    name: str
    module: str
    distribution: str | None = None
    version: str | None = None
    builtin: bool = False
    error: BaseException | None = None
    blocked: bool = False
    hooks: list[str] = field(default_factory=list)
