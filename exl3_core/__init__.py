"""exl3: fast EXL3-quantized LLM inference. Public facade (see README)."""
from __future__ import annotations

__version__ = "0.1.0"

from exl3_core.plugins import hookimpl, load_plugins, get_plugins  # noqa: E402

__all__ = ["__version__", "get_plugins", "hookimpl", "load_plugins"]
