"""Generator: paged incremental decode, continuous batching, prefix reuse, errors, cancellation."""
from __future__ import annotations

import random

import pytest
import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.cache import Cache
from exl3_core.generator import Generator, Job
from exl3_core.generator.batching import Chunk, build_batch
from exl3_core.generator.toy import ByteTokenizer, ToyModel
from exl3_core.sampling import SamplerValueError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_gen(model, plugins, *, tokens: int = 4096, page_size: int = 16, **kw) -> Generator:
    cache = Cache(model, max_num_tokens=tokens, page_size=page_size, plugins=plugins)
    return Generator(model, cache, ByteTokenizer(model.vocab_size), plugins=plugins, **kw)


def run_all(gen: Generator, extra: dict[int, list[Job]] | None = None) -> dict:
    """Iterate to completion; ``extra[step]`` jobs are enqueued before that step. id -> final info."""
    out: dict = {}
    toks: dict = {}
    step = 0
    while gen.num_remaining() or (extra and any(s >= step for s in extra)):
        if extra and step in extra:
            gen.enqueue(extra[step])
        for r in gen.iterate():
            toks.setdefault(r["identifier"], []).extend(r["token_ids"])
            if r["eos"]:
                out[r["identifier"]] = dict(r, all_tokens=toks[r["identifier"]])
        step += 1
    return out


def rand_prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def test_paged_incremental_decode_equals_full_forward(model, plugins) -> None:
    """Uneven chunked prefill of two ragged sequences, then padded decode steps, through the
    generator's batch builder: every logit row matches one cache-less forward."""
    cache = Cache(model, max_num_tokens=512, page_size=16, plugins=plugins)
    seqs = [rand_prompt(90, 1), rand_prompt(61, 2)]
    pages = [cache.allocator.allocate(6)[::-1], cache.allocator.allocate(4)]  # non-contiguous order
    ref = [model.forward_batch(BatchMeta.full(torch.tensor([s])), None) for s in seqs]
    done = [0, 0]
    worst = 0.0
    for step in [[17, 5], [33, 40], [30, 6]] + [[1, 1]] * 10:
        chunks = [Chunk(seqs[b][done[b]:done[b] + step[b]], done[b], pages[b], True) for b in range(2)]
        decode = step == [1, 1]
        meta, rows = build_batch(chunks, page_size=16, table_width=8, scratch_page=cache.scratch_page,
                                 device=torch.device("cpu"), decode=decode)
        if decode:
            assert meta.input_ids.shape[0] == 2 and meta.page_table.shape == (2, 8)
        logits = model.forward_batch(meta, cache)[rows]
        for b in range(2):
            done[b] += step[b]
            worst = max(worst, float((logits[b] - ref[b][done[b] - 1]).abs().max()))
    assert worst < 1e-4


def test_decode_padding_uses_scratch_only(model, plugins) -> None:
    cache = Cache(model, max_num_tokens=256, page_size=16, plugins=plugins)
    chunks = [Chunk([5], 3, [2], True) for _ in range(3)]
    meta, rows = build_batch(chunks, page_size=16, table_width=4, scratch_page=cache.scratch_page,
                             device=torch.device("cpu"), decode=True)
    assert meta.input_ids.shape[0] == 4 and rows == [0, 1, 2]  # 3 rows padded to the bucket of 4
    assert int(meta.slot_mapping[3]) // 16 == cache.scratch_page
    assert meta.page_table[3].tolist() == [cache.scratch_page] * 4


def test_continuous_batching_matches_jobs_run_alone(model, plugins) -> None:
    lens = [1, 7, 700, 50, 255, 256, 257, 300, 511, 512, 513, 600, 3, 99, 420, 650]
    max_new = [1 + (i * 7) % 23 for i in range(16)]
    jobs = [Job(rand_prompt(n, 100 + i), max_new_tokens=m, identifier=i) for i, (n, m) in enumerate(zip(lens, max_new))]
    gen = make_gen(model, plugins, tokens=16384, max_chunk_tokens=300, max_batch_size=8)
    gen.enqueue(jobs[:10])
    together = run_all(gen, extra={3: jobs[10:13], 9: jobs[13:]})
    assert gen.cache.allocator.num_live() == 0
    for i, (n, m) in enumerate(zip(lens, max_new)):
        alone_gen = make_gen(model, plugins, tokens=2048)
        alone_gen.enqueue(Job(rand_prompt(n, 100 + i), max_new_tokens=m, identifier=i))
        alone = run_all(alone_gen)[i]
        assert together[i]["all_tokens"] == alone["all_tokens"], f"job {i} (prompt {n})"
        assert together[i]["eos_reason"] == alone["eos_reason"]


def test_prefix_cache_computes_only_new_tokens(model, plugins) -> None:
    prefix = rand_prompt(600, 7)  # 75 full pages of 8
    gen = make_gen(model, plugins, tokens=4096, page_size=8)
    a = Job(prefix + [1, 2, 3], max_new_tokens=20, identifier="a")
    gen.enqueue(a)
    for _ in range(3):  # a is prefilled and decoding: its pages are live
        gen.iterate()
    b_prompt = prefix + rand_prompt(45, 8)
    b = Job(b_prompt, max_new_tokens=6, identifier="b")
    gen.enqueue(b)
    early = [t for r in gen.iterate() if r["identifier"] == "b" for t in r["token_ids"]]
    # shared between two live jobs: same pages, two references each
    assert b.cached_tokens == 600 and b.pages[:75] == a.pages[:75]
    assert all(gen.cache.allocator.refcount[p] == 2 for p in a.pages[:75])
    res = run_all(gen)
    fresh = make_gen(model, plugins, tokens=4096, page_size=8)
    fresh.enqueue(Job(b_prompt, max_new_tokens=6, identifier="b"))
    assert run_all(fresh)["b"]["all_tokens"] == early + res["b"]["all_tokens"]
    # after both ended the prefix stays cached: a new job computes only its new tokens
    c_prompt = prefix + rand_prompt(45, 9)
    before = model.tokens_computed
    gen.enqueue(Job(c_prompt, max_new_tokens=6, identifier="c"))
    c = run_all(gen)["c"]
    assert c["cached_tokens"] == 600
    assert model.tokens_computed - before == 45 + 5  # 45 new prompt tokens, 5 decode inputs
    fresh = make_gen(model, plugins, tokens=4096, page_size=8)
    fresh.enqueue(Job(c_prompt, max_new_tokens=6, identifier="c"))
    assert run_all(fresh)["c"]["all_tokens"] == c["all_tokens"]
    gen.cache.allocator.check()
    assert gen.cache.allocator.num_live() == 0


def test_random_jobs_and_cancels_free_every_page(plugins) -> None:
    tiny = ToyModel(vocab_size=64, hidden=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, seed=3)
    cache = Cache(tiny, max_num_tokens=64 * 16, page_size=16, plugins=plugins)
    gen = Generator(tiny, cache, None, max_batch_size=32, max_chunk_tokens=256)
    gen.eos_ids = set()
    rng = random.Random(0)
    bases = [[rng.randrange(64) for _ in range(80)] for _ in range(4)]
    jobs: list[Job] = []
    ended: set[int] = set()
    submitted = 0
    while submitted < 1000 or gen.num_remaining():
        for _ in range(rng.randrange(0, 12) if submitted < 1000 else 0):
            base = bases[rng.randrange(4)][:rng.randrange(0, 80)]
            prompt = base + [rng.randrange(64) for _ in range(rng.randrange(1, 40))]
            j = Job(prompt, max_new_tokens=rng.randrange(1, 10), identifier=submitted,
                    sampler=None if rng.random() < 0.5 else {"temperature": 1.0, "top_k": 5}, seed=submitted)
            gen.enqueue(j)
            jobs.append(j)
            submitted += 1
        for r in gen.iterate():
            if r["eos"]:
                ended.add(r["identifier"])
                assert r["eos_reason"] != "error", r  # a job never fails for cache space
        if rng.random() < 0.3:
            live = [j for j in jobs if j.status in ("queued", "active")]
            if live:
                gen.cancel(rng.choice(live))
        cache.allocator.check()
    assert all(j.status in ("done", "cancelled") for j in jobs)
    assert {j.identifier for j in jobs if j.status == "done"} == ended
    assert cache.allocator.num_live() == 0
    assert cache.allocator.num_available() == cache.num_pages
    assert cache.allocator.hits > 0  # shared prefixes were reused


def test_prompt_longer_than_cache_fails_alone(model, plugins) -> None:
    gen = make_gen(model, plugins, tokens=256)
    ok = Job(rand_prompt(20, 1), max_new_tokens=5, identifier="ok")
    gen.enqueue(ok)
    with pytest.raises(ValueError, match="prompt of 300 tokens does not fit"):
        gen.enqueue(Job(rand_prompt(300, 2), max_new_tokens=5))
    res = run_all(gen)
    assert res["ok"]["eos_reason"] == "max_new_tokens" and len(res["ok"]["all_tokens"]) == 5


@pytest.mark.parametrize("draft", [0, 5])
def test_sequences_end_at_max_seq_len_between_page_boundaries(model, plugins, draft: int) -> None:
    """max_seq_len 41 with 16-token pages: the page table holds 3 pages, sequences still end at 41 tokens (with
    n-gram drafts proposing past it too), and a 41-token prompt is refused."""
    gen = make_gen(model, plugins, max_seq_len=41, ngram_draft_tokens=draft)
    assert gen.table_width == 3 and gen.max_seq_len == 41
    jobs = [Job(rand_prompt(n, n) + [7, 8, 9] * 3, max_new_tokens=100, stop_at_eos=False, identifier=n)
            for n in (5, 17, 30)]
    gen.enqueue(jobs)
    res = run_all(gen)
    for j in jobs:
        assert res[j.identifier]["eos_reason"] == "max_seq_len" and len(j.seq) == 41
    with pytest.raises(ValueError, match="at most 40 prompt tokens"):
        gen.enqueue(Job(rand_prompt(41, 3), max_new_tokens=1))
    assert gen.cache.allocator.num_live() == 0


def alone(model, plugins, job: Job, **kw) -> list[int]:
    """``job``'s tokens when it runs by itself in a cache that holds it easily."""
    gen = make_gen(model, plugins, tokens=4096, **kw)
    gen.eos_ids = set()
    twin = Job(job.prompt, max_new_tokens=job.max_new_tokens, sampler=job.sampler, seed=job.seed, identifier=0)
    gen.enqueue(twin)
    return run_all(gen)[0]["all_tokens"]


@pytest.mark.parametrize("sampler", [None, {"temperature": 0.9, "top_k": 50}])
def test_jobs_outgrowing_the_cache_together_are_preempted_not_failed(model, plugins, sampler) -> None:
    """Two jobs of 1000 + 600 tokens in a 1024-token cache (each fits alone): both finish, the
    newer one paused and recomputed, each with the output it has alone."""
    gen = make_gen(model, plugins, tokens=1024)
    gen.eos_ids = set()
    jobs = [Job(rand_prompt(n, i), max_new_tokens=m, sampler=sampler, seed=10 + i, identifier=i)
            for i, (n, m) in enumerate([(400, 600), (300, 300)])]
    gen.enqueue(jobs)
    res = run_all(gen)
    assert all(res[i]["eos_reason"] == "max_new_tokens" for i in range(2)), res
    assert res[0]["preemptions"] == 0 and res[1]["preemptions"] >= 1  # the newer job yields
    assert gen.scheduler.preemptions == res[1]["preemptions"]
    for i, j in enumerate(jobs):
        assert res[i]["all_tokens"] == alone(model, plugins, j), f"job {i}"
    gen.cache.allocator.check()
    assert gen.cache.allocator.num_live() == 0


def test_priority_decides_who_is_preempted_and_admitted(model, plugins) -> None:
    gen = make_gen(model, plugins, tokens=512, max_batch_size=2)
    gen.eos_ids = set()
    low = Job(rand_prompt(200, 1), max_new_tokens=150, identifier="low", priority=-1, seed=1)
    mid = Job(rand_prompt(100, 2), max_new_tokens=150, identifier="mid", seed=2)
    gen.enqueue([low, mid])
    for _ in range(3):
        gen.iterate()
    assert low.status == mid.status == "active"
    high = Job(rand_prompt(30, 3), max_new_tokens=20, identifier="high", priority=5, seed=3)
    gen.enqueue(high)
    assert gen.queue[0] is high
    gen.iterate()  # the batch is full: the high-priority job displaces the low one at once
    assert high.status == "active" and low.status == "queued" and low.preemptions == 1
    res = run_all(gen)
    assert res["high"]["preemptions"] == 0 and res["mid"]["preemptions"] == 0
    for j in (low, mid, high):
        assert res[j.identifier]["all_tokens"][-5:] == alone(model, plugins, j)[-5:]
        assert res[j.identifier]["new_tokens"] == j.max_new_tokens
    with pytest.raises(TypeError, match="priority"):
        Job([1], priority=1.5)


def test_invalid_sampler_values_fail_at_job_creation(model, plugins) -> None:
    gen = make_gen(model, plugins)
    gen.enqueue(Job([1, 2, 3], max_new_tokens=3, identifier="ok"))
    for bad in ({"temperature": -1.0}, {"top_p": 1.5}, {"min_p": -0.5}):
        with pytest.raises(SamplerValueError, match=next(iter(bad))):
            Job([1, 2], sampler=bad)
    with pytest.raises(SamplerValueError, match="outside the vocabulary"):
        gen.enqueue(Job([1, 2], sampler={"banned_tokens": [100000]}))
    with pytest.raises(ValueError, match="max_new_tokens"):
        Job([1], max_new_tokens=0)
    assert run_all(gen)["ok"]["eos_reason"] == "max_new_tokens"


def test_cancel_frees_pages_and_stops_results(model, plugins) -> None:
    gen = make_gen(model, plugins)
    a, b = Job(rand_prompt(100, 1), max_new_tokens=50, identifier="a"), Job(rand_prompt(30, 2), max_new_tokens=5,
                                                                            identifier="b")
    gen.enqueue([a, b])
    gen.iterate()
    gen.iterate()
    gen.cancel(a)
    assert a.status == "cancelled" and not a.pages
    res = run_all(gen)
    assert "a" not in res and res["b"]["eos_reason"] == "max_new_tokens"
    assert gen.cache.allocator.num_live() == 0


def test_seeded_sampling_is_independent_of_batch(model, plugins) -> None:
    def run(with_others: bool) -> list[int]:
        gen = make_gen(model, plugins)
        jobs = [Job(rand_prompt(30, 5), max_new_tokens=12, sampler="creative", seed=42, identifier="x")]
        if with_others:
            jobs += [Job(rand_prompt(10 + i, i), max_new_tokens=8, sampler="default", seed=i, identifier=i)
                     for i in range(5)]
        gen.enqueue(jobs[::-1])
        return run_all(gen)["x"]["all_tokens"]

    assert run(False) == run(True)


def test_generate_convenience(model, plugins) -> None:
    gen = make_gen(model, plugins)
    one = gen.generate(prompt="hello", max_new_tokens=8)
    many = gen.generate(prompt=["hello", "abc"], max_new_tokens=8)
    assert isinstance(one, str) and many[0] == one
    job = Job(ByteTokenizer(264).encode("abc"), max_new_tokens=8, identifier=0)
    gen.enqueue(job)
    assert run_all(gen)[0]["full_completion"] == many[1]
    tiny = make_gen(model, plugins, tokens=5 * 16)  # each fits alone, together they do not
    tiny.eos_ids = set()
    assert tiny.generate(prompt=["a" * 30, "b" * 30], max_new_tokens=45) == [
        make_gen(model, plugins).generate(prompt=p, max_new_tokens=45) for p in ("a" * 30, "b" * 30)]
    assert tiny.scheduler.preemptions >= 1


def test_return_probs_and_logits(model, plugins) -> None:
    gen = make_gen(model, plugins)
    prompt = rand_prompt(20, 3)
    gen.enqueue(Job(prompt, max_new_tokens=6, return_probs=True, return_logits=True, identifier=0))
    toks, probs, logits = [], [], []
    while gen.num_remaining():
        for r in gen.iterate():
            toks += r["token_ids"]
            probs += r["token_probs"]
            logits.append(r["logits"])
    lg = torch.cat(logits)
    full = model.forward_batch(BatchMeta.full(torch.tensor([prompt + toks])), None)[len(prompt) - 1:-1]
    assert lg.shape == (6, model.vocab_size) and (lg - full).abs().max() < 1e-4
    assert lg.argmax(-1).tolist() == toks
    sm = torch.softmax(full, -1).gather(1, torch.tensor(toks)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(probs), sm, atol=1e-5)


def test_stats_are_reported(model, plugins) -> None:
    gen = make_gen(model, plugins)
    gen.enqueue(Job(rand_prompt(40, 1), max_new_tokens=4, identifier=0))
    r = run_all(gen)[0]
    assert r["prompt_tokens"] == 40 and r["new_tokens"] == 4 and r["cached_tokens"] == 0
    assert r["time_prefill"] > 0 and r["time_generate"] >= 0 and r["time_queued"] >= 0


def test_capture_graphs_eager_and_refused_while_running() -> None:
    """On CPU there are no graphs to capture ([]); with a job queued the call is refused."""
    model = ToyModel(vocab_size=64, hidden=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, seed=3)
    gen = Generator(model, Cache(model, 256, page_size=4), None, max_batch_size=4)
    assert gen.graphs is None and gen.capture_graphs() == []
    gen.enqueue(Job([1, 2, 3], max_new_tokens=2))
    with pytest.raises(RuntimeError, match="jobs are queued or running"):
        gen.capture_graphs()
    while gen.num_remaining():
        gen.iterate()
    assert gen.capture_graphs() == []


def test_no_gc_around_captures() -> None:
    """Graph captures run with the garbage collector off (a collected old graph would invalidate
    the capture); its previous state comes back, after an exception too."""
    import gc

    from exl3_core.generator.graphs import no_gc

    assert gc.isenabled()
    with no_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), no_gc():
        raise KeyError("x")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_gc():
            pass
        assert not gc.isenabled()  # was off: stays off
    finally:
        gc.enable()


def test_logit_bias_plus_inf_through_the_python_api(model, plugins) -> None:
    gen = make_gen(model, plugins)
    gen.eos_ids = set()
    jobs = [Job(rand_prompt(12, s), max_new_tokens=6, sampler={"logit_bias": {5: float("inf")}, **extra}, seed=s,
                identifier=s) for s, extra in enumerate([{}, {"temperature": 0.0}, {"top_k": 3}])]
    gen.enqueue(jobs)
    res = run_all(gen)
    assert all(res[j.identifier]["all_tokens"] == [5] * 6 for j in jobs), res


class FaultyModel(ToyModel):
    """The toy model whose logits turn NaN (every entry) or +inf (one entry) for the sequences whose
    first cache page is in ``poisoned_pages``."""

    def __init__(self, value: float, **kw) -> None:
        super().__init__(**kw)
        self.value = value
        self.poisoned_pages: set[int] = set()

    def forward_batch(self, meta: BatchMeta, cache=None, *, fp32_logits: bool = True) -> torch.Tensor:
        logits = super().forward_batch(meta, cache, fp32_logits=fp32_logits).clone()
        cu = meta.cu_seqlens_q.tolist()
        rows = meta.logits_indices.tolist() if meta.logits_indices is not None else list(range(logits.shape[0]))
        for r, row in enumerate(rows):
            seq = next(b for b in range(len(cu) - 1) if cu[b] <= row < cu[b + 1])
            if int(meta.page_table[seq, 0]) in self.poisoned_pages:
                if self.value != self.value:
                    logits[r] = self.value
                else:
                    logits[r, 7] = self.value
        return logits


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("sampled", [False, True])
def test_nan_or_inf_logits_are_a_numeric_fault_naming_job_and_step(plugins, value: float, sampled: bool) -> None:
    from exl3_core.generator import NumericFault

    model = FaultyModel(value, vocab_size=264, seed=4)
    gen = make_gen(model, plugins)
    gen.eos_ids = set()
    sampler = {"temperature": 0.8, "top_p": 0.9} if sampled else None
    bad = Job(rand_prompt(20, 1), max_new_tokens=30, sampler=sampler, seed=1, identifier="bad-job")
    good = Job(rand_prompt(20, 2), max_new_tokens=30, sampler=sampler, seed=2, identifier="good-job")
    gen.enqueue([good, bad])
    for _ in range(4):  # both decode healthily first
        gen.iterate()
    assert bad.new_tokens >= 2
    model.poisoned_pages = {bad.pages[0]}
    step = gen.forward_calls + 1
    res = run_all(gen)
    err = res["bad-job"].get("error")
    assert isinstance(err, NumericFault), res["bad-job"]
    assert err.identifier == "bad-job" and err.step >= step and "'bad-job'" in str(err)
    assert f"step {err.step}" in str(err) and "relax the constraints" not in str(err)
    assert res["good-job"]["eos_reason"] == "max_new_tokens" and res["good-job"]["new_tokens"] == 30
    assert gen.cache.allocator.num_live() == 0
