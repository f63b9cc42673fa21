"""`exl3 serve` on FastAPI + uvicorn, in-process on 127.0.0.1 (ephemeral ports only).

Protocol-level behaviour runs on the toy model and byte tokenizer (fast), through the official
``openai`` client where it fits and raw HTTP where the wire matters; the answers themselves are
checked on the real default model (SmolLM2-135M, imported once per session)."""
from __future__ import annotations

import argparse
import json
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from exl3_core.server.openai import NORMALIZATION_SLACK, OpenAIApp
from exl3_core.server.runner import exposure_warning, is_loopback
from exl3_core.server.schemas import ChatCompletionRequest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from server_support import (
    HOST,
    assert_openai_error,
    exchange_one,
    health,
    raw_exchange,
    request,
    served,
    status_of,
    stream,
    stream_text,
    toy_app,
    wait_idle,
)
from smol_gguf import imported_model

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
KEY = "test-key-7f3a"
REPO = Path(__file__).resolve().parents[2]


def client(port: int, key: str = "none", **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{HOST}:{port}/v1", api_key=key, max_retries=0, timeout=60, **kw)


# -- servers --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def toy() -> Iterator[tuple[int, OpenAIApp]]:
    app = toy_app(max_batch=8)
    with served(app) as port:
        yield port, app


@pytest.fixture(scope="module")
def keyed() -> Iterator[tuple[int, OpenAIApp]]:
    app = toy_app(api_key=KEY, cors_origins=("http://ui.example",))
    with served(app) as port:
        yield port, app


@pytest.fixture(scope="module")
def real() -> Iterator[tuple[int, OpenAIApp]]:
    from exl3_core.server.cli import build_app

    args = argparse.Namespace(model=imported_model(), device="cpu", cache_tokens=2048, attention=None, max_batch=4,
                              model_name=None, api_key=None, max_request_bytes=16 * 1024 * 1024,
                              request_timeout=600.0, cors_origin=[], allowed_host=[], allow_special_tokens=False,
                              step_tokens=None)
    app = build_app(args)
    with served(app) as port:
        yield port, app


# -- protocol (toy model) -------------------------------------------------------------------------
def test_models_health_and_unknown_routes(toy: tuple[int, OpenAIApp]) -> None:
    port, _ = toy
    models = client(port).models.list()
    assert [m.id for m in models.data] == ["toy"]
    assert client(port).models.retrieve("toy").id == "toy"
    with pytest.raises(openai.NotFoundError) as e:
        client(port).models.retrieve("other")
    assert e.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert health(port)["status"] == "ok"
    assert_openai_error(*request(port, "GET", "/v1/models/other")[:2], 404, "model")
    assert_openai_error(*request(port, "POST", "/v1/nope", {"x": 1})[:2], 404)
    status, body, resp = request(port, "GET", "/v1/chat/completions")
    assert_openai_error(status, body, 405)
    assert resp.getheader("Allow") == "POST"


def test_openai_client_chat_and_completions(toy: tuple[int, OpenAIApp]) -> None:
    port, _ = toy
    c = client(port)
    chat = c.chat.completions.create(model="toy", messages=CAPITAL, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-") and chat.model == "toy"
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 12
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 12
    pieces, finish, usage = [], None, None
    for chunk in c.chat.completions.create(model="toy", messages=CAPITAL, max_tokens=12, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert "".join(pieces) == chat.choices[0].message.content and finish == "length"
    assert usage is not None and usage.completion_tokens == 12
    comp = c.completions.create(model="toy", prompt="hello world", max_tokens=9, temperature=0,
                                extra_body={"ignore_eos": True})
    assert comp.object == "text_completion" and comp.usage is not None
    assert comp.usage.prompt_tokens == len(b"hello world") and comp.usage.completion_tokens == 9
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="toy", prompt="hello world", max_tokens=9, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if ch.choices)
    assert streamed == comp.choices[0].text


def test_malformed_requests_are_openai_errors(toy: tuple[int, OpenAIApp]) -> None:
    port, _ = toy
    chat, comp = "/v1/chat/completions", "/v1/completions"
    err = assert_openai_error(*request(port, "POST", chat, raw=b'{"messages": [')[:2], 400)
    assert "JSON" in err["message"]
    assert "JSON object" in assert_openai_error(*request(port, "POST", chat, raw=b"[1, 2]")[:2], 400)["message"]
    assert "empty" in assert_openai_error(*request(port, "POST", chat, raw=b"")[:2], 400)["message"]
    assert_openai_error(*request(port, "POST", chat, {"messages": []})[:2], 400, "messages")
    assert_openai_error(*request(port, "POST", chat, {"messages": "hi"})[:2], 400, "messages")
    err = assert_openai_error(*request(port, "POST", chat, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]})[:2], 400, "messages")
    assert "text parts" in err["message"]
    assert_openai_error(*request(port, "POST", comp, {"prompt": ["a", "b"]})[:2], 400, "prompt")
    assert_openai_error(*request(port, "POST", comp, {"max_tokens": 3})[:2], 400, "prompt")  # missing
    # wrong types: strict, as OpenAI's API (a string is not a number, a float not an integer)
    for field, value in [("max_tokens", "5"), ("max_tokens", 2.0), ("temperature", "hot"), ("stream", "yes"),
                         ("seed", True), ("stop", {"a": 1}), ("logit_bias", [1])]:
        err = assert_openai_error(*request(port, "POST", comp, {"prompt": "x", field: value})[:2], 400, field)
        assert field in err["message"], err
    # unknown fields are refused (a misspelt parameter must not silently do nothing)
    err = assert_openai_error(*request(port, "POST", comp, {"prompt": "x", "temprature": 0.5})[:2], 400, "temprature")
    assert "temprature" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client(port).chat.completions.create(model="toy", messages=CAPITAL, extra_body={"frobnicate": 1})
    assert e.value.status_code == 400 and e.value.body["param"] == "frobnicate"  # type: ignore[index]
    # negative and huge max_tokens
    assert_openai_error(*request(port, "POST", comp, {"prompt": "x", "max_tokens": -5})[:2], 400, "max_tokens")
    err = assert_openai_error(*request(port, "POST", comp, {"prompt": "x", "max_tokens": 10**30})[:2], 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    # garbage on the wire: still OpenAI's shape, and the connection is closed
    for junk in (b"NOT HTTP\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n",
                 b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}"):
        out = raw_exchange(port, junk)
        _, _, payload = out.partition(b"\r\n\r\n")
        assert status_of(out) == 400, out
        assert_openai_error(400, json.loads(payload), 400)
    assert wait_idle(port)["status"] == "ok"  # still serving


def test_body_limit_is_413_and_server_keeps_serving(toy: tuple[int, OpenAIApp]) -> None:
    port, app = toy
    limit = app.options.max_request_bytes
    big = b'{"prompt": "' + b"x" * (50 * 1024 * 1024) + b'"}'  # 50 MB
    err = assert_openai_error(*request(port, "POST", "/v1/completions", raw=big, timeout=60)[:2], 413)
    assert str(limit) in err["message"] and "--max-request-bytes" in err["message"]
    # refused from the headers alone: the announced body is never sent
    out = raw_exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             b"Connection: close\r\nContent-Length: %d\r\n\r\n" % (limit + 1))
    assert status_of(out) == 413
    # a chunked upload has no length up front: counted as it arrives
    piece = b"x" * (1024 * 1024)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(limit // len(piece) + 2))
    status, body = exchange_one(port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                      b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                                      + chunks + b"0\r\n\r\n")
    assert_openai_error(status, json.loads(body), 413)
    status, body, _ = request(port, "POST", "/v1/completions", {"prompt": "still here", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] <= 2


def test_invalid_sampler_values_are_400_and_server_keeps_serving(toy: tuple[int, OpenAIApp]) -> None:
    port, _ = toy
    base = {"prompt": "hello", "max_tokens": 4}
    for field, value in [("temperature", -1), ("top_p", 2), ("top_p", 0), ("min_p", 1.5), ("top_k", -3),
                         ("presence_penalty", 3), ("frequency_penalty", "x"), ("max_tokens", 0), ("seed", 1.5),
                         ("n", 2), ("logprobs", 21), ("logprobs", -1), ("stop", [1]), ("logit_bias", {"a": 1}),
                         ("echo", True),
                         ("best_of", 3), ("stream_options", {"include_usage": True})]:
        status, body, _ = request(port, "POST", "/v1/completions", {**base, field: value})
        err = assert_openai_error(status, body, 400, field)
        assert field in err["message"], err
    chat = {"messages": CAPITAL, "max_tokens": 4}
    for field, value in [("top_logprobs", 2), ("tools", [{"type": "function", "function": {"name": "f"}}]),
                         ("tool_choice", "required")]:
        err = assert_openai_error(*request(port, "POST", "/v1/chat/completions", {**chat, field: value})[:2], 400)
        assert field.split("_")[0] in err["param"], err
    err = assert_openai_error(*request(port, "POST", "/v1/chat/completions", {
        **chat, "logprobs": True, "top_logprobs": 21})[:2], 400, "top_logprobs")
    assert "[0, 20]" in err["message"]
    err = assert_openai_error(*request(port, "POST", "/v1/completions", {**base, "logit_bias": {"99999": 1}})[:2], 400)
    assert "99999" in err["message"]
    err = assert_openai_error(*request(port, "POST", "/v1/chat/completions", {
        "messages": CAPITAL, "response_format": {"type": "json_object"}})[:2], 400, "response_format")
    assert "exl3-filters" in err["message"]
    status, body, _ = request(port, "POST", "/v1/completions", {**base, "temperature": 0.7, "top_p": 0.9, "seed": 1})
    assert status == 200 and body["usage"]["prompt_tokens"] == len(b"hello")
    assert wait_idle(port)["cache"]["pages_in_use"] == 0


def test_logprobs_in_both_shapes_streamed_and_whole(toy: tuple[int, OpenAIApp]) -> None:
    """Each generated token's log probability and its most likely alternatives, in the chat and completions shapes,
    streamed and whole: the chosen token's entry is its row's log-softmax (greedy: the first alternative)."""
    port, app = toy
    c = client(port)
    kw: dict[str, Any] = {"max_tokens": 10, "temperature": 0, "extra_body": {"ignore_eos": True}}
    chat = c.chat.completions.create(model="toy", messages=CAPITAL, logprobs=True, top_logprobs=3, **kw)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 10 == chat.usage.completion_tokens  # type: ignore[union-attr]
    vocab = app.tokenizer.get_vocab_bytes()
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert [a.logprob for a in e.top_logprobs] == sorted((a.logprob for a in e.top_logprobs), reverse=True)
        assert e.token == e.top_logprobs[0].token and e.logprob == e.top_logprobs[0].logprob  # greedy: the argmax
        assert bytes(e.bytes or []) in vocab
    # the same request streamed: the chunks' entries in order are the whole answer's
    streamed = [entry for ch in c.chat.completions.create(model="toy", messages=CAPITAL, logprobs=True,
                                                          top_logprobs=3, stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs for entry in ch.choices[0].logprobs.content or []]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # the reference: the model's own next-token distribution over the prompt and the tokens chosen so far
    ids = app._chat_prompt(ChatCompletionRequest(messages=CAPITAL))  # type: ignore[arg-type]
    chosen = [vocab.index(bytes(e.bytes or [])) for e in content]
    from exl3_core.archkit.batch import BatchMeta

    seq = ids + chosen
    logits = app.generator.model.forward_batch(BatchMeta.full(torch.tensor([seq])))
    want = torch.log_softmax(logits.float(), -1)[len(ids) - 1:-1].gather(1, torch.tensor(chosen)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([e.logprob for e in content]), want, atol=1e-4)
    # completions: parallel lists, offsets counting the tokens' texts; logprobs=0 lists no alternatives
    comp = c.completions.create(model="toy", prompt="hello world", logprobs=2, **kw)
    lp = comp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 10 == len(lp.token_logprobs or [])
    assert lp.top_logprobs is not None and all(0 < len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    pieces = [ch.choices[0].logprobs for ch in c.completions.create(model="toy", prompt="hello world", logprobs=2,
                                                                     stream=True, **kw) if ch.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens or []] == lp.tokens
    assert [o for p in pieces for o in p.text_offset or []] == lp.text_offset
    none = c.completions.create(model="toy", prompt="hello world", logprobs=0, **kw).choices[0].logprobs
    assert none is not None and none.top_logprobs is None and len(none.token_logprobs or []) == 10
    assert c.completions.create(model="toy", prompt="hello", **kw).choices[0].logprobs is None
    assert wait_idle(port)["cache"]["pages_in_use"] == 0


def test_keep_alive_and_pipelining(toy: tuple[int, OpenAIApp]) -> None:
    import http.client

    port, _ = toy
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    try:
        socks = []
        for i in range(3):
            conn.request("POST", "/v1/completions", body=json.dumps({"prompt": f"p{i}", "max_tokens": 3}),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            body = json.loads(resp.read())
            assert resp.status == 200 and body["object"] == "text_completion" and body["id"].startswith("cmpl-")
            assert resp.getheader("X-Request-Id") == body["id"]
            socks.append(conn.sock)
        assert socks[0] is not None and all(s is socks[0] for s in socks)  # one connection served all three
    finally:
        conn.close()
    # two pipelined requests in one write, the second asking to close: two answers, in order
    out = raw_exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                             b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    first, rest = out.split(b"\r\n\r\n", 1)
    n = int(next(ln.split(b":")[1] for ln in first.split(b"\r\n") if ln.lower().startswith(b"content-length")))
    assert json.loads(rest[:n])["object"] == "list"
    assert status_of(rest[n:]) == 200 and b'"status":"ok"' in rest[n:]


def test_stop_strings_and_seeds(toy: tuple[int, OpenAIApp]) -> None:
    port, _ = toy
    c = client(port)
    req: dict[str, Any] = {"model": "toy", "prompt": "hello world", "max_tokens": 40, "temperature": 0,
                           "extra_body": {"ignore_eos": True}}
    full = c.completions.create(**req)
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length" and full.usage is not None and full.usage.completion_tokens == 40
    stop = text[15:18]
    assert stop
    cut = c.completions.create(**req, stop=["\x00never", stop])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    sampled = {**req, "temperature": 1.0}
    a = c.completions.create(**sampled, seed=1234).choices[0].text
    b = c.completions.create(**sampled, seed=1234).choices[0].text
    other = c.completions.create(**sampled, seed=4321).choices[0].text
    assert a == b  # same seed, same draw
    assert a != other and a != text  # the seed (not greedy decoding) decides the draw


def test_streaming_completion_matches_and_reports_usage(toy: tuple[int, OpenAIApp]) -> None:
    port, _ = toy
    req = {"prompt": "stream me", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    full = request(port, "POST", "/v1/completions", req)[1]
    events, resp = stream(port, "/v1/completions", {**req, "stream_options": {"include_usage": True}})
    assert resp.getheader("Transfer-Encoding") == "chunked"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["id"] == chunks[0]["id"] == resp.getheader("X-Request-Id") for c in chunks)
    assert all(c["object"] == "text_completion" for c in chunks)
    text = stream_text(events, chat=False)
    assert text == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    # HTTP/1.0 has no chunked coding: the same events, delimited by the connection closing
    body = json.dumps({**req, "stream": True}).encode()
    out = raw_exchange(port, b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    head, payload = out.split(b"\r\n\r\n", 1)
    assert status_of(head) == 200 and b"transfer-encoding" not in head.lower()
    assert payload.endswith(b"data: [DONE]\n\n")
    events10 = [e.removeprefix(b"data: ") for e in payload.split(b"\n\n") if e]
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events10[:-1]) == text


def test_concurrent_requests_batch_together(toy: tuple[int, OpenAIApp]) -> None:
    port, app = toy
    before = app.agen.stats.batched_steps
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
    h = wait_idle(port)
    assert h["max_batch_seen"] > 1 and app.agen.stats.batched_steps > before, h


@pytest.mark.parametrize("streaming", [True, False])
def test_client_disconnect_cancels_job_and_frees_pages(toy: tuple[int, OpenAIApp], streaming: bool) -> None:
    port, app = toy
    wait_idle(port)
    cancelled = app.agen.stats.cancelled
    steps = app.agen.stats.steps
    body = json.dumps({"prompt": "run for a long time", "max_tokens": 5000, "ignore_eos": True, "temperature": 0,
                       "stream": streaming}).encode()
    with socket.create_connection((HOST, port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
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
    assert app.agen.stats.cancelled == cancelled + 1
    assert h["cache"]["pages_in_use"] == 0
    assert app.agen.stats.steps - steps < 4000  # stopped long before max_tokens
    assert request(port, "POST", "/v1/completions", {"prompt": "still here", "max_tokens": 2})[0] == 200


def test_api_key_guards_v1(keyed: tuple[int, OpenAIApp]) -> None:
    port, _ = keyed
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "x"}),
                                   ("GET", "/v1/does-not-exist", None)):
            status, err, resp = request(port, method, path, body, headers=headers)
            assert assert_openai_error(status, err, 401)["code"] == "invalid_api_key"
            assert resp.getheader("WWW-Authenticate") == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        client(port, "wrong").models.list()
    assert [m.id for m in client(port, KEY).models.list().data] == ["toy"]
    out = client(port, KEY).completions.create(model="toy", prompt="hi", max_tokens=3)
    assert out.usage is not None and 1 <= out.usage.completion_tokens <= 3
    # probes and scrapers need no key
    assert health(port)["status"] == "ok"
    assert request(port, "GET", "/metrics")[0] == 200
    # a browser's preflight carries no Authorization header: answered by CORS for the allowed origin only
    pre = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    status, _, resp = request(port, "OPTIONS", "/v1/chat/completions", headers=pre)
    assert status == 200 and resp.getheader("Access-Control-Allow-Origin") == "http://ui.example"
    status, _, resp = request(port, "OPTIONS", "/v1/chat/completions", headers={**pre, "Origin": "http://evil.example"})
    assert status == 400 and resp.getheader("Access-Control-Allow-Origin") is None


def test_cors_is_off_by_default(toy: tuple[int, OpenAIApp]) -> None:
    port, _ = toy
    status, _, resp = request(port, "GET", "/v1/models", headers={"Origin": "http://ui.example"})
    assert status == 200 and resp.getheader("Access-Control-Allow-Origin") is None


def test_metrics_parse_as_prometheus_text(toy: tuple[int, OpenAIApp]) -> None:
    port, app = toy
    stream(port, "/v1/completions", {"prompt": "metrics", "max_tokens": 5, "ignore_eos": True})
    request(port, "GET", "/v1/nope")
    status, text, resp = request(port, "GET", "/metrics")
    assert status == 200 and resp.getheader("Content-Type", "").startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    for name in ("exl3_http_requests", "exl3_time_to_first_token_seconds", "exl3_queue_depth",
                 "exl3_generation_tokens_per_second", "exl3_generation_tokens", "exl3_cache_pages_in_use",
                 "exl3_cache_pages", "exl3_running_requests", "exl3_cancelled_requests"):
        assert name in families, sorted(families)

    def value(family: str, sample: str, **labels: str) -> float:
        hits = [s.value for s in families[family].samples
                if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(hits) == 1, (family, sample, labels, families[family].samples)
        return hits[0]

    assert value("exl3_http_requests", "exl3_http_requests_total", route="/v1/completions", status="200") >= 1
    assert value("exl3_http_requests", "exl3_http_requests_total", route="other", status="404") >= 1
    assert value("exl3_time_to_first_token_seconds", "exl3_time_to_first_token_seconds_count") >= 1
    s = app.agen.stats
    assert value("exl3_cache_pages", "exl3_cache_pages") == s.pages
    assert value("exl3_generation_tokens", "exl3_generation_tokens_total") == s.generated_tokens >= 5
    assert value("exl3_queue_depth", "exl3_queue_depth") == 0


def test_prompt_longer_than_the_cache(toy: tuple[int, OpenAIApp]) -> None:
    port, app = toy
    tok = app.tokenizer
    n = app.max_context
    err = assert_openai_error(*request(port, "POST", "/v1/completions", {"prompt": [65] * n})[:2], 400, "prompt")
    assert err["code"] == "context_length_exceeded" and str(n) in err["message"]
    err = assert_openai_error(*request(port, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "y" * n}]})[:2], 400, "messages")
    assert err["code"] == "context_length_exceeded"
    # past the byte bound the prompt is refused without being tokenized at all
    assert app.max_prompt_bytes == n * app.max_token_bytes * NORMALIZATION_SLACK
    longest = tok.longest  # type: ignore[attr-defined]
    err = assert_openai_error(*request(port, "POST", "/v1/completions", {
        "prompt": "z" * (app.max_prompt_bytes + 1)})[:2], 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    assert tok.longest == longest  # type: ignore[attr-defined]
    assert request(port, "POST", "/v1/completions", {"prompt": "fits", "max_tokens": 2})[0] == 200


@pytest.fixture(params=["toy", "real"])
def either(request: pytest.FixtureRequest) -> tuple[int, OpenAIApp]:
    return request.getfixturevalue(request.param)


def test_15mb_prompt_does_not_delay_health(either: tuple[int, OpenAIApp]) -> None:
    port, app = either
    words = "many words " * 1_400_000  # 15.4 MB
    bodies = {"/v1/completions": json.dumps({"prompt": words, "max_tokens": 4}).encode(),
              "/v1/chat/completions": json.dumps({"messages": [{"role": "user", "content": words}]}).encode()}
    assert all(15_000_000 < len(b) < app.options.max_request_bytes for b in bodies.values())
    replies: dict[str, Any] = {}

    def post() -> None:
        for path, body in bodies.items():
            replies[path] = request(port, "POST", path, raw=body, timeout=120)[:2]

    big = threading.Thread(target=post)
    big.start()
    delays: list[float] = []
    deadline = time.monotonic() + 120
    while big.is_alive() or len(delays) < 3:
        assert time.monotonic() < deadline, "the 15 MB requests did not finish within 120 s"
        t0 = time.perf_counter()
        health(port)
        delays.append(time.perf_counter() - t0)
        time.sleep(0.01)
    big.join()
    assert max(delays) < 0.5, f"/health took up to {max(delays):.3f} s while a 15 MB prompt was handled"
    for path, param in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
        assert assert_openai_error(*replies[path], 400, param)["code"] == "context_length_exceeded"


def test_no_hand_written_http_remains() -> None:
    core = REPO / "exl3_core"
    assert not (core / "server" / "http.py").exists()
    patterns = {
        "asyncio.start_server": re.compile(r"start_server\s*\("),
        "a request-line parser": re.compile(r"""(split|partition)\(\s*b?["']\\r\\n"""),
        "a header-block reader": re.compile(r"""readuntil\(\s*b?["']\\r\\n\\r\\n"""),
        "http.server / socketserver": re.compile(r"^\s*(import|from)\s+(http\.server|socketserver)\b", re.MULTILINE),
        "hand-written status lines": re.compile(r"""["']HTTP/1\.[01] \{"""),
    }
    offenders = [f"{p.relative_to(REPO)}: {what}" for p in core.rglob("*.py")
                 for what, pat in patterns.items() if pat.search(p.read_text(encoding="utf-8"))]
    assert not offenders, offenders


# -- answers (real model) -------------------------------------------------------------------------
def test_chat_completion_answers_paris(real: tuple[int, OpenAIApp]) -> None:
    port, app = real
    c = client(port)
    out = c.chat.completions.create(model=app.model_id, messages=CAPITAL, max_tokens=12, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and out.model == app.model_id
    choice = out.choices[0]
    assert choice.message.content is not None and "Paris" in choice.message.content, choice
    assert choice.finish_reason in ("stop", "length")
    from exl3_core import Tokenizer

    tok = Tokenizer.from_directory(imported_model())
    n_prompt = tok.encode(tok.apply_chat_template(CAPITAL, add_generation_prompt=True), add_bos=False).shape[1]
    u = out.usage
    assert u is not None and u.prompt_tokens == n_prompt and 1 <= u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    # streaming: the deltas concatenate to the same greedy text, then [DONE]
    events, _ = stream(port, "/v1/chat/completions", {"messages": CAPITAL, "max_tokens": 12, "temperature": 0})
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(ch["object"] == "chat.completion.chunk" and ch["id"] == chunks[0]["id"] for ch in chunks)
    assert stream_text(events, chat=True) == choice.message.content
    assert chunks[-1]["choices"][0]["finish_reason"] == choice.finish_reason
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
    out = client(port).chat.completions.create(
        model="x", messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    content = out.choices[0].message.content
    assert content is not None
    jsonschema.validate(json.loads(content), schema)
    assert out.choices[0].finish_reason == "stop"
    err = assert_openai_error(*request(port, "POST", "/v1/chat/completions", {
        "messages": CAPITAL, "response_format": {"type": "json_schema",
                                                 "json_schema": {"schema": {"type": "nonsense"}}}})[:2], 400)
    assert err["param"] == "response_format"


def test_exl3_serve_command_with_api_key_from_env_stops_on_sigint() -> None:
    import os
    import queue
    import signal
    import subprocess

    model = imported_model()
    env = {**os.environ, "EXL3_DISABLE_PLUGINS": "broken", "EXL3_API_KEY": KEY}
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
        assert_openai_error(*request(port, "GET", "/v1/models")[:2], 401)
        assert [m.id for m in client(port, KEY).models.list().data] == ["smol"]
        out = client(port, KEY).chat.completions.create(model="smol", messages=CAPITAL, max_tokens=2)
        assert out.usage is not None and out.usage.completion_tokens <= 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize(("flags", "message"), [(["--max-request-bytes", "0"], "--max-request-bytes"),
                                                (["--request-timeout", "-1"], "--request-timeout"),
                                                (["--api-key", " "], "--api-key"),
                                                (["--step-tokens", "0"], "--step-tokens"),
                                                (["--allowed-host", "http://x/"], "--allowed-host")])
def test_serve_rejects_bad_options_before_loading_the_model(flags: list[str], message: str) -> None:
    import subprocess

    out = subprocess.run([sys.executable, "-m", "exl3_core", "serve", *flags], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 2 and message in out.stderr and "serving" not in out.stderr, out.stderr


def test_warning_when_binding_beyond_loopback_without_a_key() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.5", "example.com"))
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("0.0.0.0", KEY) is None
    warning = exposure_warning("0.0.0.0", None)
    assert warning is not None and "--api-key" in warning and "0.0.0.0" in warning
