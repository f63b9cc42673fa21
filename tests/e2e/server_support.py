"""Shared pieces of the ``exl3 serve`` tests: toy apps, bounded HTTP clients over loopback, raw
socket clients that disconnect with FIN or RST.

Every client here talks to 127.0.0.1 only, with a socket timeout, and every wait loop is bounded
in time."""
from __future__ import annotations

import http.client
import json
import socket
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from exl3_core.cache import Cache
from exl3_core.generator import Generator
from exl3_core.generator.toy import ByteTokenizer, ToyModel
from exl3_core.plugins import load_plugins
from exl3_core.server.openai import OpenAIApp, ServerOptions
from exl3_core.server.runner import BackgroundServer

HOST = "127.0.0.1"  # loopback only
VOCAB = 264


class SpyTokenizer(ByteTokenizer):
    """The toy byte tokenizer, recording the longest text it was asked to encode."""

    def __init__(self, vocab_size: int = VOCAB) -> None:
        super().__init__(vocab_size)
        self.longest = 0

    def encode(self, text: str, add_bos: bool | None = None, encode_special_tokens: bool = True) -> torch.Tensor:
        self.longest = max(self.longest, len(text))
        return super().encode(text, add_bos, encode_special_tokens)


def toy_app(*, plugins: Any = None, max_batch: int = 16, cache_tokens: int = 8192, **options: Any) -> OpenAIApp:
    """The toy decoder and byte tokenizer behind an :class:`OpenAIApp` (built-in plugins only,
    so no filter plugin unless ``plugins`` says otherwise)."""
    plugins = plugins if plugins is not None else load_plugins(autoload=False)
    model = ToyModel(vocab_size=VOCAB, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, seed=3)
    cache = Cache(model, max_num_tokens=cache_tokens, page_size=16, plugins=plugins)
    gen = Generator(model, cache, SpyTokenizer(), max_batch_size=max_batch, plugins=plugins)
    return OpenAIApp(gen, model_id="toy", plugins=plugins, options=ServerOptions(**options))


@contextmanager
def served(app: OpenAIApp) -> Iterator[int]:
    """``app`` under uvicorn on an ephemeral loopback port for the ``with`` block; yields the port."""
    srv = BackgroundServer(app, HOST, 0).start()
    try:
        yield srv.port
    finally:
        srv.stop()


# -- HTTP clients ---------------------------------------------------------------------------------
def request(port: int, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
            headers: dict[str, str] | None = None, timeout: float = 60.0) -> tuple[int, Any, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        h = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers={**h, **(headers or {})})
        resp = conn.getresponse()
        payload = resp.read()
        ctype = resp.getheader("Content-Type", "")
        return resp.status, json.loads(payload) if payload and ctype.startswith("application/json") else payload, resp
    finally:
        conn.close()


def stream(port: int, path: str, body: dict[str, Any], timeout: float = 60.0) -> tuple[list[str], http.client.HTTPResponse]:
    """POST with stream=true; returns the data payloads of the SSE events in order."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        assert resp.getheader("Content-Type", "").startswith("text/event-stream")
        events: list[str] = []
        lines: list[str] = []
        while True:
            line = resp.readline()
            if not line:
                break
            assert line.endswith(b"\n"), line
            text = line.rstrip(b"\n").decode()
            if text:
                lines.append(text)
                continue
            assert lines and all(ln.startswith("data: ") for ln in lines), lines  # one blank line per event
            events.append("\n".join(ln[6:] for ln in lines))
            lines = []
        assert not lines, f"unterminated event {lines}"
        return events, resp
    finally:
        conn.close()


def stream_text(events: list[str], chat: bool) -> str:
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    if chat:
        return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def raw_exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes, read until the server closes the connection (bounded by ``timeout``)."""
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def exchange_one(port: int, data: bytes, timeout: float = 30.0) -> tuple[int, bytes]:
    """Send raw bytes, read one response with a Content-Length (the connection may stay open)."""
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while b"\r\n\r\n" not in out:
            chunk = s.recv(65536)
            assert chunk, out
            out += chunk
        head, _, body = out.partition(b"\r\n\r\n")
        length = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length"))
        while len(body) < length:
            chunk = s.recv(65536)
            assert chunk, body
            body += chunk
        return status_of(head), body[:length]


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def assert_openai_error(status: int, body: Any, expected: int, param: str | None = None) -> dict[str, Any]:
    assert status == expected, body
    assert isinstance(body, dict), body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["type"] == ("invalid_request_error" if expected < 500 else "server_error"), err
    if param is not None:
        assert err["param"] == param, err
    return err


def health(port: int) -> dict[str, Any]:
    status, body, _ = request(port, "GET", "/health", timeout=10)
    assert status == 200
    return body


def wait_idle(port: int, seconds: float = 20.0) -> dict[str, Any]:
    """Poll /health (bounded) until no job runs or waits and no page is held."""
    deadline = time.monotonic() + seconds
    while True:
        h = health(port)
        if h["active_jobs"] == 0 and h["queued_jobs"] == 0 and h["cache"]["pages_in_use"] == 0:
            return h
        assert time.monotonic() < deadline, f"server still busy after {seconds} s: {h}"
        time.sleep(0.02)


# -- raw streaming clients ------------------------------------------------------------------------
def open_stream(port: int, body: dict[str, Any], path: str = "/v1/completions", timeout: float = 20.0) -> socket.socket:
    """A raw socket that has sent a streaming request (see :func:`await_events`)."""
    data = json.dumps({**body, "stream": True}).encode()
    s = socket.create_connection((HOST, port), timeout=timeout)
    s.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
              % (path.encode(), len(data), data))
    return s


def await_events(s: socket.socket, events: int = 2) -> None:
    """Read from ``s`` until its stream has delivered ``events`` SSE events (it is under way)."""
    got = b""
    for _ in range(10_000):  # bounded: each recv also has the socket timeout
        if got.count(b"data: ") >= events:
            return
        chunk = s.recv(65536)
        assert chunk, f"stream ended early: {got[-300:]!r}"
        got += chunk
    raise AssertionError("stream did not deliver its first events")


def hang_up(s: socket.socket, reset: bool) -> None:
    """Close ``s`` with a RST (SO_LINGER 0) or an orderly FIN."""
    if reset:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")
