"""One-step-ahead greedy decode: launch step t+1 before reading step t's sampled ids.

A plain decode step ends with a device->host read of the sampled ids, and the host work that
follows (stop tokens and strings, text, scheduling, building the next batch) leaves the GPU idle.
When every running job decodes greedily with nothing that needs the host between tokens (no
filters, banned strings, token bans, probabilities or logits), the next step's inputs are known
on the device: its ids are this step's argmax, its positions and page tables are known on the
host in advance. :class:`DecodePipeline` then

1. launches step t+1 with its input ids copied device-to-device from step t's greedy ids (no host
   round trip; a page a job will need is allocated one step early),
2. reads step t's ids (the one sync of the step) while the device computes step t+1,
3. handles step t's tokens on the host as the plain loop does,
4. *confirms* each job's row of step t+1 (advances ``job.cached`` and registers completed pages,
   exactly what the plain loop does after a forward) or, where step t ended the job, discards the
   row: the job's pages were released with it, and nothing about the speculative token was ever
   recorded, so outputs and cache state equal the plain loop's.

A job that ends by length after step t (``max_new_tokens``, ``max_seq_len``) is known to end and
gets no speculative row. Anything else (a queued job that could be admitted, a prefilling job,
a job that is not plain greedy, too few free pages) drains the pipeline: the in-flight step is
finished normally and the generator continues with its plain step. ``Generator(overlap_decode=False)``
(or the tuning's ``graphs.overlap_decode``) turns the loop off.

On CUDA the step's metadata is built on the host and copied asynchronously. A replayed graph packs
it into one pinned buffer, copied on a staging stream while the step before runs; the ids come from
the step before inside the graph, and the greedy read-back runs on a stream of its own
(:class:`~exl3_core.generator.graphs.DecodeGraphs`). The read waits on an event, so launching step
t+1 never waits for step t. On the CPU the same code runs eagerly.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from exl3_core import ops
from exl3_core.cache.cache import Cache
from exl3_core.generator.batching import Chunk, HostRead, build_batch, gather_rows, meta_to_device
from exl3_core.generator.graphs import DecodeGraphs
from exl3_core.generator.job import Job
from exl3_core.generator.loras import StepLoras
from exl3_core.generator.scheduler import Scheduler
from exl3_core.generator.types import Result
from exl3_core.plan.plan import ExecutionPlan


class PipelineHost(Protocol):
    """What the overlapped loop drives: the generator's jobs, pages, runners and per-job handling."""

    queue: deque[Job]
    active: list[Job]
    max_batch_size: int
    max_seq_len: int
    page_size: int
    table_width: int
    cache: Cache
    graphs: DecodeGraphs | None
    plan: ExecutionPlan
    scheduler: Scheduler
    device: torch.device
    forward_calls: int
    tokens_computed: int
    loras: StepLoras

    def _ensure_pages(self, job: Job, upto: int) -> None: ...

    def _register_pages(self, job: Job) -> None: ...

    def _process_sampled(self, jobs: list[Job], host: list[list[float]], raw_rows: torch.Tensor | None,
                         failed: dict[int, BaseException], results: list[Result]) -> None: ...


def plain_greedy(job: Job, pos: int) -> bool:
    """Whether ``job``'s token at sequence index ``pos`` is the bare argmax with no host-side
    constraint that could change it (the condition to sample it on the device ahead of time)."""
    return (job.sampler.is_greedy and not job.return_probs and not job.return_logits and not job.filters
            and not job.banned_strings and not job.ban_at.get(pos))


@dataclass
class _Row:
    job: Job
    spec: bool  # input id is the previous step's device argmax (not yet known on the host)
    expect_len: int = 0  # spec rows: len(job.seq) once the previous step's token is accepted
    confirmed: bool = False  # job.cached was advanced for this row
    valid: bool = True  # False: the job ended or was cancelled; the row's output is ignored
    hashes_before: int = 0  # len(job.hashes) before confirming (to undo a registration)


@dataclass
class _Flight:
    rows: list[_Row]
    ids: torch.Tensor  # device [B] greedy ids (float64): the next step's input ids
    read: HostRead  # pending copy of packed [2, B] (ids, ok flags)


class DecodePipeline:
    """The overlapped decode loop of one :class:`~exl3_core.generator.Generator` (owns no jobs:
    it drives the generator's own per-job handling and page bookkeeping)."""

    def __init__(self, gen: PipelineHost) -> None:
        self.gen = gen
        self.flight: _Flight | None = None  # the launched step whose ids are not read yet
        self.runs = 0  # pipelines started (each ends in one drain)
        self.launches = 0  # steps launched through the pipeline
        self.spec_launches = 0  # of which launched before the previous step was read
        self.discarded = 0  # speculative rows thrown away (their job ended or was cancelled)
        #: asked before each launch ahead: True drains the loop (the generator's next step is a speculative one)
        self.until: Callable[[], bool] | None = None

    @property
    def busy(self) -> bool:
        return self.flight is not None

    # -- entry points (called by the generator under its lock) ---------------------------------
    def start(self, work: list[tuple[Job, Chunk]], results: list[Result]) -> bool:
        """Run the scheduled decode step ``work`` as the first step of a pipeline; False (nothing
        done) when the step is not eligible and must run the plain way."""
        if not all(len(c.tokens) == 1 and c.want_logits and plain_greedy(j, len(j.seq)) for j, c in work):
            return False
        rows = [_Row(j, spec=False) for j, _ in work]
        flight = self._launch(rows, None, None)
        for r in rows:
            self._confirm(r)
        self.runs += 1
        self._continue(flight, results)
        return True

    def advance(self, results: list[Result]) -> bool:
        """Finish the in-flight step (launching the next one first where possible). True when a
        step is in flight again; False when the pipeline drained (the caller continues plainly)."""
        flight, self.flight = self.flight, None
        if flight is None or not any(r.valid for r in flight.rows):
            return False  # every row's job ended or was cancelled: nothing to read
        self._continue(flight, results)
        return self.flight is not None

    def forget(self, job: Job) -> None:
        """``job`` is being cancelled: undo its in-flight row's bookkeeping so the pages it
        releases are the ones the plain loop would release (its device write lands in a page
        that nothing reads before stream-ordered later steps overwrite it)."""
        if self.flight is None:
            return
        for r in self.flight.rows:
            if r.job is job and r.valid:
                self._undo(r)

    # -- internals -----------------------------------------------------------------------------
    def _continue(self, flight: _Flight, results: list[Result]) -> None:
        try:
            nxt = self._speculate(flight)
        except BaseException:
            # step t's tokens were never read: leave the jobs as if it had not run
            for r in flight.rows:
                if r.valid:
                    self._undo(r)
            raise
        self.flight = nxt
        try:
            self._land(flight, nxt, results)
        except BaseException:
            self.flight = None
            raise

    def _speculate(self, flight: _Flight) -> _Flight | None:
        """Launch the step after ``flight`` from its device ids, or None (drain)."""
        g = self.gen
        if g.scheduler.admissible():
            return None  # a queued job may join: the plain loop admits it first
        live = [(i, r) for i, r in enumerate(flight.rows) if r.valid and r.job.status == "active"]
        if len(live) != len(g.active):
            return None  # a job outside this step (prefilling) needs a mixed step
        if self.until is not None and self.until():
            return None
        rows: list[_Row] = []
        src: list[int] = []
        for i, r in live:
            j = r.job
            n = len(j.seq)
            if j.new_tokens + 1 >= j.max_new_tokens or n + 1 >= g.max_seq_len:
                continue  # its token of step t is its last: no speculative row
            if not plain_greedy(j, n + 1):
                return None
            rows.append(_Row(j, spec=True, expect_len=n + 1))
            src.append(i)
        if not rows:
            return None
        ps = g.page_size
        need = sum(1 for r in rows if math.ceil((r.job.cached + 1) / ps) > len(r.job.pages))
        if need > len(g.cache.allocator.free):
            return None  # never evict prefix-cache pages for a token that may be discarded
        for r in rows:
            g._ensure_pages(r.job, r.job.cached + 1)
        self.spec_launches += 1
        return self._launch(rows, flight, src)

    def _launch(self, rows: list[_Row], prev: _Flight | None, src: list[int] | None) -> _Flight:
        """Queue one decode forward of ``rows`` (each at position ``job.cached``) plus its greedy
        selection and the asynchronous read-back; returns without waiting for the device."""
        g = self.gen
        n = len(rows)
        chunks = [Chunk([0 if r.spec else r.job.seq[-1]], r.job.cached, r.job.pages, True, r.job.ring_slot) for r in rows]
        meta, _ = build_batch(chunks, page_size=g.page_size, table_width=g.table_width,
                              scratch_page=g.cache.scratch_page, device=torch.device("cpu"), decode=True)
        g.loras.select([(r.job, 1) for r in rows], meta.input_ids.shape[0])
        if g.graphs is not None and g.graphs.accepts(meta):
            # the host-built meta goes in one pinned copy; the ids stay on the device (in the graph
            # when the previous step was the bucket's other graph)
            _, packed = g.graphs.run(meta, prev.ids if prev is not None else None, src)
            read = g.graphs.read_back(packed)
        else:
            dmeta = meta_to_device(meta, g.device)
            if prev is not None:
                assert src is not None
                dmeta.input_ids[:n].copy_(gather_rows(prev.ids, src), non_blocking=True)
            packed = ops.greedy_pack(g.plan.forward(dmeta, g.cache))
            read = HostRead(packed)
        g.forward_calls += 1
        g.tokens_computed += n
        self.launches += 1
        return _Flight(rows, packed[0], read)

    def _land(self, flight: _Flight, nxt: _Flight | None, results: list[Result]) -> None:
        """Read ``flight``'s ids, handle them per job, then confirm or discard ``nxt``'s rows."""
        host = flight.read.wait()  # the step's one device->host read
        keep = [i for i, r in enumerate(flight.rows) if r.valid and r.job.status == "active"]
        self.gen._process_sampled([flight.rows[i].job for i in keep],
                                  [[host[0][i] for i in keep], [host[1][i] for i in keep]], None, {}, results)
        if nxt is None:
            return
        for r in nxt.rows:
            if r.job.status == "active" and len(r.job.seq) == r.expect_len:
                self._confirm(r)
            else:
                r.valid = False  # step t ended the job: its speculative token never existed
                self.discarded += 1

    def _confirm(self, r: _Row) -> None:
        """What the plain loop does right after a forward: the input token is now cached."""
        r.hashes_before = len(r.job.hashes)
        r.job.cached += 1
        self.gen._register_pages(r.job)
        r.confirmed = True

    def _undo(self, r: _Row) -> None:
        """Reverse :meth:`_confirm` (prefix-cache registrations included) and drop the row."""
        r.valid = False
        if not r.confirmed:
            return
        r.confirmed = False
        job = r.job
        job.cached -= 1
        alloc = self.gen.cache.allocator
        for i in range(r.hashes_before, len(job.hashes)):
            page = job.pages[i]
            if alloc.refcount[page] == 1 and alloc.page_hash[page] == job.hashes[i]:
                alloc.make_private(page)  # unshared: just forgets the hash
        del job.hashes[r.hashes_before:]
