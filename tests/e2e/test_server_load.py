"""`exl3 serve` under load and abuse, on the toy model: clients disconnecting at once (FIN and
RST), concurrent streams against the same requests run alone, time limits, slow clients.

Everything talks to 127.0.0.1 only; every loop is bounded in count and time."""
from __future__ import annotations

import json
import random
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exl3_core.server.openai import OpenAIApp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_support import (
    HOST,
    assert_openai_error,
    await_events,
    hang_up,
    health,
    open_stream,
    request,
    rss_bytes,
    served,
    stream,
    stream_text,
    toy_app,
    wait_idle,
)


@pytest.fixture(scope="module")
def toy() -> Iterator[tuple[int, OpenAIApp]]:
    app = toy_app(max_batch=16)
    with served(app) as port:
        yield port, app


def long_request(tag: str) -> dict[str, Any]:
    return {"prompt": f"client {tag} keeps going", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}


def disconnect_round(port: int, n: int, rng: random.Random, tag: str) -> list[bool]:
    """``n`` streaming clients, each under way, hang up at once; returns which used RST."""
    socks = [open_stream(port, long_request(f"{tag}.{i}")) for i in range(n)]
    for s in socks:
        await_events(s)
    resets = [rng.random() < 0.5 for _ in socks]
    resets[0], resets[-1] = True, False  # both kinds in every round
    for s, reset in zip(socks, resets):
        hang_up(s, reset)
    return resets


def assert_clean_after_disconnects(port: int, app: OpenAIApp) -> None:
    """0 jobs, 0 pages in use, the step loop at rest, and the next request served."""
    h = wait_idle(port, seconds=10)
    assert h["cache"]["pages_in_use"] == 0, h
    steps = app.agen.stats.steps
    time.sleep(0.05)
    assert app.agen.stats.steps == steps  # nothing left stepping
    status, body, _ = request(port, "POST", "/v1/completions", {"prompt": "next", "max_tokens": 3, "temperature": 0,
                                                                 "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body


@pytest.mark.parametrize("rounds", [10, pytest.param(50, marks=pytest.mark.slow)])
def test_disconnect_soak(toy: tuple[int, OpenAIApp], rounds: int) -> None:
    """Rounds of 16 streaming clients hanging up at once, RST and FIN mixed (50 rounds with -m slow)."""
    port, app = toy
    rng = random.Random(rounds)
    wait_idle(port)
    cancelled = app.agen.stats.cancelled
    for r in range(rounds):
        disconnect_round(port, 16, rng, f"{rounds}.{r}")
        assert_clean_after_disconnects(port, app)
    # every client's job was cancelled (none ran to its 4000 tokens)
    assert app.agen.stats.cancelled == cancelled + 16 * rounds


def test_twenty_clients_disconnect_mid_stream_without_leaking() -> None:
    app = toy_app(max_batch=24)  # all twenty stream at once
    rng = random.Random(20)
    with served(app) as port:
        disconnect_round(port, 20, rng, "warm-up")  # allocator pools and buffers reach their working size
        assert_clean_after_disconnects(port, app)
        before = rss_bytes()
        for r in range(3):
            disconnect_round(port, 20, rng, f"rss.{r}")
            assert_clean_after_disconnects(port, app)
        after = rss_bytes()
        assert after <= before * 1.10, f"RSS grew from {before / 2**20:.1f} MiB to {after / 2**20:.1f} MiB"
        assert app.agen.stats.cancelled == 80 and app.agen.stats.max_batch == 20


def test_clients_disconnecting_while_queued(toy: tuple[int, OpenAIApp]) -> None:
    port, app = toy
    wait_idle(port)
    cancelled = app.agen.stats.cancelled
    running = [open_stream(port, long_request(f"run.{i}")) for i in range(16)]
    for s in running:
        await_events(s)
    waiting = [open_stream(port, long_request(f"queued.{i}")) for i in range(4)]  # the batch is full
    deadline = time.monotonic() + 10
    while health(port)["queued_jobs"] < 4:
        assert time.monotonic() < deadline, health(port)
        time.sleep(0.01)
    for i, s in enumerate(waiting + running):
        hang_up(s, reset=i % 2 == 0)
    assert_clean_after_disconnects(port, app)
    assert app.agen.stats.cancelled == cancelled + 20


def test_sixteen_concurrent_streams_equal_the_same_requests_alone(toy: tuple[int, OpenAIApp]) -> None:
    port, app = toy
    rng = random.Random(16)
    reqs: list[dict[str, Any]] = []
    for i in range(16):
        r: dict[str, Any] = {"prompt": "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(3, 40))),
                             "max_tokens": rng.randint(20, 60), "ignore_eos": True}
        r.update({"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.9, "seed": rng.randrange(2**31)})
        reqs.append(r)
    alone = [stream_text(stream(port, "/v1/completions", r)[0], chat=False) for r in reqs]
    together: dict[int, str] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(16, timeout=30)

    def one(i: int) -> None:
        try:
            start.wait()
            together[i] = stream_text(stream(port, "/v1/completions", reqs[i])[0], chat=False)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    batched = app.agen.stats.batched_steps
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert [together[i] for i in range(16)] == alone
    assert app.agen.stats.batched_steps > batched and app.agen.stats.max_batch >= 8  # they did share steps
    wait_idle(port)


def test_request_timeout_cancels_the_job() -> None:
    app = toy_app(request_timeout=1.0)
    with served(app) as port:
        t0 = time.monotonic()
        err = assert_openai_error(*request(port, "POST", "/v1/completions", long_request("slow"))[:2], 504)
        assert err["code"] == "timeout" and "--request-timeout" in err["message"]
        assert 0.9 < time.monotonic() - t0 < 10
        events, _ = stream(port, "/v1/completions", long_request("slow-stream"))
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "timeout"
        assert any(json.loads(e).get("choices") for e in events[:-2])  # it streamed before the limit
        h = wait_idle(port, seconds=10)
        assert h["cancelled_jobs"] == 2 and h["cache"]["pages_in_use"] == 0
        # a body that never finishes arriving is answered 408 once the limit passes
        with socket.create_connection((HOST, port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\"")
            got = b""
            while b"\r\n\r\n" not in got:
                chunk = s.recv(4096)
                assert chunk, got
                got += chunk
            assert got.startswith(b"HTTP/1.1 408"), got


def test_slow_partial_connections_do_not_block_others(toy: tuple[int, OpenAIApp]) -> None:
    port, _ = toy
    socks = []
    try:
        for i in range(8):  # half a request line, half a header block, half a body
            s = socket.create_connection((HOST, port), timeout=10)
            s.sendall([b"POST /v1/compl", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le",
                       b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 50\r\n\r\n{\"pro"][i % 3])
            socks.append(s)
        t0 = time.perf_counter()
        status, body, _ = request(port, "POST", "/v1/completions", {"prompt": "others", "max_tokens": 4})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
        assert time.perf_counter() - t0 < 5
        assert health(port)["status"] == "ok"
    finally:
        for s in socks:
            s.close()


def test_requests_outgrowing_the_cache_are_preempted_not_refused() -> None:
    """A 1024-token cache, two 400-token prompts with max_tokens 600 (each fits alone, together they
    do not): both stream all 600 tokens, identical to each run alone, and the pause is counted in
    /metrics and /health."""
    from prometheus_client.parser import text_string_to_metric_families

    app = toy_app(cache_tokens=1024)
    rng = random.Random(1024)
    reqs = [{"prompt": [rng.randrange(256) for _ in range(400)], "max_tokens": 600, "ignore_eos": True, **extra}
            for extra in ({"temperature": 0}, {"temperature": 0.9, "seed": 77})]
    with served(app) as port:
        alone = [stream_text(stream(port, "/v1/completions", r)[0], chat=False) for r in reqs]
        assert app.agen.stats.preemptions == 0
        together: dict[int, str] = {}
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                together[i] = stream_text(stream(port, "/v1/completions", reqs[i], timeout=120)[0], chat=False)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.05)  # the first is admitted first: the second is the newer one
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert [together[0], together[1]] == alone
        h = wait_idle(port)
        assert h["preemptions"] >= 1 and h["cache"]["pages_in_use"] == 0
        text = request(port, "GET", "/metrics")[1].decode()
        counted = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert counted["exl3_preemptions_total"] == app.agen.stats.preemptions >= 1
