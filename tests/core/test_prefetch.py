"""The prefill W prefetcher's sequencing (exl3_core/quant/exl3/prefetch.py) on the CPU, with torch.cuda's
streams and events replaced by recorders: what it learns, which W it hands out, where the side stream's
rebuilds go and when the main stream waits for them. The GPU test (tests/gpu/test_prefill_graphs.py) checks
the real streams: logits bit-exact with and without it, eager and CUDA-graph replayed."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from exl3_core.quant.exl3 import CB_MCG, CB_MUL1, prefetch
from exl3_core.quant.exl3.linear import EXL3Linear, group_gemm

LOG: list[tuple[Any, ...]] = []


class FakeStream:
    current: FakeStream | None = None

    def __init__(self, device: Any = None, name: str = "side") -> None:
        self.name = name

    def wait_stream(self, other: FakeStream) -> None:
        LOG.append(("wait_stream", self.name, other.name))

    def wait_event(self, ev: FakeEvent) -> None:
        LOG.append(("wait_event", self.name, ev.tag))


class FakeEvent:
    count = 0

    def __init__(self) -> None:
        FakeEvent.count += 1
        self.tag = FakeEvent.count

    def record(self, stream: FakeStream) -> None:
        LOG.append(("record", stream.name, self.tag))


MAIN = FakeStream(name="main")


@contextmanager
def _on(stream: FakeStream) -> Iterator[None]:
    prev, FakeStream.current = FakeStream.current, stream
    try:
        yield
    finally:
        FakeStream.current = prev


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    LOG.clear()
    FakeStream.current = MAIN
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream.current)
    monkeypatch.setattr(torch.cuda, "stream", _on)
    real = prefetch.reconstruct_full_into_cuda

    def recon(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, K: int, cb: int, out: torch.Tensor) -> None:
        LOG.append(("rebuild", FakeStream.current.name, id(trellis)))
        return real(trellis, suh, svh, K, cb, out)

    monkeypatch.setattr(prefetch, "reconstruct_full_into_cuda", recon)


def _layer(g: torch.Generator, k: int, n: int, K: int, cb: int) -> EXL3Linear:
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=torch.int16, generator=g)
    suh = (torch.randn(k, generator=g).sign() * (0.5 + torch.rand(k, generator=g))).half()
    svh = (torch.randn(n, generator=g).sign() * (0.01 + 0.04 * torch.rand(n, generator=g))).half()
    return EXL3Linear(trellis, suh, svh, cb, k, n)


@pytest.fixture
def groups() -> list[tuple[EXL3Linear, ...]]:
    g = torch.Generator().manual_seed(11)
    a = (_layer(g, 256, 128, 2, CB_MUL1), _layer(g, 256, 256, 3, CB_MCG))  # a q/k/v-like group
    b = (_layer(g, 384, 256, 2, CB_MUL1),)                                # a single linear, other k
    c = (_layer(g, 256, 128, 4, CB_MUL1), _layer(g, 256, 128, 2, CB_MUL1))
    return [a, b, c]


def _k(lins: tuple[EXL3Linear, ...]) -> int:
    return lins[0].trellis.shape[0] * 16


def test_learns_then_rebuilds_ahead(fake_cuda: None, groups: list[tuple[EXL3Linear, ...]]) -> None:
    dev = torch.device("cpu")
    pf = prefetch.Prefetcher()
    with pf.session(dev, True):  # first forward: nothing known, every request rebuilt inline
        assert all(prefetch.current().weight(lins) is None for lins in groups)
    assert pf.order == groups and pf.learned == 1 and pf.sessions == 0
    assert not any(e[0] == "rebuild" for e in LOG), "a learning forward rebuilt nothing on the side stream"
    refs = [prefetch.build_full(lins, _k(lins), dev) for lins in groups]
    LOG.clear()
    with pf.session(dev, True):
        s = prefetch.current()
        assert [e[:2] for e in LOG] == [("wait_stream", "side")] + [("rebuild", "side")] * len(groups[0]) \
            + [("record", "side")], "request 0 is rebuilt on the side stream when the session opens"
        assert LOG[0] == ("wait_stream", "side", "main")
        for i, lins in enumerate(groups):
            LOG.clear()
            w = s.weight(lins)
            assert w is not None and torch.equal(w, refs[i]), i
            assert LOG[0][:2] == ("wait_event", "main"), "the main stream waits for this W's rebuild"
            nxt = [e for e in LOG if e[0] == "rebuild"]
            if i + 1 < len(groups):  # the next request's rebuild is under way before this W is used
                assert [e[1] for e in nxt] == ["side"] * len(groups[i + 1])
                assert {e[2] for e in nxt} == {id(m.trellis) for m in groups[i + 1]}
            else:
                assert nxt == []
        LOG.clear()
    assert LOG == [("wait_stream", "main", "side")], "closing joins the side stream (a graph capture needs it)"
    assert pf.learned == 1 and pf.sessions == 1


def test_off_order_request_falls_back_and_relearns(fake_cuda: None, groups: list[tuple[EXL3Linear, ...]]) -> None:
    dev = torch.device("cpu")
    pf = prefetch.Prefetcher()
    pf.order = list(groups)
    with pf.session(dev, True):
        s = prefetch.current()
        assert s.weight(groups[0]) is not None
        LOG.clear()
        assert s.weight(groups[2]) is None, "a request off the learned order is rebuilt inline"
        assert ("wait_stream", "main", "side") in LOG, "the pending rebuild is waited for before its buffer can go"
        assert s.weight(groups[1]) is None, "the rest of the forward stays inline"
    assert pf.order == [groups[0], groups[2], groups[1]] and pf.learned == 1


def test_inactive_session_and_group_gemm(fake_cuda: None, groups: list[tuple[EXL3Linear, ...]]) -> None:
    """group_gemm takes the prefetched W when a session is open and gives the same result as without."""
    dev = torch.device("cpu")
    pf = prefetch.Prefetcher()
    with pf.session(dev, False):
        assert prefetch.current() is None
    g = torch.Generator().manual_seed(12)
    x = torch.randn(70, 256, generator=g).half()
    want = [group_gemm(x, list(groups[0])), group_gemm(x, list(groups[2]))]
    pf.order = [groups[0], groups[2]]
    with pf.session(dev, True):
        got = [group_gemm(x, list(groups[0])), group_gemm(x, list(groups[2]))]
    assert pf.sessions == 1 and pf.learned == 0
    for a, b in zip(want, got, strict=True):
        for ya, yb in zip(a, b, strict=True):
            assert torch.equal(ya, yb)
