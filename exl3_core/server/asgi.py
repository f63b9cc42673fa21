"""ASGI pieces under the routes: API-key check, Server-Sent Events with disconnect detection,
request bodies with a size limit, and uvicorn's HTTP/1.1 protocol answering malformed requests in
OpenAI's error shape."""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
from collections.abc import AsyncGenerator, Callable

import h11
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from exl3_core.server.errors import APIError


class APIKeyMiddleware:
    """Every ``/v1`` request must carry ``Authorization: Bearer KEY`` (401 otherwise, before the
    body is read); ``/health`` and ``/metrics`` stay open for probes and scrapers."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if given is None:
            err = APIError(401, "You didn't provide an API key. Send it in the Authorization header as "
                                "'Authorization: Bearer KEY' (the key given to exl3 serve --api-key or EXL3_API_KEY).",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await err.send(send)
            return
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
            err = APIError(401, "Incorrect API key provided in the Authorization header.", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
            await err.send(send)
            return
        await self.app(scope, receive, send)


def host_name(header: str) -> str:
    """The host of a ``Host`` header value, lower-cased, without port, brackets or trailing dot."""
    h = header.strip().lower()
    if h.startswith("["):  # [v6]:port
        return h[1:h.find("]")] if "]" in h else h
    if h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


def _is_loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _same_address(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a == b


def host_allowed(name: str, local: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether a request naming host ``name`` may be served on the local address ``local``.

    Allowed: the address the connection arrived on, loopback names on a loopback connection, and
    ``allowed`` (exact names, ``.example.com`` for a domain and its subdomains, ``*`` for any)."""
    if "*" in allowed or name in allowed:
        return True
    if any(a.startswith(".") and (name.endswith(a) or name == a[1:]) for a in allowed):
        return True
    if local is None:
        return False
    if _same_address(name, local):
        return True
    return _is_loopback_name(local) and _is_loopback_name(name)


class HostCheckMiddleware:
    """Refuses (400) a request whose ``Host`` header names neither the address it arrived on nor an
    allowed name: a web page that resolves its own domain to 127.0.0.1 (DNS rebinding) reaches a
    loopback server, but its requests carry its own domain as ``Host``. A request without a
    ``Host`` header (HTTP/1.0) comes from no browser and passes."""

    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...] = ()) -> None:
        self.app = app
        self.allowed = tuple(a.strip().lower().rstrip(".") for a in allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = next((v for k, v in scope["headers"] if k == b"host"), None)
        if raw is not None:
            name = host_name(raw.decode("latin-1"))
            server = scope.get("server")
            local = str(server[0]) if server else None
            if not host_allowed(name, local, self.allowed):
                shown = raw.decode("latin-1")[:100]
                err = APIError(400, f"the Host header {shown!r} does not name this server's address; if you reach the "
                                    f"server under that name, allow it: exl3 serve --allowed-host {name or '<name>'}",
                               code="invalid_host", param=None)
                await err.send(send)
                return
        await self.app(scope, receive, send)


#: media type of every request body the API takes
JSON_MEDIA_TYPE = "application/json"


def require_json(content_type: str | None) -> None:
    """415 unless ``content_type`` is ``application/json`` (UTF-8): a browser sends a cross-site
    ``text/plain`` or form body without asking the server first (no CORS preflight), a JSON body never."""
    media, _, params = (content_type or "").partition(";")
    charset = next((v.strip().strip('"').lower() for k, _, v in (p.partition("=") for p in params.split(";"))
                    if k.strip().lower() == "charset"), None)
    if media.strip().lower() != JSON_MEDIA_TYPE or charset not in (None, "utf-8", "utf8"):
        shown = "no Content-Type" if content_type is None else f"Content-Type {content_type[:100]!r}"
        raise APIError(415, f"the request body must be JSON sent with 'Content-Type: application/json', got {shown} "
                            f"(curl: -H 'Content-Type: application/json')", code="unsupported_media_type")


async def read_body(request: Request, limit: int, timeout: float | None) -> bytes:
    """The request body, refused with 413 once it passes ``limit`` bytes (from Content-Length
    before anything is read) and with 408 when it does not arrive within ``timeout`` seconds."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes "
                            f"(exl3 serve --max-request-bytes)", code="request_too_large")

    async def collect() -> bytes:
        parts: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes (exl3 serve --max-request-bytes)",
                               code="request_too_large")
            parts.append(chunk)
        return b"".join(parts)

    task = asyncio.ensure_future(collect())
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    if not done:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="timeout")
    try:
        return task.result()
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the request body") from None


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (call only after the request body was read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def sse_event(data: str) -> bytes:
    """One SSE event: a ``data:`` line per line of ``data`` (the spec's way to carry newlines)."""
    lines = data.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return ("".join(f"data: {ln}\n" for ln in lines) + "\n").encode("utf-8")


class EventStreamResponse(Response):
    """A ``text/event-stream`` response: each string of ``events`` is sent as one ``data:`` event,
    then ``data: [DONE]``. While it streams, the client's disconnect is watched; when the client
    goes, the stream is cancelled at once. ``on_close`` runs exactly once however the response
    ended, so what the request holds is released even if ``events`` never started."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None], *, headers: dict[str, str] | None = None,
                 on_close: Callable[[], object] | None = None) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for data in self.events:
            await send({"type": "http.response.body", "body": sse_event(data), "more_body": True})
        await send({"type": "http.response.body", "body": sse_event("[DONE]"), "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (pump, watch):
                t.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)
            await self.events.aclose()
            if self.on_close is not None:
                self.on_close()
        if pump.done() and not pump.cancelled() and pump.exception() is not None:
            raise pump.exception()  # type: ignore[misc]


class OpenAIH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering a request it cannot parse with OpenAI's error JSON
    instead of plain text (the connection is closed afterwards, as uvicorn does)."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(APIError(400, f"malformed HTTP request: {msg}").body()).encode("utf-8")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
