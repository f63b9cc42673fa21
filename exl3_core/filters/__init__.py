"""Constrained generation: the Filter contract (concrete filters live in plugin distributions)."""
from __future__ import annotations

from exl3_core.filters.base import Filter, unpack_bitmask

__all__ = ["Filter", "unpack_bitmask"]
