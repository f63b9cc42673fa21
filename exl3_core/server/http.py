"""A small HTTP/1.1 server on ``asyncio.start_server`` (standard library only).

Scope: what a JSON API with Server-Sent Events needs, done strictly:

* request line and headers parsed with limits (header block size, header count); obsolete line
  folding, malformed names and conflicting ``Content-Length`` headers are rejected with 400;
* bodies only through ``Content-Length`` (bounded by ``max_body_bytes``: 413 before the body is
  read); a ``Transfer-Encoding`` upload gets 411 (chunked) or 400 (anything else), since a body
  whose end is unknown cannot be skipped and the connection is closed afterwards;
* ``Expect: 100-continue`` is answered before the body is read;
* keep-alive per HTTP/1.1 (default on) and HTTP/1.0 (``Connection: keep-alive``), with an idle
  timeout;
* :class:`EventStream` responses are written as ``text/event-stream`` with ``data: ...`` framing
  (chunked transfer coding on HTTP/1.1 so the connection survives, close-delimited on 1.0) and
  end with ``data: [DONE]``;
* a client that goes away while its request is being handled (EOF or reset) cancels the handler
  task, so work done on its behalf (a generation job) is cancelled too.

Every error response, protocol-level ones included, has OpenAI's JSON shape
``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote, urlsplit

log = logging.getLogger("exl3.server")

# RFC 9110 token characters (header field names)
_TCHAR = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT"})


class HTTPError(Exception):
    """An error answered with ``status`` and OpenAI's error JSON.

    :param type: OpenAI error type (default: ``invalid_request_error`` for 4xx, ``server_error`` for 5xx).
    :param param: the request field at fault, if any.
    :param close: close the connection after answering (the request stream can't be resynchronised).
    """

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.close = close

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Request:
    method: str
    target: str
    path: str
    query: str
    version: str  # "HTTP/1.1" or "HTTP/1.0"
    headers: dict[str, str]  # lower-case names; repeated fields joined with ", "
    body: bytes = b""
    peer: Any = None

    def json(self) -> Any:
        """The body parsed as JSON (400 with the parser's message when it isn't)."""
        if not self.body:
            raise HTTPError(400, "the request body is empty; send a JSON object")
        try:
            return json.loads(self.body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise HTTPError(400, f"the request body is not valid JSON: {e}") from None


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class EventStream:
    """A Server-Sent Events response: each item of ``events`` is sent as one ``data:`` event (dicts
    as compact JSON, strings as they are); ``done`` is sent last when the stream ends normally.
    ``on_close`` is always awaited once the response is over, however it ended (client gone
    included), so resources held for an iterator that never started are released too."""

    events: AsyncIterator[Any]
    headers: dict[str, str] = field(default_factory=dict)
    done: str | None = "[DONE]"
    on_close: Callable[[], Awaitable[None]] | None = None


Handler = Callable[[Request], Awaitable["Response | EventStream"]]


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(status, json.dumps(obj, ensure_ascii=False).encode("utf-8"), headers=dict(headers or {}))


def sse_event(data: str) -> bytes:
    """One SSE event: a ``data:`` line per line of ``data`` (the spec's way to carry newlines)."""
    lines = data.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return ("".join(f"data: {ln}\n" for ln in lines) + "\n").encode("utf-8")


class HTTPServer:
    """Serves ``handler`` over HTTP/1.1.

    :param handler: ``async (Request) -> Response | EventStream``; may raise :class:`HTTPError`.
    :param host: address to bind (default loopback only).
    :param port: 0 picks a free port (see :attr:`port` after :meth:`start`).
    :param max_header_bytes: request line plus headers (431 beyond).
    :param max_body_bytes: request body (413 beyond).
    :param keepalive_timeout: seconds an idle kept-alive connection waits for its next request.
    :param body_timeout: seconds allowed for the announced body to arrive.
    """

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 8000, *,
                 max_header_bytes: int = 32 * 1024, max_headers: int = 100, max_body_bytes: int = 16 * 1024 * 1024,
                 keepalive_timeout: float = 15.0, body_timeout: float = 60.0, server_name: str = "exl3") -> None:
        self.handler = handler
        self.host = host
        self.requested_port = port
        self.max_header_bytes = max_header_bytes
        self.max_headers = max_headers
        self.max_body_bytes = max_body_bytes
        self.keepalive_timeout = keepalive_timeout
        self.body_timeout = body_timeout
        self.server_name = server_name
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            raise RuntimeError("HTTPServer: not started; await start() first")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        # the StreamReader limit bounds readuntil(): a header block past it raises LimitOverrunError
        self._server = await asyncio.start_server(self._connection, self.host, self.requested_port,
                                                  limit=self.max_header_bytes)

    async def close(self) -> None:
        """Stop accepting, then end every connection (in-flight handlers are cancelled)."""
        if self._server is not None:
            self._server.close()
        for t in list(self._conns):
            t.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    # -- one connection ---------------------------------------------------------------------------
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        peer = writer.get_extra_info("peername")
        try:
            while True:
                try:
                    req = await self._read_request(reader, writer, peer)
                except HTTPError as e:
                    await self._write_error(writer, e, "HTTP/1.1", keep_alive=False)
                    break
                if req is None:
                    break
                keep_alive = self._wants_keep_alive(req)
                work = asyncio.create_task(self._respond(req, writer, keep_alive))
                gone = asyncio.create_task(self._client_gone(reader, writer))
                try:
                    await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    gone.cancel()
                    if not work.done():  # client gone (or server closing): cancel what the request started
                        log.info("%s %s: client disconnected, request cancelled", req.method, req.path)
                        work.cancel()
                        await asyncio.gather(work, return_exceptions=True)
                if work.cancelled() or not work.result():
                    break
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        except asyncio.CancelledError:
            pass  # server shutting down
        except Exception:  # a bug here must end this connection, not go unreported
            log.exception("connection from %s failed", peer)
        finally:
            self._conns.discard(task)
            with contextlib.suppress(Exception):
                writer.close()

    @staticmethod
    async def _client_gone(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Returns once the peer has closed (EOF with nothing buffered) or reset the connection.

        Polled because asyncio streams keep a half-closed socket open and expose EOF only to a
        reader, and reading here would swallow a pipelined request."""
        while not (reader.at_eof() or writer.transport.is_closing()):
            await asyncio.sleep(0.05)

    @staticmethod
    def _wants_keep_alive(req: Request) -> bool:
        tokens = {t.strip().lower() for t in req.headers.get("connection", "").split(",")}
        if req.version == "HTTP/1.1":
            return "close" not in tokens
        return "keep-alive" in tokens

    async def _read_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            peer: Any) -> Request | None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.keepalive_timeout)
        except asyncio.IncompleteReadError as e:
            if e.partial.strip():
                raise HTTPError(400, "the request ended before its header block (missing blank line)",
                                close=True) from None
            return None  # clean close between requests
        except asyncio.LimitOverrunError:
            raise HTTPError(431, f"request line and headers exceed {self.max_header_bytes} bytes",
                            close=True) from None
        except TimeoutError:
            return None
        req = self._parse_head(head, peer)
        length = self._content_length(req)
        if length:
            if req.headers.get("expect", "").lower() == "100-continue":
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                await writer.drain()
            try:
                req.body = await asyncio.wait_for(reader.readexactly(length), self.body_timeout)
            except TimeoutError:
                raise HTTPError(408, f"the request body ({length} bytes announced) did not arrive within "
                                     f"{self.body_timeout:g} s", close=True) from None
        return req

    def _parse_head(self, head: bytes, peer: Any) -> Request:
        try:
            text = head[:-4].decode("latin-1")
        except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
            raise HTTPError(400, "undecodable request head", close=True) from None
        lines = text.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[0] or not parts[1]:
            raise HTTPError(400, f"malformed request line {lines[0][:100]!r}; expected 'METHOD TARGET HTTP/1.1'",
                            close=True)
        method, target, version = parts
        if not version.startswith("HTTP/"):
            raise HTTPError(400, f"malformed request line {lines[0][:100]!r}", close=True)
        if version not in ("HTTP/1.1", "HTTP/1.0"):
            raise HTTPError(505, f"HTTP version {version!r} is not supported; use HTTP/1.1", close=True)
        if method not in _METHODS:
            raise HTTPError(501 if set(method) <= _TCHAR else 400, f"method {method[:20]!r} is not implemented",
                            close=True)
        if len(lines) - 1 > self.max_headers:
            raise HTTPError(431, f"more than {self.max_headers} header fields", close=True)
        headers: dict[str, str] = {}
        lengths: set[str] = set()
        for ln in lines[1:]:
            if ln[:1] in (" ", "\t"):
                raise HTTPError(400, "obsolete header line folding is not accepted", close=True)
            name, sep, value = ln.partition(":")
            if not sep or not name or not set(name) <= _TCHAR:
                raise HTTPError(400, f"malformed header line {ln[:100]!r}", close=True)
            key = name.lower()
            value = value.strip(" \t")
            if key == "content-length":
                lengths.update(v.strip() for v in value.split(","))
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        if len(lengths) > 1:
            raise HTTPError(400, f"conflicting Content-Length values {sorted(lengths)}", close=True)
        if version == "HTTP/1.1" and "host" not in headers:
            raise HTTPError(400, "HTTP/1.1 requests need a Host header", close=True)
        url = urlsplit(target)
        path = unquote(url.path) if target.startswith("/") else target
        return Request(method, target, path, url.query, version, headers, peer=peer)

    def _content_length(self, req: Request) -> int:
        te = req.headers.get("transfer-encoding")
        if te is not None:
            if "chunked" in te.lower():
                raise HTTPError(411, "chunked request bodies are not accepted; send the body with a Content-Length "
                                     "header", close=True)
            raise HTTPError(400, f"Transfer-Encoding {te!r} is not supported; send a Content-Length body", close=True)
        raw = req.headers.get("content-length")
        if raw is None:
            return 0
        raw = raw.split(",")[0].strip()
        if not raw.isdigit() or not raw.isascii():
            raise HTTPError(400, f"invalid Content-Length {raw[:40]!r}", close=True)
        n = int(raw)
        if n > self.max_body_bytes:
            raise HTTPError(413, f"request body of {n} bytes exceeds the limit of {self.max_body_bytes} bytes",
                            close=True)
        return n

    # -- responses --------------------------------------------------------------------------------
    async def _respond(self, req: Request, writer: asyncio.StreamWriter, keep_alive: bool) -> bool:
        """Run the handler and write its response; returns whether the connection stays open."""
        t0 = time.perf_counter()
        status = 500
        try:
            try:
                res = await self.handler(req)
            except HTTPError as e:
                status = e.status
                await self._write_error(writer, e, req.version, keep_alive and not e.close)
                return keep_alive and not e.close
            except Exception as e:  # one failing request must not take the server down
                log.exception("%s %s failed", req.method, req.path)
                await self._write_error(writer, HTTPError(500, f"internal error: {type(e).__name__}: {e}"),
                                        req.version, keep_alive)
                return keep_alive
            if isinstance(res, EventStream):
                status = 200
                return await self._write_stream(writer, req, res, keep_alive)
            status = res.status
            await self._write(writer, req.version, res.status, res.content_type, res.body, res.headers, keep_alive,
                              head_only=req.method == "HEAD")
            return keep_alive
        finally:
            log.info("%s %s %d %.3fs", req.method, req.path, status, time.perf_counter() - t0)

    def _head(self, version: str, status: int, headers: dict[str, str]) -> bytes:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = "Unknown"
        lines = [f"{version} {status} {reason}", f"Date: {email.utils.formatdate(usegmt=True)}",
                 f"Server: {self.server_name}"] + [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _write(self, writer: asyncio.StreamWriter, version: str, status: int, content_type: str, body: bytes,
                     headers: dict[str, str], keep_alive: bool, head_only: bool = False) -> None:
        h = {"Content-Type": content_type, "Content-Length": str(len(body)), **headers}
        if not keep_alive:
            h["Connection"] = "close"
        elif version == "HTTP/1.0":
            h["Connection"] = "keep-alive"
        writer.write(self._head(version, status, h) + (b"" if head_only else body))
        await writer.drain()

    async def _write_error(self, writer: asyncio.StreamWriter, e: HTTPError, version: str, keep_alive: bool) -> None:
        body = json.dumps(e.body()).encode("utf-8")
        with contextlib.suppress(ConnectionError):
            await self._write(writer, version, e.status, "application/json", body, e.headers, keep_alive)

    async def _write_stream(self, writer: asyncio.StreamWriter, req: Request, res: EventStream,
                            keep_alive: bool) -> bool:
        chunked = req.version == "HTTP/1.1"
        keep_alive = keep_alive and chunked  # an HTTP/1.0 stream ends when the connection does
        h = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache", **res.headers}
        if chunked:
            h["Transfer-Encoding"] = "chunked"
        if not keep_alive:
            h["Connection"] = "close"

        def frame(data: bytes) -> bytes:
            return b"%x\r\n%s\r\n" % (len(data), data) if chunked else data

        try:
            writer.write(self._head(req.version, 200, h))
            async for ev in res.events:
                data = ev if isinstance(ev, str) else json.dumps(ev, ensure_ascii=False)
                writer.write(frame(sse_event(data)))
                await writer.drain()  # raises once the client is gone; backpressure otherwise
            if res.done is not None:
                writer.write(frame(sse_event(res.done)))
            if chunked:
                writer.write(b"0\r\n\r\n")
            await writer.drain()
            return keep_alive
        except ConnectionError:
            log.info("%s %s: client disconnected during the stream", req.method, req.path)
            return False
        finally:
            aclose = getattr(res.events, "aclose", None)
            if aclose is not None:
                await aclose()
            if res.on_close is not None:
                await res.on_close()


class BackgroundServer:
    """Runs an :class:`HTTPServer` (and whatever ``on_stop`` cleans up) on its own event loop in a
    daemon thread; for tests and for embedding in synchronous programs.

    ``make_handler`` is called inside the server's loop (so asyncio objects bind to it) and returns
    ``(handler, on_stop)``.
    """

    def __init__(self, make_handler: Callable[[], tuple[Handler, Callable[[], Awaitable[None]] | None]],
                 host: str = "127.0.0.1", port: int = 0, **server_kwargs: Any) -> None:
        self._make = make_handler
        self._host, self._port, self._kw = host, port, server_kwargs
        self.loop = asyncio.new_event_loop()
        self.server: HTTPServer | None = None
        self._on_stop: Callable[[], Awaitable[None]] | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="exl3-http", daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def boot() -> None:
            handler, self._on_stop = self._make()
            self.server = HTTPServer(handler, self._host, self._port, **self._kw)
            await self.server.start()

        try:
            self.loop.run_until_complete(boot())
        except BaseException as e:  # noqa: BLE001 - reported to start()'s caller
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()
        self.loop.close()

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"server did not start within {timeout} s")
        if self._error is not None:
            raise self._error
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    def call(self, coro: Awaitable[Any], timeout: float = 30.0) -> Any:
        """Run ``coro`` on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def stop(self, timeout: float = 30.0) -> None:
        if not self._thread.is_alive():
            return

        async def shutdown() -> None:
            if self.server is not None:
                await self.server.close()
            if self._on_stop is not None:
                await self._on_stop()

        try:
            self.call(shutdown(), timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:  # noqa: PYI034 - typing.Self needs 3.11+ typing_extensions here
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
