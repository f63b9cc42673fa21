"""OpenAI-compatible HTTP serving (``exl3 serve``) on FastAPI and uvicorn.

* :mod:`exl3_core.server.openai`: the routes on the continuous-batching generator
  (:class:`OpenAIApp`, whose ``asgi()`` is the FastAPI application; :class:`ServerOptions`);
* :mod:`exl3_core.server.schemas`: pydantic models of the OpenAI request and response shapes;
* :mod:`exl3_core.server.asgi`: API-key middleware, Server-Sent Events, body limit;
* :mod:`exl3_core.server.metrics`: the Prometheus registry behind ``/metrics``;
* :mod:`exl3_core.server.runner`: uvicorn in the foreground or on a thread (:class:`BackgroundServer`);
* :mod:`exl3_core.server.cli`: the ``exl3 serve`` command.

Names resolve lazily so that ``exl3 --help`` does not import torch or FastAPI through this package.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "OpenAIApp": "exl3_core.server.openai", "ServerOptions": "exl3_core.server.openai",
    "APIError": "exl3_core.server.errors", "BackgroundServer": "exl3_core.server.runner",
    "serve": "exl3_core.server.cli",
}

__all__ = ["APIError", "BackgroundServer", "OpenAIApp", "ServerOptions", "serve"]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'exl3_core.server' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
