"""``Generator``: continuous batching over a paged cache with prefix reuse.

Each :meth:`Generator.iterate` call is one model forward:

1. admit queued jobs (by priority, then arrival) while the batch has room and the cache can hold
   their prompts; a prompt's leading full pages are taken from the prefix cache when their hash
   chain matches;
2. schedule: every decoding job contributes its one pending token (a job is preempted and later
   recomputed when the cache runs out of pages), then prefilling jobs take chunks of their prompts
   from what is left of the step's token budget (:mod:`exl3_core.generator.scheduler`);
3. run one forward (a fixed-shape padded decode step when every job decodes, else a packed
   mixed step) while filter masks are computed on a worker thread where filters ask for it;
4. sample all jobs that need a token in one vectorised call; the ids (and, only when asked,
   probabilities and logits) are the single device-to-host read of the step;
5. per job: stop tokens, held-back text for stop strings/banned strings (with rollback),
   filters, length limits; finished jobs release their pages, whose full pages stay in the
   prefix cache.

When every job decodes greedily with no host-side constraint, steps run one ahead instead
(:mod:`exl3_core.generator.overlap`): step t+1 is launched from step t's ids on the device before
step t's ids are read and handled, which hides this host work behind the device's forward.

With a draft model or n-gram drafting, a decode step may verify drafted tokens instead, several per
job (:mod:`exl3_core.generator.speculative`); the overlapped loop drains for it.

A failure that concerns one job (every token excluded, a filter raising, NaN logits) ends that job
with ``eos_reason="error"`` and leaves the others running. Running out of cache pages is never one:
a job that could never fit is refused at enqueue, any other waits or is preempted.
"""
from __future__ import annotations

import gc
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from exl3_core.cache.cache import Cache
from exl3_core.cache.pages import CacheExhausted, chain_hash
from exl3_core.generator.batching import Chunk, build_batch, meta_to_device
from exl3_core.generator.graphs import DecodeGraphs, PrefillGraphs, freeze_long_lived
from exl3_core.generator.job import Job
from exl3_core.generator.loras import StepLoras
from exl3_core.generator.overlap import DecodePipeline
from exl3_core.generator.scheduler import Scheduler, default_step_tokens
from exl3_core.generator.speculative import Speculator
from exl3_core.generator.stop import HeldText, TextStream
from exl3_core.generator.types import BatchModel, NumericFault, Result
from exl3_core.plan.plan import ExecutionPlan
from exl3_core.sampling.sampler import sample
from exl3_core.tuning import Tuning

log = logging.getLogger(__name__)


class JobError(RuntimeError):
    """A job ended with an error (raised by :meth:`Generator.generate`)."""


class Generator:
    """Runs many :class:`Job` s concurrently on one model and cache.

    :param model: a loaded model (:class:`~exl3_core.generator.types.BatchModel`: an exl3
        :class:`~exl3_core.archkit.model.Model`, or anything with its batch forward).
    :param cache: a :class:`~exl3_core.cache.Cache` built for the model (allocated here if it is not yet).
    :param tokenizer: needed for text output, stop/banned strings and string prompts
        (default ``model.tokenizer`` when present).
    :param max_batch_size: most jobs decoding at once.
    :param max_chunk_tokens: most tokens of one forward (prefill chunks when no job decodes).
    :param step_tokens: token budget of a step while jobs decode, shared by the decode rows and
        prefill chunks (None: :func:`~exl3_core.generator.scheduler.default_step_tokens` of the
        device); smaller keeps streams smoother while long prompts are prefilled.
    :param max_seq_len: longest sequence (prompt + output); sets the page-table width (whole pages).
    :param overlap_decode: run plain greedy decode one step ahead (see
        :mod:`exl3_core.generator.overlap`); None: the tuning's ``graphs.overlap_decode`` (on).
    :param tuning: what the execution plan and the CUDA graphs may do (default: the device's).
    :param draft_model: speculative decoding with this draft model (same vocabulary and tokenizer, loaded on
        the same device; see :mod:`exl3_core.generator.speculative`); needs ``draft_cache``.
    :param draft_cache: the draft model's :class:`~exl3_core.cache.Cache`, at least as large as ``cache``.
    :param num_draft_tokens: most tokens drafted per sequence and step (draft model).
    :param ngram_draft_tokens: speculative decoding without a draft model: up to this many tokens continuing
        the latest earlier occurrence of the sequence's last n tokens (0: off).
    :param ngram_corpus: token id sequences the n-gram lookup also searches.
    :param dynamic_draft: adapt each sequence's draft length to its acceptance and the measured costs (no
        drafts where they would not pay); False: always the most.
    :param draft_tokenizer: the draft model's tokenizer, compared with ``tokenizer`` (default
        ``draft_model.tokenizer`` when present).
    """

    def __init__(self, model: BatchModel, cache: Cache, tokenizer: Any = None, *, max_batch_size: int = 64,
                 max_chunk_tokens: int = 2048, max_seq_len: int | None = None, plugins: Any = None,
                 overlap_decode: bool | None = None, tuning: Tuning | None = None,
                 draft_model: BatchModel | None = None, draft_cache: Cache | None = None, num_draft_tokens: int = 4,
                 ngram_draft_tokens: int = 0, ngram_corpus: Sequence[Sequence[int]] = (), dynamic_draft: bool = True,
                 draft_tokenizer: Any = None, step_tokens: int | None = None) -> None:
        if max_batch_size < 1 or max_chunk_tokens < 1:
            raise ValueError(f"Generator: max_batch_size={max_batch_size} and max_chunk_tokens={max_chunk_tokens} "
                             f"must be positive")
        self.model = model
        self.cache = cache
        if not cache.allocated:
            cache.allocate(model.device, model.dtype)
        #: how the model's forward runs (fused forms, with the reasons for each)
        self.plan = ExecutionPlan(model, tuning)
        self.tuning = self.plan.tuning
        self.tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        self.plugins = plugins
        self.max_batch_size = max_batch_size
        self.max_chunk_tokens = max_chunk_tokens
        #: ring slots of per-sequence state an active job holds, valid in every cache that keeps rings (the draft
        #: model's too); slot 0 is the scratch slot padded rows use; 0: no cache keeps rings
        self.ring_slots = min((c.ring_slots for c in (cache, draft_cache) if c is not None and c.ring_slots),
                              default=0)
        # each active job holds a private page at least, so no more than the cache's pages run at once
        if self.ring_slots and min(max_batch_size, cache.num_pages) > self.ring_slots - 1:
            which = "cache" if self.ring_slots == cache.ring_slots else "draft_cache"
            raise ValueError(f"Generator: max_batch_size={max_batch_size}, but the {which} keeps recent rows for "
                             f"{self.ring_slots - 1} sequences at once; create the Cache with "
                             f"recent_seqs={max_batch_size} (or recent=0), or lower max_batch_size")
        #: free ring slots, and the caches whose rings a job's slot indexes
        self.ring_free: list[int] = list(range(self.ring_slots - 1, 0, -1))
        self.ring_caches: list[Cache] = [c for c in (cache, draft_cache) if c is not None and c.ring_slots]
        self.page_size = cache.page_size
        self.table_width = cache.max_pages_per_seq(max_seq_len)
        # the page table holds whole pages; a sequence still ends at the length asked for
        self.max_seq_len = self.table_width * self.page_size
        if max_seq_len is not None:
            self.max_seq_len = min(self.max_seq_len, max_seq_len)
        self.device = torch.device(model.device)
        #: admission, preemption and the per-step token budget
        self.scheduler = Scheduler(self, step_tokens if step_tokens is not None else default_step_tokens(self.device))
        self.vocab_size = self._vocab_size()
        eos = model.config.eos_token_ids() if hasattr(model, "config") else []
        tok_eos = getattr(self.tokenizer, "eos_token_ids", None) or []
        self.eos_ids = set(eos) | set(tok_eos)
        self.queue: deque[Job] = deque()
        self.active: list[Job] = []
        self.lock = threading.RLock()
        self._pool: ThreadPoolExecutor | None = None
        self.tokens_computed = 0  # tokens run through the model (prefix-cache hits are not)
        self.forward_calls = 0
        #: CUDA-graph decode runner (None: eager; see exl3_core.generator.graphs for when)
        self.graphs: DecodeGraphs | None = DecodeGraphs.create(self.plan, cache, self.table_width)
        #: CUDA-graph runner for a step that is one sequence's prefill chunk (None: eager)
        self.prefill_graphs: PrefillGraphs | None = PrefillGraphs.create(
            self.plan, cache, self.table_width, max_chunk_tokens)
        if overlap_decode is None:
            overlap_decode = self.tuning.graphs.overlap_decode
        #: one-step-ahead greedy decode loop (None: off)
        self.pipeline: DecodePipeline | None = DecodePipeline(self) if overlap_decode else None
        #: speculative decoding (None: off); ``spec.stats`` counts drafted and accepted tokens
        self.spec: Speculator | None = Speculator.create(
            self, model=model, tokenizer=self.tokenizer, draft_model=draft_model, draft_cache=draft_cache,
            draft_tokenizer=draft_tokenizer, num_draft_tokens=num_draft_tokens, ngram_draft_tokens=ngram_draft_tokens,
            ngram_corpus=ngram_corpus, dynamic_draft=dynamic_draft, max_chunk_tokens=max_chunk_tokens)
        if self.spec is not None and self.pipeline is not None:
            self.pipeline.until = self.spec.wants_step
        #: LoRA adapters: per-job checks, per-step row choices, graphs dropped when adapters change
        self.loras = StepLoras(model)
        self.loras.refresh(self, self._rows_per_seq())
        if self.device.type == "cuda":
            gc.unfreeze()  # what an earlier generator froze may be garbage now: the next collection may free it

    def _rows_per_seq(self) -> int:
        """Most rows per sequence of a decode step on the model (speculative verification included)."""
        return self.spec.rows_per_seq(self.model) if self.spec is not None else 1

    def _vocab_size(self) -> int | None:
        v = getattr(self.model, "vocab_size", None)
        if v is None and hasattr(self.model, "config"):
            hf = getattr(self.model.config, "hf", None)
            v = getattr(hf, "vocab_size", None)
        return v

    # -- public API -------------------------------------------------------------------------------
    def enqueue(self, job: Job | Sequence[Job]) -> None:
        """Queue a job (or several). Raises ``ValueError`` for a job that can never run."""
        jobs = [job] if isinstance(job, Job) else list(job)
        for j in jobs:
            if j.status != "new":
                raise ValueError(f"{j!r} was already enqueued; create a new Job")
            n = len(j.prompt)
            if n >= self.max_seq_len or n >= self.cache.max_num_tokens:
                raise ValueError(
                    f"prompt of {n} tokens does not fit: the generator holds at most {self.max_seq_len - 1} prompt tokens "
                    f"(cache of {self.cache.max_num_tokens} tokens, max_seq_len={self.max_seq_len}); "
                    f"shorten the prompt or create the Cache/Generator with a larger max_num_tokens/max_seq_len")
            if self.vocab_size is not None:
                j.sampler.check_vocab(self.vocab_size)
                bad = [t for t in j.prompt if not 0 <= t < self.vocab_size]
                if bad:
                    raise ValueError(f"prompt token id(s) {bad[:8]} outside the model vocabulary [0, {self.vocab_size})")
            if (j.stop_strings or j.banned_strings) and self.tokenizer is None:
                raise ValueError("stop strings and banned strings need a tokenizer; pass tokenizer= to Generator")
        with self.lock:
            for j in jobs:
                self.loras.check(j)
            for j in jobs:
                self.loras.bind(j)
                j.t_enqueue = time.perf_counter()
                self.scheduler.push(j)

    def cancel(self, job: Job) -> None:
        """Stop a queued or running job now and free its pages (no further results)."""
        with self.lock:
            if job in self.queue:
                self.queue.remove(job)
            elif job in self.active:
                if self.pipeline is not None:
                    self.pipeline.forget(job)
                self._release(job)
            if job.status not in ("done",):
                job.status = "cancelled"

    def capture_graphs(self) -> list[int]:
        """Capture the decode graph of every batch bucket this generator can step (up to
        ``max_batch_size``) now, rather than at each bucket's first step. A capture costs a few
        hundred ms (seconds where a new shape compiles Triton kernels), so a server does this at
        start-up and no step stalls later when its batch grows or shrinks past a bucket. With speculative
        decoding the verification and draft steps' buckets are captured too. Then the objects alive are
        frozen out of later garbage collections on CUDA (:func:`~exl3_core.generator.graphs.freeze_long_lived`),
        so no full collection stalls a step. Returns the captured (one-token) buckets ([] when decode runs
        eagerly). Only while no job is running."""
        with self.lock:
            if self.queue or self.active:
                raise RuntimeError("Generator.capture_graphs: jobs are queued or running; call it before enqueueing")
            self.loras.refresh(self, self._rows_per_seq())
            if self.spec is not None:
                self.spec.capture_graphs(self.max_batch_size)
            buckets = self.graphs.capture_buckets(self.max_batch_size) if self.graphs is not None else []
            freeze_long_lived(self.device)
            return buckets

    def num_remaining(self) -> int:
        with self.lock:
            return len(self.queue) + len(self.active)

    def clear_queue(self) -> None:
        with self.lock:
            for j in list(self.queue) + list(self.active):
                self.cancel(j)

    def iterate(self) -> list[Result]:
        """Run one step; returns this step's results (one dict per job that produced output).

        With the overlapped decode loop the next step may already be running on the device when
        this returns; a call that drains it returns the results of that step and of the next.
        """
        with self.lock:
            results: list[Result] = []
            self._sync_loras(results)
            if self.pipeline is not None and self.pipeline.busy and self.pipeline.advance(results):
                return results
            self.scheduler.admit(results)
            if not self.active:
                return results
            self._step(results)
            return results

    def generate(self, prompt: str | Sequence[str] | torch.Tensor, *, max_new_tokens: int = 256, sampler: Any = None,
                 seed: int | None = None, stop_conditions: Sequence[int | str] = (), add_bos: bool | None = None,
                 completion_only: bool = True, **job_kwargs: Any) -> str | list[str]:
        """Generate for one prompt or a list of prompts (greedy when ``sampler`` is None)."""
        single = isinstance(prompt, (str, torch.Tensor))
        prompts: list[Any] = [prompt] if single else list(prompt)  # type: ignore[list-item]
        jobs = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("generate(prompt=str) needs a tokenizer; pass tokenizer= to Generator")
                ids = self.tokenizer.encode(p, add_bos=add_bos)
            else:
                ids = p
            jobs.append(Job(ids, max_new_tokens=max_new_tokens, sampler=sampler,
                            seed=None if seed is None else seed + i, stop_conditions=stop_conditions,
                            identifier=i, plugins=self.plugins, **job_kwargs))
        self.enqueue(jobs)
        done: dict[int, str] = {}
        try:
            while len(done) < len(jobs):
                for r in self.iterate():
                    if r["eos"]:
                        if r.get("error") is not None:
                            raise JobError(f"job {r['identifier']} failed: {r['error']}") from r["error"]
                        done[r["identifier"]] = r["full_completion"]
                if not self.num_remaining() and len(done) < len(jobs):
                    raise RuntimeError("generator ran out of work before every job finished")
        except BaseException:
            for j in jobs:
                self.cancel(j)
            raise
        outs = [done[i] if completion_only or not isinstance(prompts[i], str) else prompts[i] + done[i]
                for i in range(len(jobs))]
        return outs[0] if single else outs

    def load_lora(self, path: str, name: str | None = None) -> str:
        """``model.load_lora`` between two steps (safe while another thread iterates); running jobs go on."""
        with self.lock:
            return self.model.load_lora(path, name)  # type: ignore[attr-defined,no-any-return]

    def unload_lora(self, name: str) -> None:
        """``model.unload_lora`` between two steps; jobs naming the adapter end with an error at the next step."""
        with self.lock:
            self.model.unload_lora(name)  # type: ignore[attr-defined]

    def _sync_loras(self, results: list[Result]) -> None:
        """Adapters loaded or unloaded since the last step: graphs captured with the old ones are dropped, and
        jobs naming an adapter no longer loaded end with an error (the others go on)."""
        self.loras.refresh(self, self._rows_per_seq())
        for job, err in self.loras.unloaded([*self.queue, *self.active]):
            if job in self.queue:
                self.queue.remove(job)
            elif self.pipeline is not None:
                self.pipeline.forget(job)
            self._fail(job, err, results)

    # -- admission and pages -------------------------------------------------------------------
    def _start(self, job: Job) -> None:
        """Per-job state of a first admission (a resumed job keeps its own)."""
        job.rng = torch.Generator(device=self.device).manual_seed(job.seed)
        if self.tokenizer is not None:
            job.stream = TextStream(self.tokenizer)
        job.held = HeldText(job.stop_strings, job.banned_strings)
        for f in job.filters:
            f.attach()
        job.t_admit = time.perf_counter()

    def _ensure_pages(self, job: Job, upto: int) -> None:
        need = math.ceil(upto / self.page_size) - len(job.pages)
        if need > 0:
            job.pages += self.cache.allocator.allocate(need)

    def _register_pages(self, job: Job) -> None:
        """Hash the job's newly completed full pages into the prefix cache."""
        ps = self.page_size
        alloc = self.cache.allocator
        for i in range(len(job.hashes), job.cached // ps):
            prev = job.hashes[-1] if job.hashes else job.hash_root
            h = chain_hash(prev, job.seq[i * ps:(i + 1) * ps])
            job.pages[i] = alloc.register(job.pages[i], h)
            job.hashes.append(h)

    def _truncate_cache(self, job: Job) -> None:
        """After a rollback: make the pages that will be overwritten private, drop the rest."""
        ps = self.page_size
        alloc = self.cache.allocator
        keep = math.ceil(job.cached / ps)
        alloc.release(job.pages[keep:])
        del job.pages[keep:]
        del job.hashes[job.cached // ps:]
        if job.cached % ps:
            i = job.cached // ps
            page, copy = alloc.make_private(job.pages[i])
            if copy:
                self.cache.copy_page(job.pages[i], page)
            job.pages[i] = page

    def _release(self, job: Job) -> None:
        if job in self.active:
            self.active.remove(job)
        if job.ring_slot >= 0:
            self.ring_free.append(job.ring_slot)
            job.ring_slot = -1
        self.cache.allocator.release(job.pages)
        job.pages = []
        if self.spec is not None:
            self.spec.release(job)

    # -- one step -----------------------------------------------------------------------------
    def _step(self, results: list[Result]) -> None:
        work = self.scheduler.plan()
        if not work:
            return
        decode = all(len(c.tokens) == 1 for _, c in work)
        if decode and self.spec is not None and self.spec.step(work, results):
            return
        if decode and self.pipeline is not None and self.pipeline.start(work, results):
            return
        for part in self._graph_parts(work, decode):
            self._run(part, all(len(c.tokens) == 1 for _, c in part), results)

    def _graph_parts(self, work: list[tuple[Job, Chunk]], decode: bool) -> list[list[tuple[Job, Chunk]]]:
        """``work`` as one forward, or split into its decode rows and its one prefill chunk, run one
        after the other, when each part replays a CUDA graph: an eager mixed forward pays the host's
        launch cost of every kernel (~30 ms for an 8B-shape model, whatever the chunk's length), two
        replays only their device time. The price is one more pass over the weights, a few percent of a
        long chunk's forward."""
        if decode or self.graphs is None:
            return [work]
        rows = [(j, c) for j, c in work if j.prefill_done]
        chunk = [(j, c) for j, c in work if not j.prefill_done]
        if not rows or len(chunk) != 1 or len(rows) > self.graphs.max_bucket:
            return [work]
        return [rows, chunk] if self._prefill_replays(chunk[0][1]) else [work]

    def _prefill_replays(self, c: Chunk) -> bool:
        """Whether the prefill chunk ``c``, run alone, replays a prefill graph."""
        g = self.prefill_graphs
        return g is not None and g.bucket(len(c.tokens), c.past, len(c.pages)) is not None

    def _run(self, work: list[tuple[Job, Chunk]], decode: bool, results: list[Result]) -> None:
        """One forward over ``work`` (a replayed graph where one applies), then sampling."""
        sampling = [j for j, c in work if c.want_logits]
        masks = self._start_masks(sampling)
        packed = None
        first = work[0][1]
        logits = None
        if not decode and len(work) == 1 and self._prefill_replays(first):
            assert self.prefill_graphs is not None
            try:
                T = self.prefill_graphs.bucket(len(first.tokens), first.past, len(first.pages))
                self.loras.select([(work[0][0], T or len(first.tokens))], 0)
                logits = self.prefill_graphs.run(first.tokens, first.pages, first.past)  # padded to a bucket
                rows = [0] if first.want_logits else []
            except RuntimeError as e:  # a capture the model's ops do not support: prefill eagerly from now on
                log.warning("CUDA-graph prefill failed (%s); prefill runs eagerly from now on", e)
                self.prefill_graphs = None
        if logits is None:
            graphs = self.graphs if decode else None
            # a graph takes host-built inputs in one copy; the eager forward wants them on the device
            meta, rows = build_batch([c for _, c in work], page_size=self.page_size, table_width=self.table_width,
                                     scratch_page=self.cache.scratch_page,
                                     device=torch.device("cpu") if graphs is not None else self.device, decode=decode)
            self.loras.select([(j, len(c.tokens)) for j, c in work], meta.input_ids.shape[0])
            if graphs is not None and graphs.accepts(meta):
                logits, packed = graphs.run(meta)
            else:
                if graphs is not None:
                    meta = meta_to_device(meta, self.device)
                logits = self.plan.forward(meta, self.cache)
        self.forward_calls += 1
        self.tokens_computed += sum(len(c.tokens) for _, c in work)
        for job, c in work:
            job.cached += len(c.tokens)
            self._register_pages(job)
        if not sampling:
            return
        if packed is not None and not masks and all(
                j.sampler.is_greedy and not j.return_probs and not j.return_logits and not j.ban_at.get(len(j.seq))
                for j in sampling):
            # greedy ids and ok flags were computed inside the graph: one small read, no sampler
            host = packed[:, :len(rows)] if rows == list(range(len(rows))) else packed[:, rows]
            self._process_sampled(sampling, host.cpu().tolist(), None, {}, results)
            return
        # fp32 for the samplers (a replayed graph leaves the head's fp16)
        self._sample_and_process(sampling, logits[torch.tensor(rows, device=logits.device)].float(), masks, results)

    def _start_masks(self, jobs: list[Job]) -> dict[int, Future | None]:
        """Filter masks for ``jobs``; slow filters run on a worker thread during the forward."""
        out: dict[int, Future | None] = {}
        for i, job in enumerate(jobs):
            if not job.filters:
                continue
            if any(f.use_background_worker() for f in job.filters):
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="exl3-filters")
                out[i] = self._pool.submit(self._filter_mask, job)
            else:
                out[i] = None
        return out

    def _filter_mask(self, job: Job) -> torch.Tensor | None:
        V = self.vocab_size or 0
        mask = None
        for f in job.filters:
            m = f.mask(V, "cpu")
            if m is not None:
                mask = m if mask is None else mask & m
        return mask

    def _sample_and_process(self, jobs: list[Job], logits: torch.Tensor, masks: dict[int, Future | None],
                            results: list[Result]) -> None:
        B, V = logits.shape
        if self.vocab_size is None:
            self.vocab_size = V
        raw = logits
        allowed: torch.Tensor | None = None
        failed: dict[int, BaseException] = {}
        for i, job in enumerate(jobs):
            m: torch.Tensor | None = None
            if i in masks:
                try:
                    fut = masks[i]
                    m = fut.result() if fut is not None else self._filter_mask(job)
                except Exception as e:  # noqa: BLE001 - a broken filter fails its own job only
                    failed[i] = e
            bans = job.ban_at.get(len(job.seq))
            if m is None and not bans:
                continue
            if allowed is None:
                allowed = torch.ones((B, V), dtype=torch.bool)
            if m is not None:
                allowed[i] &= m
            if bans:
                allowed[i, list(bans)] = False
        if allowed is not None:
            logits = logits.masked_fill(~allowed.to(logits.device, non_blocking=True), float("-inf"))
        W = max(j.sampler.history_window() for j in jobs)
        history = None
        if W > 0:
            h = torch.full((B, W), -1, dtype=torch.int64)
            for i, job in enumerate(jobs):
                tail = job.seq[-W:]
                if tail:
                    h[i, W - len(tail):] = torch.tensor(tail)
            history = h.to(self.device, non_blocking=True)
        uniforms = torch.stack([
            torch.zeros((), device=self.device) if j.sampler.is_greedy or j.rng is None
            else torch.rand((), generator=j.rng, device=self.device) for j in jobs])
        want_probs = any(j.return_probs for j in jobs)
        out = sample(logits, [j.sampler for j in jobs], uniforms, history=history, want_probs=want_probs)
        # ok row: 1 sampled, 0 every token excluded, -1 the raw logits were NaN/inf (a numeric fault)
        fault = (raw.isnan() | raw.isposinf()).any(-1) | raw.isneginf().all(-1)
        ok = torch.where(fault, -1.0, out.ok.double())
        # the step's one device->host read
        packed = torch.stack([out.ids.double(), ok] + ([out.probs.double()] if out.probs is not None else []))
        host = packed.cpu().tolist()
        raw_rows = raw.cpu() if any(j.return_logits for j in jobs) else None
        self._process_sampled(jobs, host, raw_rows, failed, results)

    def _process_sampled(self, jobs: list[Job], host: list[list[float]], raw_rows: torch.Tensor | None,
                         failed: dict[int, BaseException], results: list[Result]) -> None:
        """Per job: ``host[0][i]`` the sampled id, ``host[1][i]`` 1 when a token was allowed, 0 when
        none was, -1 when the logits were NaN/inf (0 too where nothing could exclude a token)."""
        for i, job in enumerate(jobs):
            if job.status != "active":
                continue
            if i in failed:
                self._fail(job, failed[i], results)
            elif host[1][i] < 0 or (not host[1][i] and job.sampler.is_greedy and not job.filters
                                    and not job.ban_at.get(len(job.seq))):
                self._fail(job, NumericFault(job.identifier, self.forward_calls, len(job.seq)), results)
            elif not host[1][i]:
                self._fail(job, RuntimeError(
                    "every token was excluded at this position (sampler truncation, token bans, banned strings and "
                    "filters together allow nothing); relax the constraints"), results)
            else:
                extra = (host[2][i] if job.return_probs else None, raw_rows[i] if job.return_logits else None)
                try:
                    self._accept(job, int(host[0][i]), extra, results)
                except Exception as e:  # noqa: BLE001 - e.g. a filter raising in accept_token
                    self._fail(job, e, results)

    # -- per-job token handling -----------------------------------------------------------------
    def _accept(self, job: Job, tok: int, extra: tuple[Any, Any], results: list[Result]) -> None:
        now = time.perf_counter()
        if not job.t_first:
            job.t_first = now
        job.new_tokens += 1
        if tok in job.stop_tokens or (job.stop_at_eos and tok in self.eos_ids):
            self._finish(job, "stop_token", results, stop_token=tok)
            return
        job.seq.append(tok)
        for f in job.filters:
            f.feed(tok)
        delta = job.stream.push(tok) if job.stream is not None else ""
        job.held.add(tok, delta, extra)
        k = job.held.find_banned()
        if k is not None:
            self._rollback(job, k)
            return
        s = job.held.find_stop()
        if s is not None:
            text, toks, extras = job.held.take(s)
            self._emit(job, text, toks, extras, results, eos=False)
            self._finish(job, "stop_string", results, stop_string=True)
        elif any(f.is_completed() for f in job.filters):
            self._finish(job, "filter", results)
        elif job.new_tokens >= job.max_new_tokens:
            self._finish(job, "max_new_tokens", results)
        elif len(job.seq) >= self.max_seq_len:
            self._finish(job, "max_seq_len", results)
        else:
            text, toks, extras = job.held.take(job.held.safe_len())
            self._emit(job, text, toks, extras, results, eos=False)

    def _rollback(self, job: Job, k: int) -> None:
        """Undo held tokens ``k..`` (a banned string began at token k) and ban that token there."""
        first = job.held.tokens[k][0]
        job.rollbacks += 1
        n = job.held.drop_tokens(k)
        pos = len(job.seq) - n
        job.ban_at.setdefault(pos, set()).add(first)
        del job.seq[pos:]
        job.new_tokens -= n
        if job.stream is not None:
            job.stream.rollback(n)
        for f in job.filters:
            f.rewind(n)
        job.cached = min(job.cached, len(job.seq) - 1)
        try:
            self._truncate_cache(job)
        except CacheExhausted:  # no page to copy a shared one into: recompute the job later instead
            self.scheduler.preempt(job)

    def _emit(self, job: Job, text: str, toks: list[int], extras: list[Any], results: list[Result], *,
              eos: bool, **more: Any) -> Result | None:
        if not text and not toks and not eos:
            return None
        job.add_completion(text)
        r: Result = {"job": job, "identifier": job.identifier, "stage": "streaming", "eos": eos, "text": text,
                     "token_ids": toks}
        if job.return_probs:
            r["token_probs"] = [e[0] for e in extras if e is not None]
        if job.return_logits:
            lg = [e[1] for e in extras if e is not None]
            r["logits"] = torch.stack(lg) if lg else torch.empty(0, self.vocab_size or 0)
        r.update(more)
        results.append(r)
        return r

    def _finish(self, job: Job, reason: str, results: list[Result], *, stop_token: int | None = None,
                stop_string: bool = False) -> None:
        """End ``job``; a stop token/string is reported in ``stop_token``/``eos_reason``, not in the text."""
        text, toks, extras = ("", [], []) if stop_string else job.held.take_all()
        if not stop_string and job.stream is not None:
            text += job.stream.flush()
        job.t_end = time.perf_counter()
        self._release(job)
        job.status = "done"
        self._emit(job, text, toks, extras, results, eos=True, eos_reason=reason, stop_token=stop_token,
                   full_completion=job.completion + text, **job.stats())

    def _fail(self, job: Job, err: BaseException, results: list[Result]) -> None:
        job.error = err
        job.t_end = time.perf_counter()
        if job in self.active:
            self._release(job)
        job.status = "done"
        results.append({"job": job, "identifier": job.identifier, "stage": "streaming", "eos": True, "text": "",
                        "token_ids": [], "eos_reason": "error", "error": err, "full_completion": job.completion,
                        **job.stats()})
