"""asyncio front end: one owner thread runs the :class:`Generator`; the event loop only sends it
messages and receives its results.

Every mutation of the generator (enqueueing a job, cancelling one, each step) happens on the
owner thread, in the order the messages arrived: a cancel is a message applied between two steps,
never a second thread racing the step loop for a lock. Posting a message is synchronous and cannot
be interrupted, so a consumer task cancelled at any point (client disconnect, timeout, shutdown)
still has its job cancelled and its cache pages freed.

* :meth:`AsyncGenerator.submit` posts the job and awaits the owner's acknowledgement, so a job that
  can never run raises its ``ValueError`` to the caller.
* ``async for result in async_job`` yields the job's results; leaving the loop early (break,
  exception, task cancelled) cancels the job.
* A step that raises ends every job it was running with an ``eos`` result whose ``eos_reason`` is
  ``"error"`` (the exception under ``"error"``), so no consumer waits forever, and their pages are
  freed; the owner thread keeps serving new jobs.
* :meth:`AsyncJob.end` ends a job from the event loop (a request deadline): the consumer gets a
  last ``eos`` result with the given ``eos_reason``.
* :attr:`AsyncGenerator.stats` is a snapshot the owner thread replaces after every step and every
  batch of messages, so readers on other threads never look at the generator while it changes.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from exl3_core.generator.generator import Generator, Result
from exl3_core.generator.job import Job

log = logging.getLogger(__name__)

#: seconds of history behind :attr:`GeneratorStats.tokens_per_s`
RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class GeneratorStats:
    """What the owner thread last saw (replaced as a whole, never mutated)."""

    active_jobs: int = 0
    queued_jobs: int = 0
    steps: int = 0  # steps that ran at least one job
    batched_steps: int = 0  # steps that ran more than one job
    max_batch: int = 0  # most jobs seen in one step
    cancelled: int = 0  # jobs cancelled while queued or running
    failed_steps: int = 0  # steps that raised (their jobs ended with an error)
    prompt_tokens: int = 0  # prompt tokens of admitted jobs
    generated_tokens: int = 0  # tokens sampled for all jobs
    tokens_per_s: float = 0.0  # sampled tokens per second over the last RATE_WINDOW_S
    pages: int = 0
    page_size: int = 0
    pages_in_use: int = 0
    pages_cached: int = 0
    preemptions: int = 0  # jobs paused for cache space and recomputed later


@dataclass
class _Submit:
    job: Job
    ack: asyncio.Future[None]


@dataclass
class _Cancel:
    job: Job
    ack: asyncio.Future[None]


@dataclass
class _Stop:
    ack: asyncio.Future[None]


_Message = _Submit | _Cancel | _Stop


def _resolve(fut: asyncio.Future[None], error: BaseException | None = None) -> None:
    """Complete ``fut`` (on its loop) unless its awaiting task has already given up on it."""
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


class AsyncJob:
    """A job consumed with ``async for result in job``; ends after the ``eos`` result."""

    def __init__(self, agen: AsyncGenerator, job: Job) -> None:
        self.agen = agen
        self.job = job
        self.queue: asyncio.Queue[Result] = asyncio.Queue()
        self.done = False  # the consumer has seen the eos result, or cancelled
        self.finished = False  # an eos result is in the queue

    def __aiter__(self) -> AsyncIterator[Result]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[Result]:
        try:
            while not self.done:
                r = await self.queue.get()
                if r["eos"]:
                    self.done = True
                yield r
        finally:
            # consumer stopped early (break, task cancelled, exception): free the job's pages
            if not self.done:
                self.cancel()

    def end(self, reason: str) -> None:
        """End the job now (e.g. at a deadline): it is cancelled, and its consumer gets a last
        ``eos`` result with ``eos_reason=reason`` after what it has already been sent. Unlike
        cancelling the consuming task, this cannot race with a result arriving at the same time."""
        if self.done or self.finished:
            return
        self.finished = True
        self.agen._post_cancel(self)
        self.queue.put_nowait({"job": self.job, "identifier": self.job.identifier, "eos": True, "text": "",
                               "token_ids": [], "eos_reason": reason, "full_completion": self.job.completion})

    def cancel(self) -> asyncio.Future[None]:
        """Cancel the job: the message is posted before this returns, so the job is cancelled
        even if the caller never awaits the returned future (which completes once the owner
        thread has applied it)."""
        if self.done:
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(None)
            return fut
        self.done = True
        return self.agen._post_cancel(self)


class AsyncGenerator:
    """Wraps a :class:`Generator` whose every call runs on one owner thread (started by the first
    :meth:`submit`, stopped by :meth:`close`)."""

    def __init__(self, generator: Generator | None = None, *args: Any, **kwargs: Any) -> None:
        self.generator = generator if generator is not None else Generator(*args, **kwargs)
        self.jobs: dict[Job, AsyncJob] = {}  # event-loop side only
        self.stats = self._snapshot()
        self._inbox: queue.SimpleQueue[_Message] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        # owner-thread counters (published through ``stats``)
        self._counts = {"steps": 0, "batched_steps": 0, "max_batch": 0, "cancelled": 0, "failed_steps": 0,
                        "prompt_tokens": 0, "generated_tokens": 0}
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    # -- event-loop side --------------------------------------------------------------------------
    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise RuntimeError("AsyncGenerator is closed; create a new one")
        if self._thread is None:
            self._loop = loop
            self._thread = threading.Thread(target=self._main, name="exl3-generator", daemon=True)
            self._thread.start()
        elif loop is not self._loop:
            raise RuntimeError("AsyncGenerator is bound to the event loop of its first submit; use it from that loop")

    async def submit(self, job: Job) -> AsyncJob:
        """Enqueue ``job`` (errors for jobs that can never run are raised here)."""
        self._start()
        assert self._loop is not None
        aj = AsyncJob(self, job)
        ack: asyncio.Future[None] = self._loop.create_future()
        self.jobs[job] = aj
        self._inbox.put(_Submit(job, ack))
        try:
            await ack
        except BaseException:
            # refused (ValueError), or the caller was cancelled while waiting: either way no one
            # will consume this job, and a cancel posted after the submit always finds it
            self.jobs.pop(job, None)
            if not aj.done:
                aj.done = True
                self._inbox.put(_Cancel(job, self._loop.create_future()))
            raise
        return aj

    def _post_cancel(self, aj: AsyncJob) -> asyncio.Future[None]:
        assert self._loop is not None  # an AsyncJob exists only after submit started the owner
        self.jobs.pop(aj.job, None)
        ack: asyncio.Future[None] = self._loop.create_future()
        self._inbox.put(_Cancel(aj.job, ack))
        return ack

    async def cancel(self, aj: AsyncJob) -> None:
        """Cancel ``aj`` and wait until its pages are free."""
        await aj.cancel()

    async def close(self) -> None:
        """End every live job (each consumer gets an ``eos`` result with ``eos_reason``
        ``"cancelled"``) and stop the owner thread."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            return
        assert self._loop is not None
        ack: asyncio.Future[None] = self._loop.create_future()
        self._inbox.put(_Stop(ack))
        await ack
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def _deliver(self, results: list[Result]) -> None:
        """Route one step's results to their consumers (on the event loop)."""
        for r in results:
            aj = self.jobs.get(r["job"])
            if aj is None:
                continue  # cancelled after this step ran
            if r["eos"]:
                del self.jobs[r["job"]]
                aj.finished = True
            aj.queue.put_nowait(r)

    # -- owner thread -----------------------------------------------------------------------------
    def _call_loop(self, fn: Callable[..., object], *args: object) -> bool:
        """Run ``fn(*args)`` on the event loop; False once the loop is gone (interpreter exit)."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            return False
        return True

    def _main(self) -> None:
        gen = self.generator
        if gen.device.type == "cuda" and gen.device.index is not None:
            torch.cuda.set_device(gen.device)  # the current device is per thread; streams and graphs use it
        while True:
            messages: list[_Message] = []
            if not (gen.queue or gen.active):
                try:  # idle: sleep until there is something to do (waking to let the rate decay)
                    messages.append(self._inbox.get(timeout=1.0))
                except queue.Empty:
                    self._publish()
                    continue
            with contextlib.suppress(queue.Empty):
                while True:
                    messages.append(self._inbox.get_nowait())
            for m in messages:
                if isinstance(m, _Stop):
                    self._stop(m)
                    return
                try:
                    self._apply(m)
                except Exception as e:  # the owner thread must outlive any one message
                    log.exception("AsyncGenerator: applying %s failed", type(m).__name__)
                    self._call_loop(_resolve, m.ack, e)
            if messages:
                self._publish()
            if gen.queue or gen.active:
                self._step()

    def _apply(self, m: _Submit | _Cancel) -> None:
        gen = self.generator
        if isinstance(m, _Submit):
            try:
                gen.enqueue(m.job)
            except Exception as e:  # noqa: BLE001 - reported to the submitting coroutine
                self._call_loop(_resolve, m.ack, e)
                return
            self._counts["prompt_tokens"] += len(m.job.prompt)
            self._call_loop(_resolve, m.ack)
            return
        if m.job.status in ("queued", "active"):
            self._counts["cancelled"] += 1
        gen.cancel(m.job)
        self._call_loop(_resolve, m.ack)

    def _step(self) -> None:
        gen = self.generator
        before = {j: j.new_tokens for j in gen.active}
        try:
            results = gen.iterate()
        except Exception as e:  # noqa: BLE001 - a broken step must not strand the waiting consumers
            self._counts["failed_steps"] += 1
            self._fail_all(e)
            self._publish()
            return
        c = self._counts
        # jobs in this step = still active + those it finished (admission failures never ran)
        n = len(gen.active) + sum(1 for r in results if r["eos"] and r["job"].t_admit)
        if n:
            c["steps"] += 1
            c["batched_steps"] += n > 1
            c["max_batch"] = max(c["max_batch"], n)
        stepped = set(before) | set(gen.active) | {r["job"] for r in results}
        sampled = sum(max(0, j.new_tokens - before.get(j, 0)) for j in stepped)  # a rollback can lower it
        if sampled:
            c["generated_tokens"] += sampled
            self._recent.append((time.monotonic(), sampled))
        self._publish()
        if results:
            self._call_loop(self._deliver, results)

    def _fail_all(self, error: BaseException) -> None:
        gen = self.generator
        results: list[Result] = []
        for job in list(gen.queue) + list(gen.active):
            gen.cancel(job)
            results.append({"job": job, "identifier": job.identifier, "eos": True, "text": "", "token_ids": [],
                            "eos_reason": "error", "error": error, "full_completion": job.completion})
        self._call_loop(self._deliver, results)

    def _stop(self, m: _Stop) -> None:
        gen = self.generator
        results: list[Result] = []
        with contextlib.suppress(queue.Empty):  # messages posted after the stop: nothing runs any more
            while True:
                late = self._inbox.get_nowait()
                if isinstance(late, _Submit):
                    self._call_loop(_resolve, late.ack, RuntimeError("AsyncGenerator is closed"))
                else:
                    self._call_loop(_resolve, late.ack)
        for job in list(gen.queue) + list(gen.active):
            gen.cancel(job)
            results.append({"job": job, "identifier": job.identifier, "eos": True, "text": "", "token_ids": [],
                            "eos_reason": "cancelled", "full_completion": job.completion})
        self._publish()
        if self._call_loop(self._deliver, results):
            self._call_loop(_resolve, m.ack)

    def _publish(self) -> None:
        cutoff = time.monotonic() - RATE_WINDOW_S
        while self._recent and self._recent[0][0] < cutoff:
            self._recent.popleft()
        if self._recent:
            span = max(time.monotonic() - self._recent[0][0], 1.0)
            rate = sum(n for _, n in self._recent) / span
        else:
            rate = 0.0
        self.stats = self._snapshot(tokens_per_s=rate, **self._counts)

    def _snapshot(self, **counts: Any) -> GeneratorStats:
        gen = self.generator
        alloc = gen.cache.allocator
        return GeneratorStats(active_jobs=len(gen.active), queued_jobs=len(gen.queue), pages=alloc.num_pages,
                              page_size=alloc.page_size, pages_in_use=alloc.num_live(),
                              pages_cached=alloc.num_cached(), preemptions=gen.scheduler.preemptions, **counts)
