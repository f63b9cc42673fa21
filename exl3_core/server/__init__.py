"""OpenAI-compatible HTTP serving (``exl3 serve``).

* :mod:`exl3_core.server.http`: a standard-library HTTP/1.1 server on ``asyncio`` with JSON and
  Server-Sent Events responses (:class:`HTTPServer`, :class:`BackgroundServer`);
* :mod:`exl3_core.server.openai`: the ``/v1`` routes on the continuous-batching generator
  (:class:`OpenAIApp`, :class:`BatchingGenerator`);
* :mod:`exl3_core.server.cli`: the ``exl3 serve`` command.

Names resolve lazily so that ``exl3 --help`` does not import torch through this package.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "HTTPServer": "exl3_core.server.http", "BackgroundServer": "exl3_core.server.http",
    "HTTPError": "exl3_core.server.http", "Request": "exl3_core.server.http", "Response": "exl3_core.server.http",
    "EventStream": "exl3_core.server.http", "OpenAIApp": "exl3_core.server.openai",
    "BatchingGenerator": "exl3_core.server.openai", "serve": "exl3_core.server.cli",
}

__all__ = ["BackgroundServer", "BatchingGenerator", "EventStream", "HTTPError", "HTTPServer", "OpenAIApp",
           "Request", "Response", "serve"]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'exl3_core.server' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
