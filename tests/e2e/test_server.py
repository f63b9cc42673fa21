"""`exl3 serve`'s HTTP server and OpenAI routes, in-process on 127.0.0.1 (ephemeral ports only).

Protocol-level behaviour runs on the toy model and byte tokenizer (fast); the answers themselves
are checked on the real default model (SmolLM2-135M, imported once per session)."""
from __future__ import annotations

import argparse
import http.client
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exl3_core.cache import Cache
from exl3_core.generator import Generator
from exl3_core.generator.toy import ByteTokenizer, ToyModel
from exl3_core.plugins import load_plugins
from exl3_core.server.http import BackgroundServer
from exl3_core.server.openai import OpenAIApp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from smol_gguf import imported_model  # shared once-per-session import

HOST = "127.0.0.1"  # loopback only
MAX_BODY = 64 * 1024
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


# -- clients --------------------------------------------------------------------------------------
def request(port: int, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
            timeout: float = 120.0) -> tuple[int, Any, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        payload = resp.read()
        return resp.status, json.loads(payload) if payload else None, resp
    finally:
        conn.close()


def stream(port: int, path: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[list[str], http.client.HTTPResponse]:
    """POST with stream=true; returns the data payloads of the SSE events in order."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        assert resp.getheader("Content-Type", "").startswith("text/event-stream")
        events, lines = [], []
        while True:
            line = resp.readline()
            if not line:
                break
            assert line.endswith(b"\n"), line
            line = line.rstrip(b"\n").decode()
            if line:
                lines.append(line)
                continue
            assert lines and all(ln.startswith("data: ") for ln in lines), lines  # one blank line per event
            events.append("\n".join(ln[6:] for ln in lines))
            lines = []
        assert not lines, f"unterminated event {lines}"
        return events, resp
    finally:
        conn.close()


def raw_exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes, read until the server closes the connection."""
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def assert_openai_error(status: int, body: Any, expected: int, param: str | None = None) -> dict[str, Any]:
    assert status == expected, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["type"] == ("invalid_request_error" if expected < 500 else "server_error")
    if param is not None:
        assert err["param"] == param, err
    return err


def health(port: int) -> dict[str, Any]:
    status, body, _ = request(port, "GET", "/health")
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
        time.sleep(0.05)


# -- servers --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def toy() -> Iterator[tuple[int, OpenAIApp]]:
    plugins = load_plugins(autoload=False)  # built-ins only: no filter plugin
    model = ToyModel(vocab_size=264, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, seed=3)
    box: dict[str, OpenAIApp] = {}

    def make() -> Any:
        cache = Cache(model, max_num_tokens=8192, page_size=16, plugins=plugins)
        gen = Generator(model, cache, ByteTokenizer(model.vocab_size), max_batch_size=8, plugins=plugins)
        box["app"] = app = OpenAIApp(gen, model_id="toy", plugins=plugins)
        return app, app.close

    srv = BackgroundServer(make, HOST, 0, max_body_bytes=MAX_BODY, max_header_bytes=8192).start()
    try:
        yield srv.port, box["app"]
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def real() -> Iterator[tuple[int, OpenAIApp]]:
    from exl3_core.server.cli import build_app

    path = imported_model()
    args = argparse.Namespace(model=path, device="cpu", cache_tokens=2048, attention=None, max_batch=4, model_name=None)
    box: dict[str, OpenAIApp] = {"app": build_app(args)}
    srv = BackgroundServer(lambda: (box["app"], box["app"].close), HOST, 0).start()
    try:
        yield srv.port, box["app"]
    finally:
        srv.stop()


# -- protocol (toy model) -------------------------------------------------------------------------
def test_models_health_and_unknown_routes(toy: tuple[int, OpenAIApp]) -> None:
    port, _ = toy
    status, body, _ = request(port, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["toy"] and body["object"] == "list"
    assert health(port)["status"] == "ok"
    status, body, _ = request(port, "GET", "/v1/models/toy")
    assert status == 200 and body["id"] == "toy"
    assert_openai_error(*request(port, "GET", "/v1/models/other")[:2], 404, "model")
    assert_openai_error(*request(port, "POST", "/v1/nope", {"x": 1})[:2], 404)
    status, body, resp = request(port, "GET", "/v1/chat/completions")
    assert_openai_error(status, body, 405)
    assert resp.getheader("Allow") == "POST"


def test_malformed_requests_are_openai_errors(toy: tuple[int, OpenAIApp]) -> None:
    port, _ = toy
    err = assert_openai_error(*request(port, "POST", "/v1/chat/completions", raw=b'{"messages": [')[:2], 400)
    assert "JSON" in err["message"]
    assert_openai_error(*request(port, "POST", "/v1/chat/completions", raw=b"[1, 2]")[:2], 400)
    assert_openai_error(*request(port, "POST", "/v1/chat/completions", {"messages": []})[:2], 400, "messages")
    assert_openai_error(*request(port, "POST", "/v1/completions", {"prompt": ["a", "b"]})[:2], 400, "prompt")
    assert_openai_error(*request(port, "POST", "/v1/completions", {"prompt": "x" * 9000})[:2], 400, "prompt")
    # garbage on the wire: 400 and the connection is closed
    assert status_of(raw_exchange(port, b"NOT HTTP\r\n\r\n")) == 400
    assert status_of(raw_exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\n bad fold\r\n\r\n")) == 400
    assert status_of(raw_exchange(port, b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n")) == 505


def test_body_and_header_limits(toy: tuple[int, OpenAIApp]) -> None:
    port, _ = toy
    # refused from the headers alone: the announced body is never sent
    out = raw_exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1))
    assert status_of(out) == 413 and b"Connection: close" in out
    assert json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"
    status, body, _ = request(port, "POST", "/v1/completions", raw=b"x" * (MAX_BODY + 1))
    assert_openai_error(status, body, 413)
    out = raw_exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b"2\r\n{}\r\n0\r\n\r\n")
    assert status_of(out) == 411
    out = raw_exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n")
    assert status_of(out) == 431
    out = raw_exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}")
    assert status_of(out) == 400
    assert health(port)["status"] == "ok"  # still serving


def test_invalid_sampler_values_are_400_and_server_keeps_serving(toy: tuple[int, OpenAIApp]) -> None:
    port, _ = toy
    base = {"prompt": "hello", "max_tokens": 4}
    for field, value in [("temperature", -1), ("top_p", 2), ("top_p", 0), ("min_p", 1.5), ("top_k", -3),
                         ("presence_penalty", 3), ("frequency_penalty", "x"), ("max_tokens", 0), ("seed", 1.5),
                         ("n", 2), ("logprobs", True), ("stop", [1]), ("logit_bias", {"a": 1})]:
        status, body, _ = request(port, "POST", "/v1/completions", {**base, field: value})
        err = assert_openai_error(status, body, 400, field)
        assert field in err["message"], err
    err = assert_openai_error(*request(port, "POST", "/v1/completions", {**base, "logit_bias": {"99999": 1}})[:2], 400)
    assert "99999" in err["message"]
    err = assert_openai_error(*request(port, "POST", "/v1/chat/completions", {
        "messages": CAPITAL, "response_format": {"type": "json_object"}})[:2], 400, "response_format")
    assert "exl3-filters" in err["message"]
    status, body, _ = request(port, "POST", "/v1/completions", {**base, "temperature": 0.7, "top_p": 0.9, "seed": 1})
    assert status == 200 and body["usage"]["prompt_tokens"] == len(b"hello")
    assert wait_idle(port)["cache"]["pages_in_use"] == 0


def test_keep_alive_and_pipelining(toy: tuple[int, OpenAIApp]) -> None:
    port, _ = toy
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    try:
        socks = []
        for i in range(3):
            conn.request("POST", "/v1/completions", body=json.dumps({"prompt": f"p{i}", "max_tokens": 3}))
            resp = conn.getresponse()
            body = json.loads(resp.read())
            assert resp.status == 200 and body["object"] == "text_completion" and body["id"].startswith("cmpl-")
            assert resp.getheader("X-Request-Id") == body["id"]
            socks.append(conn.sock)
        assert socks[0] is not None and all(s is socks[0] for s in socks)  # one connection served all three
    finally:
        conn.close()
    # two pipelined requests in one write, the second asking to close: two answers, in order
    out = raw_exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
                             b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    first, rest = out.split(b"\r\n\r\n", 1)
    n = int(next(ln.split(b":")[1] for ln in first.split(b"\r\n") if ln.lower().startswith(b"content-length")))
    assert json.loads(rest[:n])["object"] == "list"
    assert status_of(rest[n:]) == 200 and b'"status": "ok"' in rest[n:]


def test_stop_strings_and_seeds_toy(toy: tuple[int, OpenAIApp]) -> None:
    port, _ = toy
    req = {"prompt": "hello world", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    status, full, _ = request(port, "POST", "/v1/completions", req)
    text = full["choices"][0]["text"]
    assert status == 200 and full["choices"][0]["finish_reason"] == "length"
    assert full["usage"]["completion_tokens"] == 40
    stop = text[15:18]
    assert stop
    status, cut, _ = request(port, "POST", "/v1/completions", {**req, "stop": ["\x00never", stop]})
    assert cut["choices"][0]["text"] == text[:text.find(stop)] and cut["choices"][0]["finish_reason"] == "stop"
    sampled = {**req, "temperature": 1.0, "seed": 1234}
    a = request(port, "POST", "/v1/completions", sampled)[1]["choices"][0]["text"]
    b = request(port, "POST", "/v1/completions", sampled)[1]["choices"][0]["text"]
    assert a == b  # same seed, same draw


def test_streaming_completion_matches_and_reports_usage(toy: tuple[int, OpenAIApp]) -> None:
    port, _ = toy
    req = {"prompt": "stream me", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    full = request(port, "POST", "/v1/completions", req)[1]
    events, resp = stream(port, "/v1/completions", {**req, "stream_options": {"include_usage": True}})
    assert resp.getheader("Transfer-Encoding") == "chunked"
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["id"] == chunks[0]["id"] and c["object"] == "text_completion" for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    # HTTP/1.0 has no chunked coding: the same events, delimited by the connection closing
    body = json.dumps({**req, "stream": True}).encode()
    out = raw_exchange(port, b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    head, payload = out.split(b"\r\n\r\n", 1)
    assert status_of(head) == 200 and b"transfer-encoding" not in head.lower()
    assert payload.endswith(b"data: [DONE]\n\n")
    events10 = [e.removeprefix(b"data: ") for e in payload.split(b"\n\n") if e]
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events10[:-1]) == text


def test_concurrent_requests_batch_together(toy: tuple[int, OpenAIApp]) -> None:
    port, app = toy
    before = app.agen.batched_steps
    results: dict[int, Any] = {}

    def one(i: int) -> None:
        results[i] = request(port, "POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"request number {i}"}], "max_tokens": 300,
            "temperature": 0, "ignore_eos": True})[:2]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [0, 1, 2, 3]
    for status, body in results.values():
        assert status == 200, body
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 300
        assert body["choices"][0]["message"]["role"] == "assistant"
    h = wait_idle(port)
    assert h["max_batch_seen"] > 1 and app.agen.batched_steps > before, h


@pytest.mark.parametrize("streaming", [True, False])
def test_client_disconnect_cancels_job_and_frees_pages(toy: tuple[int, OpenAIApp], streaming: bool) -> None:
    port, app = toy
    wait_idle(port)
    cancelled = app.agen.cancelled
    steps = app.agen.steps
    body = json.dumps({"prompt": "run for a long time", "max_tokens": 5000, "ignore_eos": True, "temperature": 0,
                       "stream": streaming}).encode()
    with socket.create_connection((HOST, port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        if streaming:
            got = b""
            while got.count(b"data: ") < 3:  # the generation is under way
                chunk = s.recv(4096)
                assert chunk, got
                got += chunk
        else:
            deadline = time.monotonic() + 10
            while health(port)["active_jobs"] == 0:
                assert time.monotonic() < deadline
                time.sleep(0.01)
    h = wait_idle(port)
    assert app.agen.cancelled == cancelled + 1
    assert h["cache"]["pages_in_use"] == 0
    assert app.agen.steps - steps < 4000  # stopped long before max_tokens
    assert request(port, "POST", "/v1/completions", {"prompt": "still here", "max_tokens": 2})[0] == 200


# -- answers (real model) -------------------------------------------------------------------------
def test_chat_completion_answers_paris(real: tuple[int, OpenAIApp]) -> None:
    port, app = real
    status, body, _ = request(port, "POST", "/v1/chat/completions",
                              {"model": app.model_id, "messages": CAPITAL, "max_tokens": 12, "temperature": 0})
    assert status == 200, body
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == app.model_id
    choice = body["choices"][0]
    assert "Paris" in choice["message"]["content"], choice
    assert choice["finish_reason"] in ("stop", "length")
    from exl3_core import Tokenizer

    tok = Tokenizer.from_directory(imported_model())
    n_prompt = tok.encode(tok.apply_chat_template(CAPITAL, add_generation_prompt=True), add_bos=False).shape[1]
    u = body["usage"]
    assert u["prompt_tokens"] == n_prompt and 1 <= u["completion_tokens"] <= 12
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]

    # streaming: the deltas concatenate to the same greedy text, then [DONE]
    events, _ = stream(port, "/v1/chat/completions", {"messages": CAPITAL, "max_tokens": 12, "temperature": 0})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == choice["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert wait_idle(port)["cache"]["pages_in_use"] == 0


def test_json_schema_response_format(real: tuple[int, OpenAIApp]) -> None:
    from exl3_core.plugins import get_plugins

    if "llguidance" not in get_plugins().filter_specs():
        pytest.skip("the exl3-filters plugin (llguidance) is not installed")
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    port, _ = real
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    status, body, _ = request(port, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}})
    assert status == 200, body
    doc = json.loads(body["choices"][0]["message"]["content"])
    jsonschema.validate(doc, schema)
    assert body["choices"][0]["finish_reason"] == "stop"
    err = assert_openai_error(*request(port, "POST", "/v1/chat/completions", {
        "messages": CAPITAL, "response_format": {"type": "json_schema",
                                                 "json_schema": {"schema": {"type": "nonsense"}}}})[:2], 400)
    assert err["param"] == "response_format"


def test_exl3_serve_command_serves_and_stops_on_sigint() -> None:
    import os
    import queue
    import signal
    import subprocess

    model = imported_model()
    env = {**os.environ, "EXL3_DISABLE_PLUGINS": "broken"}
    proc = subprocess.Popen([sys.executable, "-m", "exl3_core", "serve", "-m", str(model), "--host", HOST, "--port", "0",
                             "--cache-tokens", "1024", "--max-batch", "2", "--model-name", "smol"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
    try:
        deadline, port = time.monotonic() + 120, None
        while port is None:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail("exl3 serve printed no 'serving' line within 120 s")
            if "serving" in line:
                port = int(line.split(f"http://{HOST}:")[1].split("/")[0])
        status, body, _ = request(port, "GET", "/v1/models")
        assert status == 200 and body["data"][0]["id"] == "smol"
        status, body, _ = request(port, "POST", "/v1/chat/completions", {"messages": CAPITAL, "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] <= 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
