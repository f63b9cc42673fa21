"""Admission, preemption and the per-step token budget of the :class:`~exl3_core.generator.Generator`.

**No accepted job fails for cache space.** A job is refused at enqueue only when it could never
run (its prompt alone does not fit the cache). Otherwise:

* *Admission* takes queued jobs in order of importance (higher :attr:`Job.priority` first, then
  arrival) while the batch has a slot and the cache can hold the job's sequence plus the pages the
  running jobs need for their next token. A queued job of higher priority than a running one may
  pause running jobs of lower priority to get in.
* *Growth*: each step, decoding jobs get the page their next token needs, most important first.
  When no page is left (free or evictable from the prefix cache), the least important running
  job (lowest priority, then newest) is *preempted*: its pages are released and it goes back to
  the queue, keeping everything it generated. Since the most important job can always grow
  (alone it has the whole cache, and a sequence never outgrows it), every job finishes.
* *Resume* recomputes: the job is admitted again with its prompt plus its generated tokens as the
  sequence to prefill, its full pages found again in the prefix cache where they were not yet
  evicted. Its sampler's random generator, text stream, held text and filters are kept, so the
  first token after resuming is drawn exactly as it would have been: greedy and seeded jobs give
  the same output as an unpreempted run.

**Fair chunked prefill.** A step's token budget is shared by decode rows (one token each) and
prefill chunks. While any job decodes, the budget is ``step_tokens`` (a per-device default,
:func:`default_step_tokens`), small enough that a long prompt is prefilled a slice per step while
streams keep producing tokens; prefill always gets at least a quarter of it, so prompts progress
under any decode load. With no stream running, prefill takes up to ``max_chunk_tokens`` per step.
Prefilling jobs share their part shortest-remaining first (a short prompt is not queued behind a
long one), after the most important of them has taken a quarter of it (so a long prompt still
advances every step, however many short ones arrive).
"""
from __future__ import annotations

import math
from collections import deque
from typing import Protocol

import torch

from exl3_core.cache.cache import Cache
from exl3_core.cache.pages import CacheExhausted, page_hashes
from exl3_core.generator.batching import Chunk
from exl3_core.generator.job import Job
from exl3_core.generator.types import Result

#: per-step token budget while jobs decode, by device type: on CUDA a 512-token chunk costs a few
#: decode steps of an 8B model, on a CPU each prefill token costs about a twentieth of a decode step
STEP_TOKENS = {"cuda": 512, "cpu": 24}


def default_step_tokens(device: torch.device) -> int:
    """The per-step token budget while jobs decode on ``device`` (see the module docstring)."""
    return STEP_TOKENS.get(device.type, STEP_TOKENS["cuda"])


class SchedulerHost(Protocol):
    """What the scheduler drives: the generator's queue, running jobs, cache and job life cycle."""

    queue: deque[Job]
    active: list[Job]
    max_batch_size: int
    max_chunk_tokens: int
    page_size: int
    cache: Cache
    ring_slots: int
    ring_free: list[int]
    ring_caches: list[Cache]

    def _start(self, job: Job) -> None: ...

    def _release(self, job: Job) -> None: ...

    def _ensure_pages(self, job: Job, upto: int) -> None: ...

    def _fail(self, job: Job, err: BaseException, results: list[Result]) -> None: ...


def importance(job: Job) -> tuple[int, int]:
    """Sort key: most important first (higher priority, then earlier arrival)."""
    return -job.priority, job.arrival


class Scheduler:
    """The policy above for one generator (it owns no jobs: they stay in the host's queue and
    active list, which it keeps ordered)."""

    def __init__(self, host: SchedulerHost, step_tokens: int) -> None:
        if step_tokens < 1:
            raise ValueError(f"Generator: step_tokens={step_tokens} must be positive")
        self.host = host
        self.step_tokens = step_tokens
        self.preemptions = 0  # jobs paused for cache space, all time
        self._arrivals = 0

    # -- queue ----------------------------------------------------------------------------------
    def push(self, job: Job) -> None:
        """Queue ``job`` in order of importance (a new job gets the next arrival number)."""
        q = self.host.queue
        if not job.arrival:  # a preempted job keeps its place among equal priorities
            self._arrivals += 1
            job.arrival = self._arrivals
        job.status = "queued"
        key = importance(job)
        i = len(q)
        while i > 0 and importance(q[i - 1]) > key:
            i -= 1
        q.insert(i, job)

    # -- admission ------------------------------------------------------------------------------
    def admit(self, results: list[Result]) -> None:
        """Move queued jobs into the batch while they fit (see the module docstring)."""
        g = self.host
        while g.queue:
            job = g.queue[0]
            if len(g.active) >= g.max_batch_size and not self._make_room(job):
                return
            if not self._place(job):
                if self._make_room(job):
                    continue  # pages were freed for it: try again
                if not g.active:  # cannot happen (enqueue refuses what cannot fit alone): fail loudly
                    g.queue.popleft()
                    g._fail(job, CacheExhausted(f"{job!r} does not fit the empty cache"), results)
                    continue
                return  # wait for running jobs to finish or be preempted
            g.queue.popleft()
            resumed = job.t_admit > 0
            if not resumed:
                job.cached_tokens = job.cached
                g._start(job)
            job.status = "active"
            if g.ring_slots:
                job.ring_slot = g.ring_free.pop()  # the generator checked there are enough for its batch
                for c in g.ring_caches:
                    c.clear_ring(job.ring_slot)
            g.active.append(job)

    def admissible(self) -> bool:
        """Whether the queue's first job would join the batch now: the overlapped decode loop drains
        for it (checked without taking pages)."""
        g = self.host
        if not g.queue:
            return False
        job = g.queue[0]
        if any(j.priority < job.priority for j in g.active):
            return True
        if len(g.active) >= g.max_batch_size:
            return False
        alloc = g.cache.allocator
        ps = g.page_size
        if job.prompt_hashes is None:
            job.prompt_hashes = page_hashes(job.seq, ps, max_pages=(len(job.seq) - 1) // ps, root=job.hash_root)
        need = math.ceil(len(job.seq) / ps) - alloc.peek_prefix(job.prompt_hashes)
        return need + self._reserve() <= alloc.num_available()

    def _reserve(self) -> int:
        """Pages the running jobs take in the next step (a decoding job at a page boundary)."""
        ps = self.host.page_size
        return sum(1 for j in self.host.active if j.prefill_done and math.ceil((j.cached + 1) / ps) > len(j.pages))

    def _place(self, job: Job) -> bool:
        """Give ``job`` the pages of its whole sequence (prefix-cache hits first); False (nothing
        taken) when that would leave fewer pages than the running jobs need next."""
        alloc = self.host.cache.allocator
        ps = self.host.page_size
        n = len(job.seq)
        # never share the page holding the last token: it must be run for logits
        if job.prompt_hashes is None:  # computed once, even if the job waits several steps
            job.prompt_hashes = page_hashes(job.seq, ps, max_pages=(n - 1) // ps, root=job.hash_root)
        hashes = job.prompt_hashes
        matched = alloc.match_prefix(hashes)
        need = math.ceil(n / ps) - len(matched)
        if need + self._reserve() > alloc.num_available():
            alloc.release(matched)
            alloc.hits -= len(matched)  # not a hit: the pages were handed back
            return False
        job.pages = matched + alloc.allocate(need)
        job.hashes = hashes[:len(matched)]
        job.cached = len(matched) * ps
        return True

    def _make_room(self, job: Job) -> bool:
        """Preempt the least important running job if it is less important than the queued
        ``job`` by priority (arrival alone never displaces a running job); True if one was."""
        g = self.host
        lower = [j for j in g.active if j.priority < job.priority]
        if not lower:
            return False
        self.preempt(max(lower, key=importance))
        return True

    # -- one step -------------------------------------------------------------------------------
    def preempt(self, job: Job) -> None:
        """Pause running ``job``: release its pages and queue it again with what it generated, to be
        recomputed when it is admitted again."""
        self.host._release(job)
        job.cached = 0
        job.hashes = []
        job.prompt_hashes = None
        job.preemptions += 1
        self.preemptions += 1
        self.push(job)

    def _grow(self) -> None:
        """Each decoding job gets the page for its next token, most important first; when the cache
        is out of pages the least important running job is preempted (possibly the one asking)."""
        g = self.host
        for job in sorted((j for j in g.active if j.prefill_done), key=importance):
            while job.status == "active":
                try:
                    g._ensure_pages(job, job.cached + 1)
                    break
                except CacheExhausted:
                    self.preempt(max(g.active, key=importance))

    def budget(self, rows: int) -> int:
        """Prefill tokens of a step that carries ``rows`` decode rows."""
        if rows == 0:
            return self.host.max_chunk_tokens
        step = min(self.step_tokens, self.host.max_chunk_tokens)
        return max(step - rows, max(1, step // 4))

    def plan(self) -> list[tuple[Job, Chunk]]:
        """This step's work: every decoding job's pending token, then prefill chunks within the
        budget (in the running jobs' order)."""
        g = self.host
        self._grow()
        rows = {j: Chunk([j.seq[-1]], j.cached, j.pages, True, j.ring_slot) for j in g.active if j.prefill_done}
        prefilling = [j for j in g.active if not j.prefill_done]
        left = self.budget(len(rows))
        take: dict[Job, int] = {}
        if prefilling:  # the most important prompt advances every step, by a quarter of the budget at least
            first = min(prefilling, key=importance)
            take[first] = min(len(first.seq) - first.cached, max(1, left // 4))
            left -= take[first]
        for job in sorted(prefilling, key=lambda j: (len(j.seq) - j.cached, importance(j))):  # shortest first
            n = min(len(job.seq) - job.cached - take.get(job, 0), left)
            if n > 0:
                take[job] = take.get(job, 0) + n
                left -= n
        out: list[tuple[Job, Chunk]] = [(j, c) for j, c in rows.items()]
        for job in prefilling:
            n = take.get(job, 0)
            if n:
                want = job.cached + n == len(job.seq)
                out.append((job, Chunk(job.seq[job.cached:job.cached + n], job.cached, job.pages, want, job.ring_slot)))
        return out
