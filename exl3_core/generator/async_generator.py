"""asyncio front end: ``AsyncGenerator`` runs the step loop in a worker thread and routes each
result to its ``AsyncJob``'s queue; cancelling the consuming task cancels the job.

A step that raises ends every job it was running with an ``eos`` result whose ``eos_reason`` is
``"error"`` (the exception under ``"error"``), so no consumer waits forever, and their pages are
freed. Cancelling waits for the generator lock (held for a whole step) in a thread, never on the
event loop."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from exl3_core.generator.generator import Generator, Result
from exl3_core.generator.job import Job


class AsyncJob:
    """A job consumed with ``async for result in job``; ends after the ``eos`` result."""

    def __init__(self, agen: AsyncGenerator, job: Job) -> None:
        self.agen = agen
        self.job = job
        self.queue: asyncio.Queue[Result] = asyncio.Queue()
        self.done = False

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
                await self.cancel()

    async def cancel(self) -> None:
        self.done = True
        await self.agen.cancel(self)


class AsyncGenerator:
    """Wraps a :class:`Generator`; one background task steps it while any job is alive."""

    def __init__(self, generator: Generator | None = None, *args: Any, **kwargs: Any) -> None:
        self.generator = generator if generator is not None else Generator(*args, **kwargs)
        self.jobs: dict[int, AsyncJob] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    async def submit(self, job: Job) -> AsyncJob:
        """Enqueue ``job`` (errors for jobs that can never run are raised here)."""
        aj = AsyncJob(self, job)
        self.generator.enqueue(job)
        self.jobs[id(job)] = aj
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return aj

    def _iterate(self) -> list[Result]:
        """One generator step (runs in a worker thread); subclasses may wrap it."""
        return self.generator.iterate()

    def _fail_all(self, error: BaseException) -> None:
        """End every live job with an error result (the step that raised holds no lock any more)."""
        for key, aj in list(self.jobs.items()):
            self.generator.cancel(aj.job)
            del self.jobs[key]
            aj.queue.put_nowait({"job": aj.job, "identifier": aj.job.identifier, "eos": True, "text": "",
                                 "token_ids": [], "eos_reason": "error", "error": error,
                                 "full_completion": aj.job.completion})

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.jobs:
            try:
                # the forward pass runs in a thread so the event loop keeps serving other tasks
                results = await loop.run_in_executor(None, self._iterate)
            except Exception as e:  # noqa: BLE001 - a broken step must not strand the waiting consumers
                self._fail_all(e)
                return
            for r in results:
                aj = self.jobs.get(id(r["job"]))
                if aj is None:
                    continue
                if r["eos"]:
                    del self.jobs[id(r["job"])]
                aj.queue.put_nowait(r)
            if not results:
                await asyncio.sleep(0)

    async def cancel(self, aj: AsyncJob) -> None:
        self.jobs.pop(id(aj.job), None)
        # Generator.cancel takes the generator lock, held for a whole step: wait for it in a thread
        await asyncio.get_running_loop().run_in_executor(None, self.generator.cancel, aj.job)

    async def close(self) -> None:
        for aj in list(self.jobs.values()):
            await aj.cancel()
        if self._task is not None:
            await self._task
