"""Speculative decoding in the batching generator: draft, verify in one multi-token step, commit, roll back.

A speculative step replaces a plain decode step (every running job decoding) when the draft-length
policy (:mod:`exl3_core.generator.draft_policy`) says drafting pays:

1. each job gets a draft length k_b (0 for jobs that do not draft: jobs with filters, whose masks depend
   on every committed token, jobs about to end, jobs the drafter has nothing for);
2. the drafter (:mod:`exl3_core.generator.drafting`) proposes up to k_b tokens per job;
3. the target runs one decode step of K + 1 tokens per sequence (K = the longest draft): the job's pending
   token, its drafts, and filler up to K (a CUDA-graph bucket per (batch, K + 1) on the GPU). Row i of job b
   holds the target's logits for the token after its first i drafts;
4. jobs that did not draft are sampled from their first row exactly as in a plain step; for the others
   the acceptance rule (:func:`speculative_rule`) decides how many drafts m_b are accepted and the token that
   follows them: greedy jobs accept drafts equal to the target's argmax and then take the argmax, so their
   output is the target's greedy output token for token; sampled jobs accept draft i with probability
   min(1, p_i(d_i) / q_i(d_i)) and on rejection draw from the normalised residual max(0, p_i - q_i), so the
   committed tokens are distributed as the target's own samples (Leviathan et al. 2023; Chen et al. 2023).
   The target distributions p_i are the job's sampler applied row by row, with the penalties' history
   including drafts 0..i-1 and the banned-string bans of position i;
5. the m_b + 1 tokens are committed one at a time through the generator's own token handling (stop tokens
   and strings, banned strings, filters, length limits), advancing the job's cached length token by token
   as a plain step would, so the prefix cache registers exactly the pages a plain run would. A job that
   ends, or whose banned string rolls it back, drops the rest. Pages the verification wrote past the
   committed tokens are released; the drafter keeps its keys up to the first rejected draft.

With a draft model, a greedy step whose every job drafted launches the next step's drafts before it reads the
verification (*drafting ahead*): each job's accepted count and the token after are worked out on the device,
and the draft's steps are moved on by them there (:meth:`ModelDrafter.propose_shifted`), so the device drafts
while the host reads the verification and commits its tokens, and a graph launch's own host time no longer
sits between the two. The next step verifies those drafts when it runs the same jobs at the sequences that
follow; otherwise (a job ended or was rolled back, a job joined, the step is not speculative) they are dropped,
the draft's cache holding nothing it would not recompute.

Speculation touches the generator through :class:`SpecHost` only (its page bookkeeping and per-job token
handling), and the generator calls :meth:`Speculator.step`, :meth:`Speculator.release` and
:meth:`Speculator.wants_step` (the overlapped plain loop drains when a speculative step is due).
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from exl3_core.cache.cache import Cache
from exl3_core.generator.batching import Chunk, HostRead, build_batch, meta_to_device, to_device_async
from exl3_core.generator.draft_policy import DraftLength
from exl3_core.generator.drafting import (FOLD_MAX_ROWS, FOLD_ROW_BUCKETS, Drafter, ModelDrafter, NgramDrafter,
                                          Proposal)
from exl3_core.generator.graphs import DecodeGraphs
from exl3_core.generator.job import Job
from exl3_core.generator.loras import StepLoras
from exl3_core.generator.types import BatchModel, Result
from exl3_core.plan.plan import ExecutionPlan
from exl3_core.sampling.sampler import draw, final_logits


class SpecHost(Protocol):
    """What speculation needs of the generator: its jobs, pages, runners and per-job token handling."""

    queue: deque[Job]
    active: list[Job]
    page_size: int
    table_width: int
    max_seq_len: int
    cache: Cache
    graphs: DecodeGraphs | None
    plan: ExecutionPlan
    device: torch.device
    forward_calls: int
    tokens_computed: int
    vocab_size: int | None
    loras: StepLoras

    def _register_pages(self, job: Job) -> None: ...

    def _accept(self, job: Job, tok: int, extra: tuple[Any, Any], results: list[Result]) -> None: ...

    def _fail(self, job: Job, err: BaseException, results: list[Result]) -> None: ...

    def _start_masks(self, jobs: list[Job]) -> dict[int, Future | None]: ...

    def _sample_and_process(self, jobs: list[Job], logits: torch.Tensor, masks: dict[int, Future | None],
                            results: list[Result]) -> None: ...


# -- the acceptance rule ---------------------------------------------------------------------
@dataclass
class Verdict:
    """:func:`speculative_rule` per sequence b: ``accepted[b]`` drafts were accepted, then ``token[b]``
    follows them; ``ok[b]`` False where the target allowed no token there; ``probs[b, i]`` the target's
    probability of the i-th committed token (the accepted drafts, then ``token``)."""

    accepted: torch.Tensor  # int64 [S]
    token: torch.Tensor  # int64 [S]
    ok: torch.Tensor  # bool [S]
    probs: torch.Tensor  # float32 [S, K + 1]


def speculative_rule(target: torch.Tensor, drafts: torch.Tensor, lens: torch.Tensor, q: torch.Tensor | None,
                     u_accept: torch.Tensor, u_resample: torch.Tensor) -> Verdict:
    """Standard speculative sampling over S sequences at once, on their device.

    :param target: float32 ``[S, K + 1, V]``: row i the target's final logits (after the sampler; -inf
        excluded) for the token after the first i drafts. A greedy job's rows keep only their argmax.
    :param drafts: int64 ``[S, K]`` the drafted ids (entries past ``lens[b]`` are ignored).
    :param lens: int64 ``[S]`` drafts per sequence (0..K).
    :param q: float32 ``[S, K, V]`` the distributions the drafts were drawn from; None: point masses (a
        certain proposal: greedy drafts, n-gram lookups). Rows past ``lens[b]`` are ignored.
    :param u_accept: ``[S, K]`` uniforms in [0, 1) for the acceptance tests.
    :param u_resample: ``[S, K + 1]`` uniforms for the draw after the last accepted draft.

    Draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)) while all before it were; at the first
    rejection the token is drawn from max(0, p_i - q_i) normalised, and after ``lens[b]`` accepted drafts
    from p_{lens[b]}. Greedy rows (one-hot p, point-mass q) thus accept exactly the drafts equal to the
    argmax and then take the argmax.
    """
    S, K1, V = target.shape
    K = K1 - 1
    dev = target.device
    p = torch.softmax(target, dim=-1)
    ok = torch.isfinite(target).any(-1) & ~torch.isnan(target).any(-1)  # [S, K+1]
    p = torch.where(ok[..., None], p, torch.zeros_like(p))
    live = torch.arange(K, device=dev)[None, :] < lens[:, None]  # [S, K] drafts that exist
    d = torch.where(live, drafts, torch.zeros_like(drafts))
    if q is None:
        qq = torch.zeros((S, K, V), dtype=p.dtype, device=dev).scatter_(2, d[..., None], 1.0)
    else:
        qq = q.to(p.dtype)
    qq = qq * live[..., None]  # no draft: the residual below is p itself
    pd = p[:, :K].gather(2, d[..., None]).squeeze(2)
    qd = qq.gather(2, d[..., None]).squeeze(2)
    accept = (u_accept.to(p.dtype) * qd < pd) & live
    m = accept.long().cumprod(1).sum(1)  # drafts accepted before the first rejection
    resid = torch.cat([(p[:, :K] - qq).clamp_(min=0.0), p[:, K:]], 1)  # [S, K+1, V]
    empty = resid.sum(-1, keepdim=True) <= 0  # only where p == q exactly (never chosen after a rejection)
    resid = torch.where(empty, p, resid)
    pick = draw(torch.log(resid.reshape(S * K1, V)), u_resample.reshape(-1)).view(S, K1)
    token = pick.gather(1, m[:, None]).squeeze(1)
    cols = torch.arange(K1, device=dev)[None, :]
    committed = torch.where(cols < m[:, None], torch.cat([d, d[:, :1]], 1), token[:, None])
    probs = p.gather(2, committed[..., None]).squeeze(2)
    return Verdict(m, token, ok.gather(1, m[:, None]).squeeze(1), probs)


# -- the speculator ----------------------------------------------------------------------------
@dataclass
class SpecStats:
    """Counters of one generator's speculation."""

    steps: int = 0  # speculative (verification) steps
    plain_steps: int = 0  # decode steps the policy left plain (run by the generator)
    timed_plain_steps: int = 0  # plain steps run through the speculative path to time them
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of which accepted
    committed: int = 0  # tokens committed by speculative steps (accepted drafts plus one per drafting job)
    draft_forwards: int = 0
    ahead: int = 0  # speculative steps whose drafts were launched before the step before read its verification
    ahead_dropped: int = 0  # drafts launched ahead that no step verified
    not_ahead: dict[str, int] = field(default_factory=dict)  # why a speculative step did not draft ahead, counted

    def as_dict(self) -> dict[str, object]:
        return {"spec_steps": self.steps, "plain_steps": self.plain_steps,
                "timed_plain_steps": self.timed_plain_steps, "draft_tokens": self.drafted,
                "accepted_draft_tokens": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "draft_forwards": self.draft_forwards, "ahead_steps": self.ahead,
                "ahead_dropped": self.ahead_dropped, "not_ahead": dict(self.not_ahead)}


@dataclass
class _StepDrafts:
    """The drafts of every job of one step, on the host or on the device only."""

    lens: list[int]  # drafts per job (0: the job does not draft)
    host: list[list[int]] | None  # per job, when known on the host
    ids: torch.Tensor | None  # int64 [B, K] on the device otherwise (row b's first lens[b] entries)
    q: torch.Tensor | None  # float32 [B, K, V]: what sampled drafts were drawn from (None: point masses)
    forwards: int  # draft-model forwards that drafted
    catch_up: int = 0  # draft-model forwards before those, over tokens the draft had not seen


@dataclass
class _Ahead:
    """Drafts launched before the step that precedes their verification read its own."""

    jobs: list[Job]
    lengths: list[int]  # each job's sequence length once that step's tokens are committed
    rollbacks: list[int]  # each job's rollback count then
    ks: list[int]
    proposal: Proposal
    clock: _Clock
    t0: float

    def matches(self, jobs: list[Job]) -> bool:
        """Whether ``jobs`` are the same jobs, active, at the sequences these drafts follow."""
        return (len(jobs) == len(self.jobs) and all(a is b for a, b in zip(jobs, self.jobs))
                and all(j.status == "active" and len(j.seq) == n and j.rollbacks == r
                        for j, n, r in zip(jobs, self.lengths, self.rollbacks)))


class _Clock:
    """Marks on the host clock, or CUDA events on the device's stream, read after the step's sync."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self, a: int, b: int) -> float:
        if self.cuda:
            self.marks[b].synchronize()
            return float(self.marks[a].elapsed_time(self.marks[b])) / 1e3
        return float(self.marks[b] - self.marks[a])


def _ids(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 tensor of ``values`` on ``device``, copied asynchronously: a plain host-to-device copy would wait
    for every kernel queued before it (the draft steps, the verification)."""
    return to_device_async(torch.tensor(values, dtype=torch.int64), device)


def _vocab(obj: Any) -> int | None:
    v = getattr(obj, "vocab_size", None)
    if isinstance(v, int):
        return v
    hf = getattr(getattr(obj, "config", None), "hf", None)
    v = getattr(hf, "vocab_size", None)
    return v if isinstance(v, int) else None


def _vocab_pieces(tokenizer: Any) -> list[bytes] | None:
    get = getattr(tokenizer, "get_vocab_bytes", None)
    return list(get()) if callable(get) else None


def check_draft(model: BatchModel, cache: Cache, tokenizer: Any, draft_model: BatchModel, draft_cache: Cache | None,
                draft_tokenizer: Any) -> None:
    """Raise ``ValueError`` when ``draft_model`` / ``draft_cache`` cannot draft for ``model``: another vocabulary
    or tokenizer, no cache or the main cache, a cache for another model, one smaller than the main cache, or
    another device."""
    if draft_cache is None:
        raise ValueError("Generator: draft_model needs draft_cache=Cache(draft_model, max_num_tokens=...) of its own "
                         "(as large as the model's cache)")
    if draft_cache is cache:
        raise ValueError("Generator: draft_cache is the model's own cache; create a separate Cache(draft_model, ...)")
    v, dv = _vocab(model), _vocab(draft_model)
    if v is not None and dv is not None and v != dv:
        raise ValueError(f"Generator: the draft model's vocabulary has {dv} tokens but the model's has {v}; a draft "
                         f"model must share the model's tokenizer and vocabulary")
    if tokenizer is not None and draft_tokenizer is not None and draft_tokenizer is not tokenizer:
        a, b = _vocab_pieces(tokenizer), _vocab_pieces(draft_tokenizer)
        if a is not None and b is not None and a != b:
            diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise ValueError(
                f"Generator: the draft tokenizer differs from the model's (token {diff}: "
                f"{b[diff] if diff < len(b) else 'absent'!r} in the draft, {a[diff] if diff < len(a) else 'absent'!r} "
                f"in the model; {len(b)} vs {len(a)} tokens); a draft model must share the model's tokenizer")
    geo = tuple(draft_model.cache_geometry())
    if tuple(draft_cache.geometry) != geo:
        raise ValueError(f"Generator: draft_cache was built for another model ({len(draft_cache.geometry)} layers of "
                         f"{draft_cache.geometry[0] if draft_cache.geometry else '-'}, the draft model has {len(geo)} "
                         f"of {geo[0] if geo else '-'}); create it as Cache(draft_model, ...)")
    if draft_cache.max_num_tokens < cache.max_num_tokens:
        raise ValueError(f"Generator: draft_cache holds {draft_cache.max_num_tokens} tokens but the model's cache "
                         f"holds {cache.max_num_tokens}; every sequence in the model's cache needs its draft keys too: "
                         f"create the draft cache with max_num_tokens >= {cache.max_num_tokens}")
    if torch.device(draft_model.device) != torch.device(model.device):
        raise ValueError(f"Generator: the draft model is on {draft_model.device} but the model on {model.device}; "
                         f"load both on one device")


def _positive_int(name: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"Generator: {name}={value!r} must be an integer >= {lo}")
    return value


class Speculator:
    """Speculative steps for one generator (see the module docstring); built by :meth:`create`."""

    def __init__(self, host: SpecHost, drafter: Drafter, length: DraftLength) -> None:
        self.host = host
        self.drafter = drafter
        self.length = length
        self.stats = SpecStats()
        self._ahead: _Ahead | None = None  # drafts launched for the next step
        self._cycle_end: float | None = None  # host clock when this step launched the next one's drafts

    @classmethod
    def create(cls, host: SpecHost, *, model: BatchModel, tokenizer: Any, draft_model: BatchModel | None,
               draft_cache: Cache | None, draft_tokenizer: Any, num_draft_tokens: int, ngram_draft_tokens: int,
               ngram_corpus: Sequence[Sequence[int]], dynamic_draft: bool, max_chunk_tokens: int) -> Speculator | None:
        """The generator's speculator, or None without a draft model or n-gram drafting. Bad input raises
        ``ValueError`` (see :func:`check_draft`)."""
        ngram = _positive_int("ngram_draft_tokens", ngram_draft_tokens, 0)
        if draft_model is None:
            if draft_cache is not None:
                raise ValueError("Generator: draft_cache given without draft_model")
            if not ngram:
                if ngram_corpus:
                    raise ValueError("Generator: ngram_corpus needs ngram_draft_tokens >= 1")
                return None
            return cls(host, NgramDrafter(corpus=ngram_corpus), DraftLength(ngram, dynamic=dynamic_draft))
        k = _positive_int("num_draft_tokens", num_draft_tokens, 1)
        if ngram:
            raise ValueError("Generator: give draft_model or ngram_draft_tokens, not both")
        if draft_tokenizer is None:
            draft_tokenizer = getattr(draft_model, "tokenizer", None)
        check_draft(model, host.cache, tokenizer, draft_model, draft_cache, draft_tokenizer)
        assert draft_cache is not None
        plan = host.plan if draft_model is model else None
        drafter = ModelDrafter(draft_model, draft_cache, max_seq_len=host.max_seq_len,
                               max_chunk_tokens=max_chunk_tokens, plan=plan)
        cost = _param_ratio(draft_model, model)
        return cls(host, drafter, DraftLength(k, dynamic=dynamic_draft, draft_cost=cost))

    # -- generator hooks -----------------------------------------------------------------------
    def rows_per_seq(self, model: object) -> int:
        """Most rows per sequence of a step this speculator runs on ``model`` (the target's): the k + 1 rows of a
        verification, and the draft's widened first step where the draft is the target itself."""
        rows = self.length.max_k + 1
        if isinstance(self.drafter, ModelDrafter) and self.drafter.model is model:
            rows = max(rows, FOLD_MAX_ROWS)
        return rows

    def release(self, job: Job) -> None:
        """``job`` ended or was cancelled."""
        self.drafter.release(job)
        self.length.forget(job)

    def capture_graphs(self, max_batch: int) -> None:
        """Capture the verification graphs of every draft length (k + 1 rows per sequence) and, with a draft
        model, its step shapes (one row, and the first step's rows, widened after plain steps) and its chains of
        one-token steps, for every batch bucket up to ``max_batch`` (see
        :meth:`Generator.capture_graphs <exl3_core.generator.Generator.capture_graphs>`)."""
        if self.host.graphs is not None:
            for k in range(1, self.length.max_k + 1):
                self.host.graphs.capture_buckets(max_batch, k + 1)
        if isinstance(self.drafter, ModelDrafter) and self.drafter.graphs is not None:
            buckets: list[int] = []
            for rows in (1, *FOLD_ROW_BUCKETS):
                buckets = self.drafter.graphs.capture_buckets(max_batch, rows)
            chain = self.drafter.chain
            if chain is not None:
                for n in range(1, min(self.length.max_k - 1, chain.max_steps) + 1):
                    chain.capture(buckets, n)

    def wants_step(self) -> bool:
        """Whether the next decode step should be speculative (asked by the overlapped plain loop before
        each step it launches; a False answer counts as one plain step)."""
        jobs = [j for j in self.host.active if j.status == "active"]
        if not jobs:
            return False
        want = any(self.length.choose(jobs, self._caps(jobs))) or self.length.needs_timing(len(jobs))
        if not want:
            self.length.note_step(False)
            self.stats.plain_steps += 1
        return want

    def step(self, work: list[tuple[Job, Chunk]], results: list[Result]) -> bool:
        """Run the decode step ``work`` (one pending token per job) speculatively; False (nothing done)
        when it should run as a plain step."""
        ahead, self._ahead = self._ahead, None
        jobs = [j for j, _ in work]
        if not all(j.prefill_done and c.want_logits and len(c.tokens) == 1 for j, c in work):
            self._drop(ahead)
            return False
        if ahead is not None:
            if ahead.matches(jobs):
                return self._step_ahead(jobs, ahead, results)
            self._drop(ahead)
        ks = self.length.choose(jobs, self._caps(jobs))
        timed = not any(ks) and self.length.needs_timing(len(jobs))
        if not any(ks) and not timed:
            self.length.note_step(False)
            self.stats.plain_steps += 1
            return False
        ks = self._fit_pages(jobs, ks)
        if not any(ks) and not timed:
            return self._plain(jobs)
        clock = _Clock(self.host.device)
        t0 = time.perf_counter()
        clock.mark()
        drafting = [b for b, k in enumerate(ks) if k > 0]
        dr = self._propose(jobs, ks, drafting)
        clock.mark()
        K = max(dr.lens, default=0)
        if K == 0 and not timed:
            return self._plain(jobs)
        self.length.note_step(K > 0)
        self._verify(jobs, dr, K, results, clock, t0)
        return True

    def _step_ahead(self, jobs: list[Job], ahead: _Ahead, results: list[Result]) -> bool:
        """Verify the drafts launched ahead for ``jobs`` (cut to what each may draft now and the pages allow)."""
        ks = self._fit_pages(jobs, [min(k, c) for k, c in zip(ahead.ks, self._caps(jobs))])
        dr = self._step_drafts(jobs, ks, list(range(len(jobs))), ahead.proposal)
        if not max(dr.lens, default=0):
            self._drop(ahead)
            return self._plain(jobs)
        self.stats.ahead += 1
        self.length.note_step(True)
        self._verify(jobs, dr, max(dr.lens), results, ahead.clock, ahead.t0)
        return True

    def _drop(self, ahead: _Ahead | None) -> None:
        """Drafts launched ahead that no step verifies: the draft's cache rows past each job's listed tokens are
        stale already, so only the counts change (their forwards ran)."""
        if ahead is not None:
            self.stats.ahead_dropped += 1
            self.stats.draft_forwards += ahead.proposal.forwards + ahead.proposal.catch_up

    def _propose(self, jobs: list[Job], ks: list[int], drafting: list[int]) -> _StepDrafts:
        """The drafts of every job of the step (none for those not in ``drafting``)."""
        if not drafting:
            return _StepDrafts([0] * len(jobs), [[] for _ in jobs], None, None, 0)
        prop = self.drafter.propose([jobs[b] for b in drafting], [ks[b] for b in drafting])
        return self._step_drafts(jobs, ks, drafting, prop)

    def _step_drafts(self, jobs: list[Job], ks: list[int], drafting: list[int], prop: Proposal) -> _StepDrafts:
        """``prop`` (the proposal for the jobs ``jobs[b]``, b in ``drafting``) as the step's drafts, at most
        ``ks[b]`` per job."""
        B = len(jobs)
        lens = [0] * B
        for i, b in enumerate(drafting):
            lens[b] = min(prop.count(i), ks[b])
        K = max(lens)
        if prop.tokens is not None:
            host: list[list[int]] = [[] for _ in jobs]
            for i, b in enumerate(drafting):
                host[b] = prop.tokens[i][:lens[b]]
            return _StepDrafts(lens, host, None, None, prop.forwards, prop.catch_up)
        assert prop.ids is not None
        dev = prop.ids.device
        idx = _ids(drafting, dev)
        ids = torch.zeros((B, K), dtype=torch.int64, device=dev).index_copy_(0, idx, prop.ids[:, :K])
        q = None
        if prop.q is not None:
            q = torch.zeros((B, K, prop.q.shape[-1]), dtype=prop.q.dtype, device=dev).index_copy_(0, idx, prop.q[:, :K])
        return _StepDrafts(lens, None, ids, q, prop.forwards, prop.catch_up)

    def _plain(self, jobs: list[Job]) -> bool:
        """Leave the step to the generator's plain loop, without the pages reserved for verification rows."""
        self._trim_pages(jobs)
        self.length.note_step(False)
        self.stats.plain_steps += 1
        return False

    def _trim_pages(self, jobs: list[Job]) -> None:
        """Release each active job's pages past the one its next token goes to (only verification rows wrote
        there: they hold nothing)."""
        ps = self.host.page_size
        for j in jobs:
            if j.status == "active":
                keep = math.ceil((j.cached + 1) / ps)
                if len(j.pages) > keep:
                    self.host.cache.allocator.release(j.pages[keep:])
                    del j.pages[keep:]

    # -- internals -----------------------------------------------------------------------------
    def _caps(self, jobs: list[Job]) -> list[int]:
        """Most tokens each job may draft now (its remaining budget less the token after the drafts)."""
        h = self.host
        out = []
        for j in jobs:
            cap = min(self.length.max_k, j.max_new_tokens - j.new_tokens - 1, h.max_seq_len - len(j.seq) - 1)
            if j.filters or cap < 1:
                out.append(0)  # a filter's mask depends on every committed token: no drafts
            else:
                out.append(self.drafter.available(j, cap))
        return out

    def _fit_pages(self, jobs: list[Job], ks: list[int]) -> list[int]:
        """Shorten the drafts so that every job's K + 1 verification rows fit its page table and the free
        pages (never evicting prefix-cache pages for tokens that may be rolled back)."""
        h = self.host
        ps = h.page_size
        K = max(ks)
        K = min(K, min(h.max_seq_len - 1 - j.cached for j in jobs))
        free = len(h.cache.allocator.free)
        while K > 0 and sum(max(0, math.ceil((j.cached + K + 1) / ps) - len(j.pages)) for j in jobs) > free:
            K -= 1
        K = max(K, 0)
        for j in jobs:
            need = math.ceil((j.cached + K + 1) / ps) - len(j.pages)
            if need > 0:
                j.pages += h.cache.allocator.allocate(need)
        return [min(k, K) for k in ks]

    def _verify(self, jobs: list[Job], dr: _StepDrafts, K: int, results: list[Result], clock: _Clock,
                t0: float) -> None:
        h = self.host
        B = len(jobs)
        n = K + 1
        chunks = []
        for b, j in enumerate(jobs):
            d = dr.host[b] if dr.host is not None else []  # device drafts: placeholders, replaced below
            fill = d[-1] if d else j.seq[-1]
            chunks.append(Chunk([j.seq[-1]] + d + [fill] * (K - len(d)), j.cached, j.pages, True, j.ring_slot))
        plain = [b for b in range(B) if not dr.lens[b]]
        spec = [b for b in range(B) if dr.lens[b]]
        masks = h._start_masks([jobs[b] for b in plain])
        graphs = h.graphs
        meta, _ = build_batch(chunks, page_size=h.page_size, table_width=h.table_width,
                              scratch_page=h.cache.scratch_page,
                              device=torch.device("cpu") if graphs is not None else h.device, decode=True)
        h.loras.select([(j, n) for j in jobs], meta.input_ids.shape[0])  # every row verifies under its job's adapters
        ids = None
        if dr.ids is not None and K:  # the input ids on the device: each job's pending token, then its drafts
            last = _ids([j.seq[-1] for j in jobs], dr.ids.device)[:, None]
            ids = torch.cat([last, dr.ids], 1).view(-1)
        packed: torch.Tensor | None = None  # a replayed graph's greedy ids and ok flags per row
        if graphs is not None and graphs.accepts(meta):
            logits, packed = graphs.run(meta, ids)
        else:
            if graphs is not None:
                meta = meta_to_device(meta, h.device)
            if ids is not None:
                meta.input_ids[:ids.shape[0]].copy_(ids)
            logits = h.plan.forward(meta, h.cache)
        clock.mark()
        h.forward_calls += 1
        h.tokens_computed += B * n
        if plain:
            pj = [jobs[b] for b in plain]
            for j in pj:
                j.cached += 1
                h._register_pages(j)
            rows = _ids([b * n for b in plain], logits.device)
            h._sample_and_process(pj, logits.index_select(0, rows).float(), masks, results)
        if spec:
            self._accept_drafts(jobs, spec, dr, K, logits, packed, results)
        self._trim_pages(jobs)
        self._record_times(B, K, dr, clock, t0)

    def _accept_drafts(self, all_jobs: list[Job], batch_rows: list[int], dr: _StepDrafts, K: int,
                       logits: torch.Tensor, packed: torch.Tensor | None, results: list[Result]) -> None:
        """Acceptance and commits for the drafting jobs ``all_jobs[b]``, b in ``batch_rows``."""
        h = self.host
        jobs = [all_jobs[b] for b in batch_rows]
        S = len(jobs)
        n = K + 1
        dev = logits.device
        row_list = [b * n + i for b in batch_rows for i in range(n)]
        rows = _ids(row_list, dev)
        lens = [dr.lens[b] for b in batch_rows]
        drafts = [dr.host[b] for b in batch_rows] if dr.host is not None else None
        d_dev = None
        if dr.ids is not None:
            d_dev = dr.ids.index_select(0, _ids(batch_rows, dr.ids.device)).to(dev)
        fast = all(j.sampler.is_greedy and not j.return_probs and not j.return_logits
                   and not any(j.ban_at.get(len(j.seq) + i) for i in range(n)) for j in jobs)
        shifted: _Ahead | None = None
        if fast:
            # greedy without bans: the drafts equal to the target's argmax, then the argmax (a replayed graph
            # computed both already: no float copy of the logits rows)
            if packed is None:
                raw = logits.index_select(0, rows).float()
                packed = torch.stack([raw.argmax(-1).double(),
                                      (torch.isfinite(raw).any(-1) & ~torch.isnan(raw).any(-1)).double()])
            else:
                packed = packed.index_select(1, rows)
            # the step's one device->host read, started before the next step's drafts are launched after it
            if drafts is None:
                assert d_dev is not None
                read = HostRead(torch.cat([packed, d_dev.double().view(1, -1).expand(2, -1)], 1))
            else:
                read = HostRead(packed)
            shifted = self._draft_shifted(all_jobs, jobs, batch_rows, packed, d_dev, lens, K)
            host = read.wait()
            if drafts is None:
                flat = [int(t) for t in host[0][S * n:]]
                drafts = [flat[s * K:s * K + lens[s]] for s in range(S)]
            tokens, oks, probs = [], [], []
            for s in range(S):
                am = host[0][s * n:(s + 1) * n]
                m = 0
                while m < lens[s] and drafts[s][m] == int(am[m]):
                    m += 1
                tokens.append(drafts[s][:m] + [int(am[m])])
                oks.append(bool(host[1][s * n + m]))
                probs.append([None] * (m + 1))
            raw_rows = None
        else:
            raw = logits.index_select(0, rows).float()  # [S * n, V]
            V = raw.shape[-1]
            x = raw
            bans = [(r, sorted(b)) for s, j in enumerate(jobs) for i in range(n)
                    if (b := j.ban_at.get(len(j.seq) + i)) for r in [s * n + i]]
            if bans:
                allowed = torch.ones((S * n, V), dtype=torch.bool)
                for r, toks in bans:
                    allowed[r, toks] = False
                x = x.masked_fill(~allowed.to(dev), float("-inf"))
            masked = x
            if drafts is None:  # sampled jobs: the drafts' history and the host's commits need them now
                assert d_dev is not None
                rows_d = d_dev.tolist()
                drafts = [rows_d[s][:lens[s]] for s in range(S)]
            W = max(j.sampler.history_window() for j in jobs)
            history = None
            if W > 0:
                hist = torch.full((S * n, W), -1, dtype=torch.int64)
                for s, j in enumerate(jobs):
                    for i in range(n):
                        tail = (j.seq + drafts[s][:i])[-W:]
                        if tail:
                            hist[s * n + i, W - len(tail):] = torch.tensor(tail)
                history = hist.to(dev)
            x = final_logits(x, [j.sampler for j in jobs for _ in range(n)], history=history).view(S, n, V)
            d = _ids([t for dd in drafts for t in dd + [0] * (K - len(dd))], dev).view(S, K)
            q = None
            if dr.q is not None:
                q = dr.q.index_select(0, _ids(batch_rows, dr.q.device)).to(dev)
                greedy = _ids([int(j.sampler.is_greedy) for j in jobs], dev).bool()
                if bool(greedy.any()):  # greedy drafts are point masses
                    one = torch.zeros_like(q).scatter_(2, d[..., None], 1.0)
                    q = torch.where(greedy[:, None, None], one, q)
            u = torch.stack([torch.rand(2 * n, generator=j.rng, device=dev) if j.rng is not None
                             else torch.rand(2 * n, device=dev) for j in jobs])
            v = speculative_rule(x, d, _ids(lens, dev), q, u[:, :K], u[:, n:])
            host = torch.cat([v.accepted.double()[:, None], v.token.double()[:, None], v.ok.double()[:, None],
                              v.probs.double()], 1).cpu().tolist()  # the step's one device->host read
            tokens, oks, probs = [], [], []
            for s in range(S):
                m = int(host[s][0])
                tokens.append(drafts[s][:m] + [int(host[s][1])])
                oks.append(bool(host[s][2]))
                probs.append(host[s][3:3 + m + 1])
            for s, j in enumerate(jobs):
                if j.return_probs and j.sampler.is_greedy:  # as a plain step reports them: the masked logits' softmax
                    sel = _ids([s * n + i for i in range(len(tokens[s]))], dev)
                    pr = torch.softmax(masked.index_select(0, sel), -1).gather(
                        1, _ids(tokens[s], dev)[:, None])
                    probs[s] = pr.squeeze(1).tolist()
            raw_rows = raw.view(S, n, V).cpu() if any(j.return_logits for j in jobs) else None
        for s, job in enumerate(jobs):
            m = len(tokens[s]) - 1
            job.draft_tokens += lens[s]
            job.accepted_draft_tokens += m
            self.stats.drafted += lens[s]
            self.stats.accepted += m
            self.stats.committed += m + 1
            self.length.record_acceptance(job, lens[s], m)
        assert drafts is not None
        ahead = shifted is not None
        if shifted is not None:
            assert isinstance(self.drafter, ModelDrafter)
            for s, job in enumerate(jobs):
                self.drafter.settle(job, drafts[s], job.seq + tokens[s], shifted.ks[s])
            shifted.lengths = [len(j.seq) + len(t) for j, t in zip(jobs, tokens)]
            self._ahead = shifted
        elif not fast:
            self._count_not_ahead("not every job greedy")
        for s, job in enumerate(jobs):
            if job.status != "active":
                continue
            if not oks[s]:
                self._commit(job, tokens[s][:-1], probs[s], raw_rows[s] if raw_rows is not None else None, results)
                if job.status == "active":
                    h._fail(job, RuntimeError(
                        "every token was excluded at this position (sampler truncation, token bans, banned strings "
                        "and filters together allow nothing); relax the constraints"), results)
                continue
            self._commit(job, tokens[s], probs[s], raw_rows[s] if raw_rows is not None else None, results)
            if job.status == "active" and not ahead:
                self.drafter.commit(job, drafts[s])
        self.stats.steps += 1

    def _draft_shifted(self, all_jobs: list[Job], jobs: list[Job], batch_rows: list[int], packed: torch.Tensor,
                       d_dev: torch.Tensor | None, lens: list[int], K: int) -> _Ahead | None:
        """Launch the next step's drafts for ``jobs`` before this greedy step's verification is read (see the
        module docstring): each job's accepted count and next token are worked out on the device from
        ``packed`` (the verification's argmax per row) and the drafts ``d_dev``, and the drafter's steps move
        on by them there. None (nothing launched, the reason counted in :attr:`SpecStats.not_ahead`) where the
        next step could not take them."""
        h = self.host
        n = K + 1
        # what the longest outcome (every draft accepted) leaves each job
        caps = [min(self.length.max_k, j.max_new_tokens - j.new_tokens - k - 2, h.max_seq_len - len(j.seq) - k - 2)
                for j, k in zip(jobs, lens)]
        why = ("not a draft model" if not isinstance(self.drafter, ModelDrafter) else
               "turned off by the tuning" if not h.plan.tuning.graphs.draft_ahead else
               "not every job drafting" if len(batch_rows) != len(all_jobs) or d_dev is None else
               "a job waiting" if h.queue else
               "a job prefilling" if len(h.active) != len(jobs) else
               "a job ending by its length" if min(caps) < 1 else None)
        ks = self.length.choose(jobs, caps) if why is None else []
        if why is None and not any(ks):
            why = "no drafts chosen"
        if why is not None:
            self._count_not_ahead(why)
            return None
        assert isinstance(self.drafter, ModelDrafter) and d_dev is not None
        dev = d_dev.device
        am = packed[0].view(len(jobs), n).to(torch.int64)
        live = torch.arange(K, device=dev)[None, :] < _ids(lens, dev)[:, None]
        m = ((d_dev == am[:, :K]) & live).to(torch.int64).cumprod(1).sum(1)  # drafts accepted
        ext = torch.cat([_ids([j.seq[-1] for j in jobs], dev)[:, None], d_dev], 1)
        last_two = torch.cat([ext.gather(1, m[:, None]), am.gather(1, m[:, None])], 1)
        clock = _Clock(h.device)
        t0 = time.perf_counter()
        clock.mark()
        prop = self.drafter.propose_shifted(jobs, ks, m, last_two)
        clock.mark()
        if prop is None:
            self._count_not_ahead("draft state not the last proposal's")
            return None
        self._cycle_end = t0
        return _Ahead(list(jobs), [], [j.rollbacks for j in jobs], ks, prop, clock, t0)

    def _count_not_ahead(self, why: str) -> None:
        self.stats.not_ahead[why] = self.stats.not_ahead.get(why, 0) + 1

    def _commit(self, job: Job, tokens: list[int], probs: list[Any], raw: torch.Tensor | None,
                results: list[Result]) -> None:
        """Commit ``tokens`` one by one as a plain step would: the input is cached, its pages registered,
        then the token is handled; stops at the job's end or a banned-string rollback."""
        h = self.host
        L0 = len(job.seq)
        for i, tok in enumerate(tokens):
            if job.status != "active" or len(job.seq) != L0 + i:
                return  # ended, or rolled back: what follows was drafted after a token that is gone
            job.cached = L0 + i
            h._register_pages(job)
            extra = (probs[i] if job.return_probs else None, raw[i] if job.return_logits and raw is not None else None)
            try:
                h._accept(job, tok, extra, results)
            except Exception as e:  # noqa: BLE001 - e.g. a filter raising in accept_token
                h._fail(job, e, results)
                return

    def _record_times(self, B: int, K: int, dr: _StepDrafts, clock: _Clock, t0: float) -> None:
        # a step that launched the next one's drafts ends there: the host work after overlaps those drafts
        end, self._cycle_end = self._cycle_end, None
        verify = clock.seconds(1, 2)
        self.length.record_target(B, K + 1, verify)
        if K == 0:
            self.stats.timed_plain_steps += 1
            return
        self.stats.draft_forwards += dr.forwards + dr.catch_up
        if dr.catch_up:
            # its cost follows the tokens the draft missed, not the draft length: no per-forward or host figure
            return
        draft = clock.seconds(0, 1)
        wall = (end if end is not None else time.perf_counter()) - t0
        if dr.forwards:
            self.length.record_draft(B, draft / dr.forwards)
            self.length.record_host(wall - verify - draft)
        else:  # a lookup on the host: its time is host work
            self.length.record_host(wall - verify)


def _param_ratio(draft: Any, model: Any) -> float:
    """Draft forward cost over the model's, from their parameter bytes (a prior until measured)."""
    def size(m: Any) -> int:
        if not isinstance(m, torch.nn.Module):
            return 0
        return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
    a, b = size(draft), size(model)
    return a / b if a and b else 0.25
