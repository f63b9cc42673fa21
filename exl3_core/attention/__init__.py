"""Attention: the static spec, the backend protocol and the dispatcher."""
from __future__ import annotations

from exl3_core.attention.backend import AttentionBackend
from exl3_core.attention.dispatch import Dispatcher, NoAttentionBackend, get_dispatcher, select
from exl3_core.attention.spec import AttnArgs, AttnSpec, device_cc

__all__ = ["AttentionBackend", "AttnArgs", "AttnSpec", "Dispatcher", "NoAttentionBackend", "device_cc",
           "get_dispatcher", "select"]
