"""The generator's scheduler: no accepted job fails for cache space (preemption with recompute,
output identical to running alone), priorities, and the per-step token budget shared by decode rows
and prefill chunks."""
from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from exl3_core.cache import Cache
from exl3_core.generator import Generator, Job
from exl3_core.generator.batching import Chunk
from exl3_core.generator.scheduler import STEP_TOKENS, default_step_tokens
from exl3_core.generator.toy import ByteTokenizer, ToyModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAGE = 16
SAMPLERS: list[Any] = [None, {"temperature": 0.9, "top_k": 20}, {"temperature": 1.1, "top_p": 0.8},
                       {"temperature": 0.7, "repetition_penalty": 1.3, "min_p": 0.05}]


def tiny_model(seed: int = 7) -> ToyModel:
    return ToyModel(vocab_size=96, hidden=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, seed=seed)


def make(model: ToyModel, plugins: Any, tokens: int, **kw: Any) -> Generator:
    gen = Generator(model, Cache(model, max_num_tokens=tokens, page_size=PAGE, plugins=plugins), None,
                    plugins=plugins, **kw)
    gen.eos_ids = set()
    return gen


def run_alone(model: ToyModel, plugins: Any, job: Job, tokens: int) -> list[int]:
    gen = make(model, plugins, tokens)
    twin = Job(job.prompt, max_new_tokens=job.max_new_tokens, sampler=job.sampler, seed=job.seed)
    gen.enqueue(twin)
    out: list[int] = []
    while gen.num_remaining():
        for r in gen.iterate():
            out += r["token_ids"]
    return out


def random_jobs(rng: random.Random, n: int, total: int, longest: int, vocab: int,
                priorities: bool = False) -> list[Job]:
    """``n`` jobs whose prompt and output lengths (heavy-tailed, each at most ``longest``) sum to ``total``."""
    weights = [min(rng.paretovariate(1.3), 40.0) for _ in range(n)]
    scale = total / sum(weights)
    sizes = [max(2, min(longest, round(w * scale))) for w in weights]
    i = 0
    while sum(sizes) != total:  # rounding and clipping: spread the difference
        d = 1 if sum(sizes) < total else -1
        if 2 <= sizes[i % n] + d <= longest:
            sizes[i % n] += d
        i += 1
    jobs = []
    for k, size in enumerate(sizes):
        prompt = rng.randint(1, size - 1)
        jobs.append(Job([rng.randrange(vocab) for _ in range(prompt)], max_new_tokens=size - prompt,
                        sampler=SAMPLERS[k % len(SAMPLERS)], seed=1000 + k, identifier=k,
                        priority=rng.choice([-1, 0, 0, 1]) if priorities else 0))
    return jobs


def soak(plugins: Any, *, n_jobs: int, cache_tokens: int, seed: int, max_batch: int, priorities: bool = False,
         cancel_rate: float = 0.08,
         bursts: tuple[int, ...] = (0, 1, 3, 6, 10)) -> tuple[Generator, dict[int, dict[str, Any]]]:
    """Random arrivals and cancels of ``n_jobs`` jobs whose lengths sum to 5x the cache; every job
    not cancelled must finish with its tokens identical to running alone, and no page may leak."""
    rng = random.Random(seed)
    model = tiny_model(seed)
    gen = make(model, plugins, cache_tokens, max_batch_size=max_batch, max_chunk_tokens=256, step_tokens=48)
    jobs = random_jobs(rng, n_jobs, 5 * cache_tokens, int(cache_tokens * 0.45), model.vocab_size, priorities)
    assert sum(len(j.prompt) + j.max_new_tokens for j in jobs) == 5 * cache_tokens
    pending = list(jobs)
    tokens: dict[int, list[int]] = {j.identifier: [] for j in jobs}
    done: dict[int, dict[str, Any]] = {}
    cancelled: set[int] = set()
    steps = 0
    while pending or gen.num_remaining():
        steps += 1
        assert steps < 50_000, "the soak does not converge"
        for _ in range(rng.choice(bursts)):  # bursty arrivals
            if pending:
                gen.enqueue(pending.pop(0))
        for r in gen.iterate():
            tokens[r["identifier"]] += r["token_ids"]
            if r["eos"]:
                assert r["eos_reason"] == "max_new_tokens", r  # never an error: no job fails for space
                entry: dict[str, Any] = {**r, "all_tokens": tokens[r["identifier"]]}
                done[r["identifier"]] = entry
        if rng.random() < cancel_rate:
            live = [j for j in jobs if j.status in ("queued", "active")]
            if live:
                victim = rng.choice(live)
                gen.cancel(victim)
                cancelled.add(victim.identifier)
        if steps % 16 == 0:
            gen.cache.allocator.check()
    assert set(done) | cancelled == {j.identifier for j in jobs} and not set(done) & cancelled
    alloc = gen.cache.allocator
    alloc.check()
    assert alloc.num_live() == 0 and alloc.num_available() == alloc.num_pages  # 0 pages leaked
    assert gen.scheduler.preemptions == sum(j.preemptions for j in jobs) > 0, gen.scheduler.preemptions
    for i, d in done.items():
        assert d["preemptions"] == jobs[i].preemptions
        assert d["all_tokens"] == run_alone(model, plugins, jobs[i], cache_tokens), f"job {i} ({jobs[i]!r})"
    return gen, done


def test_capacity_soak(plugins: Any) -> None:
    """200 jobs, 5x the cache in total, greedy and seeded-sampled, bursty arrivals and cancels."""
    _, done = soak(plugins, n_jobs=200, cache_tokens=1024, seed=44, max_batch=48)
    assert sum(r["preemptions"] > 0 for r in done.values()) >= 5  # preemption did happen, repeatedly


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "n_jobs", "cache_tokens", "max_batch"), [(1, 1000, 4096, 192), (2, 1000, 2048, 128),
                                                                         (3, 600, 1024, 96)])
def test_capacity_soak_long(plugins: Any, seed: int, n_jobs: int, cache_tokens: int,
                            max_batch: int) -> None:
    """The soak with up to 1000 jobs, mixed priorities and more cancels (run with ``-m slow``)."""
    soak(plugins, n_jobs=n_jobs, cache_tokens=cache_tokens, seed=seed, max_batch=max_batch, priorities=True,
         cancel_rate=0.15, bursts=(0, 4, 10, 25, 60))


def test_a_job_that_could_never_fit_fails_at_enqueue(plugins: Any) -> None:
    gen = make(tiny_model(), plugins, 256)
    with pytest.raises(ValueError, match="does not fit"):
        gen.enqueue(Job([1] * 256, max_new_tokens=1))
    # a long output is no reason: alone, the job runs to the cache's length and ends there
    gen.enqueue(Job([1] * 100, max_new_tokens=1000, identifier="long"))
    last = None
    while gen.num_remaining():
        for r in gen.iterate():
            last = r
    assert last is not None and last["eos_reason"] == "max_seq_len" and last["new_tokens"] == 256 - 100


def test_resumed_job_reuses_its_cached_pages(plugins: Any) -> None:
    """A preempted job's full pages stay in the prefix cache; resuming recomputes only what was
    evicted (here: nothing but its last partial page)."""
    model = tiny_model(3)
    gen = make(model, plugins, 16 * PAGE, max_batch_size=4)
    a = Job(list(range(1, 90)), max_new_tokens=60, identifier="a", seed=1, sampler={"temperature": 0.8})
    gen.enqueue(a)
    for _ in range(10):
        gen.iterate()
    gen.scheduler.preempt(a)
    assert a.status == "queued" and not a.pages and gen.queue[0] is a and a.preemptions == 1
    before = model.tokens_computed
    gen.iterate()  # admitted again: full pages matched, the rest prefilled in this step
    assert a.status == "active" and a.prefill_done
    recomputed = model.tokens_computed - before
    assert recomputed <= PAGE + 1, recomputed
    out = a.seq[len(a.prompt):]
    while gen.num_remaining():
        for r in gen.iterate():
            out += r["token_ids"]
    assert out == run_alone(model, plugins, a, 1024)


# -- the step budget ------------------------------------------------------------------------------
def record_plans(gen: Generator) -> list[list[tuple[Job, Chunk, bool]]]:
    """Each step's work as (job, chunk, is a decode row)."""
    plans: list[list[tuple[Job, Chunk, bool]]] = []
    plan: Callable[[], list[tuple[Job, Chunk]]] = gen.scheduler.plan

    def spy() -> list[tuple[Job, Chunk]]:
        work = plan()
        plans.append([(j, c, c.past == len(j.seq) - 1 and len(c.tokens) == 1) for j, c in work])
        return work

    gen.scheduler.plan = spy  # type: ignore[method-assign]
    return plans


def test_step_budget_is_shared_by_decode_rows_and_prefill(plugins: Any) -> None:
    model = tiny_model(5)
    gen = make(model, plugins, 4096, step_tokens=32, max_chunk_tokens=2048)
    stream = Job(list(range(1, 11)), max_new_tokens=400, identifier="stream")
    gen.enqueue(stream)
    while not stream.new_tokens:
        gen.iterate()
    plans = record_plans(gen)
    long = Job([(7 * i) % 96 for i in range(8 * 32)], max_new_tokens=3, identifier="long")
    gen.enqueue(long)
    gen.iterate()
    short = Job([5, 6, 7, 8, 9], max_new_tokens=3, identifier="short")
    gen.enqueue(short)
    produced = []
    while not long.new_tokens:
        n = stream.new_tokens
        gen.iterate()
        produced.append(stream.new_tokens - n)
    assert all(p == 1 for p in produced)  # the stream got a token in every step of the long prefill
    for work in plans:
        rows = sum(row for _, _, row in work)
        assert rows >= 1 and sum(len(c.tokens) for _, c, row in work if not row) <= 32 - rows
    # the short prompt did not wait behind the long one: prefilled whole in its first step
    first = next(w for w in plans if any(j is short for j, _, _ in w))
    assert [len(c.tokens) for j, c, _ in first if j is short] == [5]
    assert len(plans) >= 8  # the long prompt took about 8x256/32 steps
    # with no stream decoding, a prompt takes up to max_chunk_tokens in one step
    gen2 = make(model, plugins, 4096, step_tokens=32, max_chunk_tokens=2048)
    plans2 = record_plans(gen2)
    gen2.enqueue(Job([3] * 1500, max_new_tokens=1))
    gen2.iterate()
    assert [len(c.tokens) for _, c, _ in plans2[0]] == [1500]


def test_prefill_progresses_under_any_decode_load(plugins: Any) -> None:
    gen = make(tiny_model(6), plugins, 8192, step_tokens=32, max_batch_size=48)
    streams = [Job([i + 1, i + 2], max_new_tokens=500, identifier=i) for i in range(40)]
    gen.enqueue(streams)
    while not all(j.new_tokens for j in streams):
        gen.iterate()
    plans = record_plans(gen)
    late = Job([4] * 100, max_new_tokens=2, identifier="late")
    gen.enqueue(late)
    for _ in range(20):
        gen.iterate()
        if late.new_tokens:
            break
    assert late.new_tokens, "the prompt made no progress while 40 streams decoded"
    assert [sum(len(c.tokens) for j, c, _ in w if j is late) for w in plans][:13] == [8] * 12 + [100 % 8]


def test_step_budget_defaults_and_checks(plugins: Any) -> None:
    assert default_step_tokens(torch.device("cpu")) == STEP_TOKENS["cpu"]
    assert default_step_tokens(torch.device("cuda", 0)) == STEP_TOKENS["cuda"]
    gen = make(tiny_model(), plugins, 256)
    assert gen.scheduler.step_tokens == STEP_TOKENS["cpu"]
    with pytest.raises(ValueError, match="step_tokens"):
        make(tiny_model(), plugins, 256, step_tokens=0)


def test_text_and_stop_strings_survive_preemption(plugins: Any) -> None:
    """Stop strings, banned strings and the text stream are per-job state kept across a preemption."""
    model = ToyModel(vocab_size=264, hidden=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, seed=2)
    tok = ByteTokenizer(264)

    def run(tokens: int) -> tuple[dict[Any, str], int]:
        gen = Generator(model, Cache(model, max_num_tokens=tokens, page_size=PAGE, plugins=plugins), tok,
                        plugins=plugins, max_batch_size=8)
        gen.eos_ids = set()
        jobs = [Job(tok.encode(f"job {i} says "), max_new_tokens=120, identifier=i, seed=100 + i,
                    sampler={"temperature": 0.8}, banned_strings=["ab"], stop_conditions=["zzz"]) for i in range(6)]
        gen.enqueue(jobs)
        texts: dict[Any, str] = {}
        while gen.num_remaining():
            for r in gen.iterate():
                if r["eos"]:
                    texts[r["identifier"]] = r["full_completion"]
        return texts, gen.scheduler.preemptions

    small, preempted = run(16 * PAGE)
    big, none = run(4096)
    assert preempted > 0 and none == 0
    assert small == big


def test_short_prompt_is_not_queued_behind_a_long_one(plugins: Any) -> None:
    """A 5-token request after a 2000-token prompt gets its first token in the first step, while the
    long prompt still advances every step."""
    gen = make(tiny_model(8), plugins, 4096, max_chunk_tokens=256, step_tokens=256)
    long = Job([(3 * i) % 96 for i in range(2000)], max_new_tokens=2, identifier="long")
    short = Job([1, 2, 3, 4, 5], max_new_tokens=2, identifier="short")
    gen.enqueue([long, short])
    progress = []
    while not long.new_tokens:
        before = long.cached
        gen.iterate()
        progress.append(long.cached - before)
        if len(progress) == 1:
            assert short.new_tokens == 1  # first step: the short prompt was prefilled and sampled
    assert all(p >= 256 // 4 for p in progress[:-1]) and len(progress) <= -(-2000 // (256 - 5 - 1)) + 1
