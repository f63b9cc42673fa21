"""Prefill: each EXL3 linear's W rebuilt one step ahead, on a side stream.

From :data:`~exl3_core.quant.exl3.linear.GROUP_GEMM_MIN_ROWS` rows an EXL3 linear (or a group of them sharing
x) multiplies x by its W rebuilt in the original basis, one cuBLAS GEMM (``group_gemm``; csrc ``FULL_MIN_M``).
The rebuild is integer work that the GEMM's stream otherwise waits for: about 6 of the ~50 ms of an 8B-shape
2048-token forward on an H200 (docs/performance.md, run 7).

A :class:`Prefetcher` (one per model) learns, from a first forward at those sizes, the order in which the
linears ask for their W. In each later forward a :class:`Session` rebuilds request i + 1 on a side stream as
soon as the main stream reaches request i, so the rebuild overlaps the GEMM and the kernels after it; request
i + 1 then waits only for that rebuild's event. The result is bit-identical (the same kernels on the same
inputs). A request off the learned order (another path through the model, MoE routing) makes the rest of that
forward rebuild inline, and the order is learned again from what the forward asked for.

The side stream joins back into the forward's stream when the session closes, so a CUDA-graph capture of the
forward captures both (the generator's prefill graphs warm up twice before capturing: learn, then prefetch).
"""
from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from exl3_core.quant.exl3.cuda_ops import reconstruct_full_into_cuda

_local = threading.local()


def build_full(lins: Sequence[Any], k: int, device: torch.device) -> torch.Tensor:
    """fp16 ``[k, Σ n_i]``: every linear's W in the original basis side by side (on the current stream)."""
    widths = [m.trellis.shape[1] * 16 for m in lins]
    w = torch.empty((k, sum(widths)), dtype=torch.float16, device=device)
    off = 0
    for m, n in zip(lins, widths, strict=True):
        reconstruct_full_into_cuda(m.trellis, m.suh, m.svh, m.K, m.codebook, w[:, off:off + n])
        off += n
    return w


def _same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class Prefetcher:
    """A model's learned order of W requests at prefill sizes, and its side stream (per device)."""

    def __init__(self) -> None:
        self.order: list[tuple[Any, ...]] = []
        self.sessions = 0  # forwards that prefetched (tests, benchmarks)
        self.learned = 0   # times the order was (re)learned
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream of ``device`` (a tensor's device: CUDA ones carry their index)."""
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device)
        return s

    @contextmanager
    def session(self, device: torch.device, active: bool) -> Iterator[None]:
        """Make a :class:`Session` the current one for the enclosed forward (on this thread) when ``active``."""
        if not active:
            yield
            return
        s = Session(self, device)
        prev = getattr(_local, "session", None)
        _local.session = s
        try:
            yield
        finally:
            _local.session = prev
            s.close()


class Session:
    """One forward's requests: the next learned W rebuilt ahead, or every W inline while learning."""

    def __init__(self, owner: Prefetcher, device: torch.device) -> None:
        self.owner = owner
        self.device = device
        self.main = torch.cuda.current_stream(device)
        self.seen: list[tuple[Any, ...]] = []
        self.live = bool(owner.order)  # False: learning (or fallen back): the caller rebuilds inline
        self.used_side = False
        self.pending: tuple[int, torch.Tensor, torch.cuda.Event] | None = None
        if self.live:
            owner.sessions += 1
            self._launch(0)

    def _launch(self, j: int) -> None:
        lins = self.owner.order[j]
        side = self.owner.stream(self.device)
        k = lins[0].trellis.shape[0] * 16
        widths = sum(m.trellis.shape[1] * 16 for m in lins)
        # allocated on the main stream: it frees the buffer after its GEMM, which waited for this rebuild
        w = torch.empty((k, widths), dtype=torch.float16, device=self.device)
        side.wait_stream(self.main)  # the main stream's work so far (the buffer's previous users) first
        with torch.cuda.stream(side):
            off = 0
            for m in lins:
                n = m.trellis.shape[1] * 16
                reconstruct_full_into_cuda(m.trellis, m.suh, m.svh, m.K, m.codebook, w[:, off:off + n])
                off += n
            ev = torch.cuda.Event()
            ev.record(side)
        self.used_side = True
        self.pending = (j, w, ev)

    def weight(self, lins: Sequence[Any]) -> torch.Tensor | None:
        """W for ``lins`` (fp16 ``[k, Σ n]``, the main stream ordered after its rebuild), or None: rebuild inline."""
        key = tuple(lins)
        i = len(self.seen)
        self.seen.append(key)
        if not self.live:
            return None
        order = self.owner.order
        assert self.pending is not None
        j, w, ev = self.pending
        if j != i or not _same(order[j], key):
            self._abandon()
            return None
        self.main.wait_event(ev)
        self.pending = None
        if i + 1 < len(order):
            self._launch(i + 1)
        return w

    def _abandon(self) -> None:
        # the side stream may still write the pending buffer: the main stream waits for it before the
        # buffer can be freed and handed to anything else
        self.live = False
        if self.used_side:
            self.main.wait_stream(self.owner.stream(self.device))
        self.pending = None

    def close(self) -> None:
        if self.used_side:
            self.main.wait_stream(self.owner.stream(self.device))  # joins a capture's forked stream, too
        self.pending = None
        order = self.owner.order
        if len(self.seen) != len(order) or not all(_same(a, b) for a, b in zip(self.seen, order)):
            self.owner.order = self.seen
            self.owner.learned += 1


def current() -> Session | None:
    """The session of the forward running on this thread, if any."""
    return getattr(_local, "session", None)
