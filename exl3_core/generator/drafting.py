"""Draft proposals for speculative decoding (:mod:`exl3_core.generator.speculative`).

A drafter proposes up to k next tokens for each of a step's sequences; the target model then verifies
them in one forward. Two drafters:

* :class:`NgramDrafter` (prompt lookup): the continuation of the most recent earlier occurrence of the
  sequence's last n tokens (longest n first), in the job's own context, then in an optional corpus. It
  costs host time only and proposes point masses (the proposal is certain).
* :class:`ModelDrafter`: a small model with the same vocabulary, run over its own paged cache. Each
  sequence's draft keys and values are kept between steps; a step runs one decode step of the
  sequence's last two tokens (the second-to-last one is recomputed, so every sequence has the same row
  count and the step is one CUDA-graph bucket whether the last verification accepted everything or
  not) and k - 1 one-token steps, each fed the token sampled from the step before on the device.
  Tokens the draft has not seen (those of plain steps in between) widen that first step: it then feeds
  every sequence the same number of rows (a bucket of :data:`FOLD_ROW_BUCKETS`, at most
  :data:`FOLD_MAX_ROWS`) ending at its last token, re-feeding positions the draft already holds where a
  sequence missed fewer. Only a longer gap (a new prompt) or a sequence shorter than the rows is first
  caught up by an eager prefill.
  Greedy jobs take the draft's argmax; sampled jobs draw from their sampler's distribution over the
  draft's logits, which is returned (``q``) for the acceptance rule. On CUDA the one-token steps of a
  greedy batch replay as one graph (:mod:`exl3_core.generator.draft_chain`).

Neither drafter owns jobs: the speculator calls :meth:`commit` after a verification (the draft keeps
the keys of the drafted tokens the target accepted and frees the pages past them) and :meth:`release`
when a job ends.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.cache.cache import Cache
from exl3_core.cache.pages import CacheExhausted
from exl3_core.generator.batching import Chunk, build_batch, meta_to_device, to_device_async
from exl3_core.generator.draft_chain import DraftChain, advance, shift
from exl3_core.generator.graphs import DecodeGraphs
from exl3_core.generator.job import Job
from exl3_core.generator.loras import StepLoras
from exl3_core.generator.types import BatchModel
from exl3_core.plan.plan import ExecutionPlan
from exl3_core.sampling.sampler import draw, final_logits


@dataclass
class Proposal:
    """Drafted tokens of the jobs one :meth:`Drafter.propose` call was given, in their order: on the host
    (``tokens``), or on the device only (``ids`` and ``lens``), read with the verification's result.

    :param tokens: per job, its drafted ids (fewer than asked, or none, where the drafter has none).
    :param ids: int64 ``[B, K]`` on the device: row b's first ``lens[b]`` entries are job b's drafts.
    :param lens: drafts per job, with ``ids``.
    :param q: float32 ``[B, K, V]`` on the device: row ``b, i`` is the distribution draft i of job b was
        drawn from; None: every proposal is a point mass (greedy drafts, n-gram lookups).
    :param forwards: draft-model forwards that drafted its tokens (the cost model divides its time by them).
    :param catch_up: forwards before those that fed the draft model tokens it had not seen (a new prompt, or
        the tokens of plain steps): their cost follows how much it missed, not the draft length. A short gap
        folded into the first draft step runs no such forward and counts 0.
    """

    tokens: list[list[int]] | None
    ids: torch.Tensor | None = None
    lens: list[int] | None = None
    q: torch.Tensor | None = None
    forwards: int = 0
    catch_up: int = 0

    def count(self, b: int) -> int:
        """Drafts of job b."""
        if self.tokens is not None:
            return len(self.tokens[b])
        assert self.lens is not None
        return self.lens[b]


class Drafter(Protocol):
    """What the speculator needs of a drafter."""

    #: "model" or "ngram" (stats, cost model)
    kind: str

    def available(self, job: Job, k: int) -> int:
        """How many of ``k`` tokens it could propose for ``job`` now (no side effects beyond caching)."""
        ...

    def propose(self, jobs: list[Job], ks: list[int]) -> Proposal:
        """Up to ``ks[b]`` draft tokens after each job's sequence (every ``ks[b] >= 1``)."""
        ...

    def commit(self, job: Job, drafted: list[int]) -> None:
        """After the verification of ``drafted`` (``job``'s drafts, as proposed): keep what its sequence still
        agrees with."""
        ...

    def release(self, job: Job) -> None:
        """``job`` ended: forget it (free its draft pages)."""
        ...


def common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b``, given that the first ``start`` entries agree."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


# -- n-gram (prompt lookup) --------------------------------------------------------------------
@dataclass
class _NgramIndex:
    """For each n, the latest position following each n-gram of one token list (the continuation's start)."""

    sizes: tuple[int, ...]
    tables: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed: int = 0  # continuation starts below this are in the tables
    rollbacks: int = 0  # the job's rollback count the tables were built at

    def update(self, seq: Sequence[int], upto: int) -> None:
        """Index every continuation start ``i < upto`` (the n-grams ending right before i)."""
        for i in range(self.indexed, upto):
            for n in self.sizes:
                if i >= n:
                    self.tables.setdefault(n, {})[tuple(seq[i - n:i])] = i
        self.indexed = max(self.indexed, upto)

    def find(self, key: tuple[int, ...]) -> int | None:
        return self.tables.get(len(key), {}).get(key)


class NgramDrafter:
    """Prompt-lookup drafts: the continuation of the latest earlier occurrence of the sequence's last n
    tokens, for n from ``max_n`` down to ``min_n``, in the job's own tokens first, then in ``corpus``
    (token id sequences, e.g. documents the output is expected to quote)."""

    kind = "ngram"

    def __init__(self, *, max_n: int = 3, min_n: int = 1, corpus: Sequence[Sequence[int]] = ()) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramDrafter: need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.sizes = tuple(range(max_n, min_n - 1, -1))
        self._jobs: dict[Job, _NgramIndex] = {}
        self._corpus = [[int(t) for t in doc] for doc in corpus]
        # n-gram -> (document, continuation start) of its latest occurrence in the corpus
        self._corpus_tables: dict[int, dict[tuple[int, ...], tuple[int, int]]] = {n: {} for n in self.sizes}
        for d, doc in enumerate(self._corpus):
            for i in range(1, len(doc)):
                for n in self.sizes:
                    if i >= n:
                        self._corpus_tables[n][tuple(doc[i - n:i])] = (d, i)

    def _index(self, job: Job) -> _NgramIndex:
        idx = self._jobs.get(job)
        if idx is None or idx.rollbacks != job.rollbacks:  # a rollback may have changed indexed tokens
            idx = self._jobs[job] = _NgramIndex(self.sizes, rollbacks=job.rollbacks)
        idx.update(job.seq, len(job.seq))
        return idx

    def lookup(self, job: Job, k: int) -> list[int]:
        """Up to ``k`` tokens continuing ``job.seq`` (empty: no match)."""
        seq = job.seq
        L = len(seq)
        if k < 1:
            return []
        idx = self._index(job)
        for n in self.sizes:
            if n > L:
                continue
            key = tuple(seq[L - n:])
            i = idx.find(key)
            if i is not None and i < L:
                return list(seq[i:min(i + k, L)])
            hit = self._corpus_tables[n].get(key)
            if hit is not None:
                doc = self._corpus[hit[0]]
                return doc[hit[1]:hit[1] + k]
        return []

    def available(self, job: Job, k: int) -> int:
        return len(self.lookup(job, k))

    def propose(self, jobs: list[Job], ks: list[int]) -> Proposal:
        return Proposal([self.lookup(j, k) for j, k in zip(jobs, ks)])

    def commit(self, job: Job, drafted: list[int]) -> None:
        pass  # the index follows job.seq on its own

    def release(self, job: Job) -> None:
        self._jobs.pop(job, None)


# -- draft model ------------------------------------------------------------------------------
#: most rows per sequence of a first draft step that also feeds tokens the draft missed: a decode step that
#: narrow still costs about one graphed step, while a longer gap is better paid by one eager prefill.
FOLD_MAX_ROWS = 16
#: row counts a widened first draft step is padded to, so that each batch bucket captures few graphs
FOLD_ROW_BUCKETS = (2, 4, 8, 16)


@dataclass
class _DraftSeq:
    tokens: list[int]  # ids whose keys/values the draft cache holds (positions 0..len-1)
    pages: list[int]
    rollbacks: int  # job.rollbacks when ``tokens`` was last checked against job.seq
    drafted_from: int = 0  # len(job.seq) at the latest proposal
    pending: int = 0  # draft length of a proposal not yet committed


class ModelDrafter:
    """Drafts with a small model over its own :class:`~exl3_core.cache.Cache` (see the module docstring).

    :param model: the draft model (loaded; same vocabulary as the target, checked by the speculator).
    :param cache: its cache (allocated here if it is not yet).
    :param max_seq_len: the target's longest sequence (sets the draft's page-table width).
    :param max_chunk_tokens: token budget of one catch-up prefill forward.
    :param plan: the draft's execution plan (default: built here).
    """

    kind = "model"

    def __init__(self, model: BatchModel, cache: Cache, *, max_seq_len: int, max_chunk_tokens: int = 2048,
                 plan: ExecutionPlan | None = None) -> None:
        if not cache.allocated:
            cache.allocate(model.device, model.dtype)
        self.model, self.cache = model, cache
        self.plan = plan if plan is not None else ExecutionPlan(model)
        self.device = torch.device(model.device)
        self.page_size = cache.page_size
        self.table_width = cache.max_pages_per_seq(max_seq_len)
        self.max_chunk_tokens = max_chunk_tokens
        #: CUDA-graph decode runner of the draft's steps (None: eager)
        self.graphs: DecodeGraphs | None = DecodeGraphs.create(self.plan, cache, self.table_width)
        #: adapters on the draft's model (when it is the target itself): its forwards use none, and its graphs are
        #: captured again after adapters are loaded or unloaded
        self.loras = StepLoras(model)
        self.loras.changed(0)
        #: greedy (or forced) one-token steps after the first, replayed as one graph (None: step by step)
        self.chain: DraftChain | None = self._new_chain()
        self._seqs: dict[Job, _DraftSeq] = {}
        self.forward_calls = 0
        self.catch_up_calls = 0  # eager catch-up prefills (among forward_calls)
        self.folded_steps = 0  # first draft steps that also fed tokens the draft had missed

    def _new_chain(self) -> DraftChain | None:
        steps = self.plan.tuning.graphs.draft_chain_steps
        if self.graphs is None or steps < 1:
            return None
        return DraftChain(self.plan, self.cache, self.table_width, steps)

    # -- per-job state -------------------------------------------------------------------------
    def _state(self, job: Job) -> _DraftSeq:
        st = self._seqs.get(job)
        if st is None:
            st = self._seqs[job] = _DraftSeq([], [], job.rollbacks)
        elif st.rollbacks != job.rollbacks:  # a banned-string rollback rewrote part of the sequence
            self._truncate(st, common_prefix(st.tokens, job.seq))
            st.rollbacks = job.rollbacks
        return st

    def _truncate(self, st: _DraftSeq, n: int) -> None:
        del st.tokens[n:]
        keep = math.ceil(n / self.page_size)
        self.cache.allocator.release(st.pages[keep:])
        del st.pages[keep:]

    def available(self, job: Job, k: int) -> int:
        return k if len(job.seq) >= 2 else 0  # the first draft step reads the last two tokens

    def commit(self, job: Job, drafted: list[int]) -> None:
        st = self._seqs.get(job)
        if st is None:
            return
        # the draft steps' inputs after the two last tokens: the drafts but the last (fewer than the draft
        # computed where the job drafted fewer: its cache holds more, but what is not listed counts as stale)
        st.tokens += drafted[:st.pending - 1]
        st.pending = 0
        if st.rollbacks != job.rollbacks:
            self._truncate(st, common_prefix(st.tokens, job.seq))
            st.rollbacks = job.rollbacks
        else:
            self._truncate(st, common_prefix(st.tokens, job.seq, max(0, st.drafted_from - 2)))

    def release(self, job: Job) -> None:
        st = self._seqs.pop(job, None)
        if st is not None:
            self.cache.allocator.release(st.pages)

    # -- drafting ------------------------------------------------------------------------------
    def _adapters_changed(self) -> None:
        """Capture the draft's graphs again where adapters were loaded or unloaded on its model (the target
        itself) since the last proposal."""
        if self.loras.changed(0):
            self.graphs = DecodeGraphs.renew(self.graphs, self.plan, self.cache, self.table_width)
            if self.chain is not None:
                self.chain.reset()
            self.chain = self._new_chain()

    def propose(self, jobs: list[Job], ks: list[int]) -> Proposal:
        self._adapters_changed()
        K = max(ks, default=0)
        keep: list[int] = []  # indices into jobs of those that draft
        for b, job in enumerate(jobs):
            L = len(job.seq)
            if L < 2 or ks[b] < 1:
                continue
            st = self._state(job)
            try:
                need = math.ceil((L + K - 1) / self.page_size) - len(st.pages)
                if need > 0:
                    st.pages += self.cache.allocator.allocate(need)
            except CacheExhausted:
                continue  # the draft cache is full: this job goes without drafts this step
            keep.append(b)
        lens = [0] * len(jobs)
        if not keep or K < 1:
            return Proposal(None, torch.zeros((len(jobs), max(K, 0)), dtype=torch.int64, device=self.device), lens)
        djobs = [jobs[b] for b in keep]
        rows = self._first_rows(djobs)
        catch_up = 0
        if rows is None:  # a long gap, or a sequence too short for the rows: prefill eagerly first
            catch_up = self._catch_up(djobs)
            rows = 2
        elif rows > 2:  # some job missed tokens before its last two
            self.folded_steps += 1
        ids, q = self._draft(djobs, K, rows)
        for b in keep:
            job = jobs[b]
            st = self._seqs[job]
            L = len(job.seq)
            # the first draft step's inputs (st.tokens held at least L - rows); commit() adds the rest
            st.tokens[L - rows:] = job.seq[L - rows:]
            st.drafted_from, st.pending = L, K
            lens[b] = ks[b]
        idx = to_device_async(torch.tensor(keep, dtype=torch.int64), self.device)
        full = torch.zeros((len(jobs), K), dtype=torch.int64, device=self.device).index_copy_(0, idx, ids)
        full_q = None
        if q is not None:
            full_q = torch.zeros((len(jobs), K, q.shape[-1]), dtype=q.dtype, device=q.device).index_copy_(0, idx, q)
        # no read here: the drafts reach the host with the verification's result (one sync per step)
        return Proposal(None, full, lens, full_q, K, catch_up)

    def propose_shifted(self, jobs: list[Job], ks: list[int], by: torch.Tensor,
                        last_two: torch.Tensor) -> Proposal | None:
        """Greedy drafts after sequences the device knows before the host does: job b's sequence will be its
        current one (length L_b, which this drafter's latest proposal drafted after) plus ``by[b] + 1`` tokens,
        ``by[b]`` (device int64 ``[B]``) of them that proposal's first drafts and the last two ``last_two[b]``
        (device int64 ``[B, 2]``). The steps' positions move on the device (no read-back before the launch).
        None, with nothing launched, where a job's draft state is not that proposal's or the cache cannot hold
        the longest outcome; after the launch :meth:`settle` records the sequences once the host has them."""
        self._adapters_changed()
        if not jobs:
            return None
        K = max(ks)
        states = [self._seqs.get(j) for j in jobs]
        if K < 1 or any(st is None or st.drafted_from != len(j.seq) or len(st.tokens) != len(j.seq) or st.pending < 1
                        for j, st in zip(jobs, states)):
            return None
        # the longest outcome: every draft of that proposal accepted, then K draft steps after it
        try:
            for j, st in zip(jobs, states):
                assert st is not None
                need = math.ceil((len(j.seq) + st.pending + K) / self.page_size) - len(st.pages)
                if need > 0:
                    st.pages += self.cache.allocator.allocate(need)
        except CacheExhausted:
            return None
        B = len(jobs)
        dev = self.device
        pages = [st.pages for st in states if st is not None]
        # the first step feeds the last two tokens at positions L + by - 1 and L + by (built for by = 0, moved)
        meta = self._device_meta([Chunk([0, 0], len(j.seq) - 1, pg, True, self._ring(j)) for j, pg in zip(jobs, pages)], by)
        meta.input_ids[:2 * B].copy_(last_two.reshape(-1))
        fb = [self._forced(jobs, [j.seq + [-1] * (m + 1) for j in jobs], K)
              for m in range(max(st.pending for st in states if st is not None) + 1)]
        forced = None
        if fb[0] is not None:
            forced = torch.stack([f.to(dev) for f in fb if f is not None])[by, torch.arange(B, device=dev)]
        rows = torch.arange(1, B + 1, device=dev) * 2 - 1
        self.forward_calls += 1
        self.loras.select([], meta.input_ids.shape[0])
        logits = self._step_meta(meta).index_select(0, rows)
        cur = logits.argmax(-1) if forced is None else forced[:, 0]
        ids = torch.empty((B, K), dtype=torch.int64, device=dev)
        ids[:, 0] = cur
        if K > 1:
            one = self._device_meta([Chunk([0], len(j.seq) + 1, pg, True, self._ring(j)) for j, pg in zip(jobs, pages)], by)
            if not self._run_chain(one, K, cur, forced, ids):
                for i in range(1, K):
                    if i > 1:
                        advance(one, self.page_size)
                    one.input_ids[:B].copy_(cur)
                    self.forward_calls += 1
                    pick = self._step_meta(one)[:B].argmax(-1)
                    cur = pick if forced is None else forced[:, i]
                    ids[:, i] = cur
        return Proposal(None, ids, list(ks), None, K, 0)

    def settle(self, job: Job, drafted: list[int], seq: list[int], k: int) -> None:
        """After :meth:`propose_shifted`: the host now knows ``job``'s sequence ``seq`` (the drafts of the proposal
        before, ``drafted``, as far as they were accepted, and the token after). Records what the draft cache
        holds (as :meth:`commit` and :meth:`propose` would have, keeping the pages the new drafts write)."""
        st = self._seqs[job]
        st.tokens += drafted[:st.pending - 1]
        del st.tokens[common_prefix(st.tokens, seq, max(0, st.drafted_from - 2)):]
        L = len(seq)
        st.tokens[L - 2:] = seq[L - 2:]
        st.drafted_from, st.pending = L, k

    def _ring(self, job: Job) -> int:
        """The job's ring slot in the draft cache (the generator's slots hold in both caches), or -1 where the
        draft cache keeps no rings."""
        return job.ring_slot if self.cache.ring_slots else -1

    def _device_meta(self, chunks: list[Chunk], by: torch.Tensor) -> BatchMeta:
        """Decode inputs of ``chunks`` on the device, each sequence moved on by ``by[b]`` positions."""
        meta, _ = build_batch(chunks, page_size=self.page_size, table_width=self.table_width,
                              scratch_page=self.cache.scratch_page, device=torch.device("cpu"), decode=True)
        meta = meta_to_device(meta, self.device) if self.device.type != "cpu" else meta
        shift(meta, by, self.page_size)
        return meta

    def _step_meta(self, meta: BatchMeta) -> torch.Tensor:
        """Logits of one draft decode step over device inputs ``meta``."""
        graphs = self.graphs
        if graphs is not None and graphs.accepts(meta):
            logits, _ = graphs.run(meta)
            return logits
        return self.plan.forward(meta, self.cache, fp32_logits=False)

    def _first_rows(self, jobs: list[Job]) -> int | None:
        """Rows per sequence of the first draft step: its last two tokens plus what the draft has not seen
        before them, rounded up to a bucket of :data:`FOLD_ROW_BUCKETS`; None where that exceeds
        :data:`FOLD_MAX_ROWS` or a sequence is shorter (the eager catch-up runs first)."""
        need = max((len(j.seq) - len(self._seqs[j].tokens) for j in jobs), default=2)
        rows = next((r for r in FOLD_ROW_BUCKETS if max(need, 2) <= r <= FOLD_MAX_ROWS), None)
        if rows is None or any(len(j.seq) < rows for j in jobs):
            return None
        return rows

    def _catch_up(self, jobs: list[Job]) -> int:
        """Prefill what each job's draft state lacks up to its third-to-last token; returns forwards run."""
        forwards = 0
        while True:
            chunks: list[Chunk] = []
            todo: list[tuple[_DraftSeq, list[int]]] = []
            budget = self.max_chunk_tokens
            for job in jobs:
                st = self._seqs[job]
                end = len(job.seq) - 2
                if len(st.tokens) >= end or budget <= 0:
                    continue
                part = job.seq[len(st.tokens):min(end, len(st.tokens) + budget)]
                chunks.append(Chunk(part, len(st.tokens), st.pages, False, self._ring(job)))
                todo.append((st, part))
                budget -= len(part)
            if not chunks:
                return forwards
            meta, _ = build_batch(chunks, page_size=self.page_size, table_width=self.table_width,
                                  scratch_page=self.cache.scratch_page, device=self.device, decode=False)
            self.loras.select([], meta.input_ids.shape[0])
            self.plan.forward(meta, self.cache)
            self.forward_calls += 1
            self.catch_up_calls += 1
            forwards += 1
            for st, part in todo:
                st.tokens += part

    def _step(self, chunks: list[Chunk], ids: torch.Tensor | None) -> torch.Tensor:
        """Logits of one draft decode step over ``chunks`` (rows ``b*n .. b*n+n-1``); ``ids`` (device, one per
        sequence) replaces the chunks' placeholder input ids of one-token steps."""
        graphs = self.graphs
        meta, _ = build_batch(chunks, page_size=self.page_size, table_width=self.table_width,
                              scratch_page=self.cache.scratch_page,
                              device=torch.device("cpu") if graphs is not None else self.device, decode=True)
        self.forward_calls += 1
        self.loras.select([], meta.input_ids.shape[0])  # drafts come from the draft's own weights
        if graphs is not None and graphs.accepts(meta):
            logits, _ = graphs.run(meta, ids)
            return logits
        if graphs is not None:
            meta = meta_to_device(meta, self.device)
        if ids is not None:
            meta.input_ids[:ids.shape[0]].copy_(ids)
        return self.plan.forward(meta, self.cache, fp32_logits=False)

    def _draft(self, jobs: list[Job], K: int, first_rows: int = 2) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(ids [B, K] int64, q [B, K, V] float32 or None)`` on the device: K tokens after each job's sequence.
        The first step feeds each job its last ``first_rows`` tokens (the draft holds every position before
        them), and its last row's logits give the first draft."""
        B = len(jobs)
        dev = self.device
        sampled = [b for b, j in enumerate(jobs) if not j.sampler.is_greedy]
        samplers = [jobs[b].sampler for b in sampled]
        sampled_idx = to_device_async(torch.tensor(sampled, dtype=torch.int64), dev)
        uniforms = (torch.stack([torch.rand(K, generator=jobs[b].rng, device=dev) if jobs[b].rng is not None
                                 else torch.rand(K, device=dev) for b in sampled]) if sampled else None)
        # penalties see the sequence and the drafts before each position, as the target's will
        W = max((s.history_window() for s in samplers), default=0)
        base = None
        if W:
            base = torch.full((len(sampled), W), -1, dtype=torch.int64)
            for r, b in enumerate(sampled):
                tail = jobs[b].seq[-W:]
                base[r, W - len(tail):] = torch.tensor(tail)
            base = to_device_async(base, dev)
        ids = torch.empty((B, K), dtype=torch.int64, device=dev)
        q = None
        cur: torch.Tensor | None = None
        forced = self._forced(jobs, [j.seq for j in jobs], K)
        for i in range(K):
            if i == 1 and not sampled and self._chain(jobs, K, cur, forced, ids):
                break
            if i == 0:
                R = first_rows
                chunks = [Chunk(j.seq[-R:], len(j.seq) - R, self._seqs[j].pages, True, self._ring(j)) for j in jobs]
                rows = torch.arange(1, B + 1, device=dev) * R - 1
            else:
                chunks = [Chunk([0], len(j.seq) + i - 1, self._seqs[j].pages, True, self._ring(j)) for j in jobs]
                rows = torch.arange(B, device=dev)
            logits = self._step(chunks, cur).index_select(0, rows)
            nxt = logits.argmax(-1)
            if sampled:
                assert uniforms is not None
                hist = None
                if base is not None:
                    hist = torch.cat([base[:, i:], ids.index_select(0, sampled_idx)[:, :i]], 1) if i else base
                x = final_logits(logits.index_select(0, sampled_idx), samplers, history=hist)
                if q is None:
                    q = torch.zeros((B, K, x.shape[-1]), dtype=torch.float32, device=dev)
                q[sampled_idx, i] = torch.softmax(x, -1)
                nxt.index_copy_(0, sampled_idx, draw(x, uniforms[:, i]))
            if forced is not None:
                nxt = forced[:, i]
            ids[:, i] = nxt
            cur = nxt
        return ids, q

    def _chain(self, jobs: list[Job], K: int, first: torch.Tensor | None, forced: torch.Tensor | None,
               ids: torch.Tensor) -> bool:
        """Draft steps 1 .. K-1 of greedy (or forced) ``jobs`` as one replayed chain, writing ``ids[:, 1:]``; False
        (nothing run) when no chain takes them."""
        if self.chain is None or first is None:
            return False
        chunks = [Chunk([0], len(j.seq), self._seqs[j].pages, True, self._ring(j)) for j in jobs]
        meta, _ = build_batch(chunks, page_size=self.page_size, table_width=self.table_width,
                              scratch_page=self.cache.scratch_page, device=torch.device("cpu"), decode=True)
        return self._run_chain(meta, K, first, forced, ids)

    def _run_chain(self, meta: BatchMeta, K: int, first: torch.Tensor, forced: torch.Tensor | None,
                   ids: torch.Tensor) -> bool:
        """Draft steps 1 .. K-1 from the one-token inputs ``meta`` (step 1's, host- or device-built) as one replayed
        chain fed ``first``, writing ``ids[:, 1:]`` for its ``ids.shape[0]`` sequences; False (nothing run) when no
        chain takes them."""
        chain = self.chain
        if chain is None or not chain.accepts(meta, K - 1):
            return False
        self.loras.select([], meta.input_ids.shape[0])
        out = chain.run(meta, first, K - 1, forced[:, 1:] if forced is not None else None)
        ids[:, 1:].copy_(out[:ids.shape[0]])
        self.forward_calls += K - 1
        return True

    def _forced(self, jobs: list[Job], seqs: Sequence[list[int]], K: int) -> torch.Tensor | None:
        """Tokens ``[B, K]`` (device) to propose after ``seqs`` (whose tokens not yet known on the host are -1)
        instead of the draft's own picks, fed to its later steps as a real draft's would be; None: the draft's
        picks. A benchmark's stand-in draft overrides this to set the acceptance rate while paying every forward
        (exl3_core.bench.spec)."""
        return None
