"""Errors answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

import json

from starlette.responses import JSONResponse
from starlette.types import Send


class APIError(Exception):
    """An error answered with ``status`` and OpenAI's error JSON.

    :param type: OpenAI error type (default: ``invalid_request_error`` for 4xx, ``server_error`` for 5xx).
    :param param: the request field at fault, if any.
    :param code: a machine-readable code (``context_length_exceeded``, ``invalid_api_key``, ...).
    """

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @classmethod
    def bad(cls, param: str, message: str) -> APIError:
        """400 naming the request field at fault."""
        return cls(400, message, param=param)

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    async def send(self, send: Send) -> None:
        """Answer on a raw ASGI ``send`` (for middleware that runs before routing)."""
        body = json.dumps(self.body()).encode("utf-8")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
