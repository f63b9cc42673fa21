"""Overlapped (one-step-ahead) greedy decode: outputs and cache state equal the plain loop's, one
host read per token, at most one wasted forward per drain. Runs the eager model on the CPU with
the same pipeline code the GPU uses (the "device" is the CPU)."""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import pytest
import torch
from torch.overrides import TorchFunctionMode

from exl3_core.cache import Cache
from exl3_core.generator import Generator, Job
from exl3_core.generator import generator as generator_mod
from exl3_core.generator.overlap import HostRead
from exl3_core.generator.toy import ByteTokenizer, ToyModel
from exl3_core.tuning import Tuning

VOCAB = 264
TOK = ByteTokenizer(VOCAB)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prompt(seed: int, n: int = 20) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_gen(model, plugins, overlap: bool, *, page_size: int = 16, tokens: int = 4096, eos: set[int] | None = None,
             **kw) -> Generator:
    gen = Generator(model, Cache(model, tokens, page_size=page_size, plugins=plugins), TOK, plugins=plugins,
                    overlap_decode=overlap, **kw)
    gen.eos_ids = set(eos or ())
    return gen


Hook = Callable[[Generator, dict], None]


def drive(gen: Generator, jobs: list[Job], hook: Hook | None = None) -> dict:
    """Iterate until done; ``hook(gen, emitted)`` runs after every call (to enqueue or cancel).
    Returns per job its tokens, text and end, plus the allocator's final state."""
    gen.enqueue(jobs)
    out: dict = {}
    emitted: dict = {}
    calls = 0
    while gen.num_remaining():
        for r in gen.iterate():
            e = out.setdefault(r["identifier"], {"tokens": [], "text": ""})
            e["tokens"] += r["token_ids"]
            e["text"] += r["text"]
            emitted[r["identifier"]] = len(e["tokens"])
            if r["eos"]:
                e.update({k: r.get(k) for k in ("eos_reason", "stop_token", "full_completion", "new_tokens")})
        if hook is not None:
            hook(gen, emitted)
        calls += 1
        assert calls < 10_000
    return out


def cache_state(gen: Generator) -> tuple[dict, dict[bytes, torch.Tensor]]:
    """Page counts, prefix-cache LRU order (by hash) and every cached page's keys/values."""
    a = gen.cache.allocator
    a.check()
    counts = {"live": a.num_live(), "available": a.num_available(), "free": len(a.free),
              "lru": [a.page_hash[p] for p in a.lru]}
    pages = {h: torch.cat([torch.stack([layer.k[p], layer.v[p]]).flatten() for layer in gen.cache.layers])
             for h, p in a.by_hash.items()}
    return counts, pages


def compare(model, plugins, make_jobs: Callable[[], list[Job]], hook: Hook | None = None, **kw) -> tuple[dict, Generator]:
    """Run the same jobs through the plain and the overlapped loop; assert identical outputs and
    cache state, and at most one extra forward per pipeline drain. Returns the plain results and
    the overlapped generator."""
    plain = make_gen(model, plugins, False, **kw)
    ref = drive(plain, make_jobs(), hook)
    over = make_gen(model, plugins, True, **kw)
    got = drive(over, make_jobs(), hook)
    assert got == ref
    (c_ref, p_ref), (c_got, p_got) = cache_state(plain), cache_state(over)
    assert c_got == c_ref and c_ref["live"] == 0
    assert p_got.keys() == p_ref.keys() and len(p_ref) > 0
    for h in p_ref:
        assert torch.allclose(p_got[h], p_ref[h], atol=1e-5), "a cached page's keys/values differ"
    pipe = over.pipeline
    assert pipe is not None and pipe.spec_launches > 0, "the overlapped loop never ran ahead"
    assert over.forward_calls <= plain.forward_calls + pipe.runs
    return ref, over


def free_tokens(model, plugins, p: list[int], n: int = 40) -> list[int]:
    """Greedy continuation of ``p`` with no stop condition (to pick stop conditions that trigger)."""
    gen = make_gen(model, plugins, False)
    return drive(gen, [Job(p, max_new_tokens=n, identifier=0)])[0]["tokens"]


def first_new(toks: list[int], start: int) -> int:
    """Index of the first token at or after ``start`` that did not occur before it."""
    return next(k for k in range(start, len(toks)) if toks[k] not in toks[:k])


def stop_string(toks: list[int], start: int) -> str:
    """Text of two consecutive one-byte generated tokens at or after ``start`` (spans tokens)."""
    k = next(k for k in range(start, len(toks) - 1) if toks[k] < 128 and toks[k + 1] < 128)
    return bytes(toks[k:k + 2]).decode()


@pytest.mark.parametrize("reason", ["max_new_tokens", "max_seq_len", "eos", "stop_token", "stop_string"])
def test_single_job_matches_plain_loop(model, plugins, reason: str) -> None:
    p = prompt(3)
    free = free_tokens(model, plugins, p)
    k = first_new(free, 9)
    eos: set[int] = set()
    kw: dict = {"max_new_tokens": 17 if reason == "max_new_tokens" else 40}
    gen_kw: dict = {"max_seq_len": 48} if reason == "max_seq_len" else {}
    if reason == "eos":
        eos = {free[k]}
    elif reason == "stop_token":
        kw["stop_conditions"] = [free[k]]
    elif reason == "stop_string":
        kw["stop_conditions"] = [stop_string(free, 6)]
    ref, over = compare(model, plugins, lambda: [Job(p, identifier=0, **kw)], eos=eos, **gen_kw)
    want = "stop_token" if reason == "eos" else reason
    assert ref[0]["eos_reason"] == want
    # an end known in advance (length) costs nothing; an unforeseen one discards one speculative row
    wasted = want not in ("max_new_tokens", "max_seq_len")
    assert over.forward_calls == 1 + (ref[0]["new_tokens"] - 1) + wasted  # prefill, decodes, wasted
    assert over.pipeline.discarded == wasted


def test_three_jobs_ending_differently(model, plugins) -> None:
    ps = [prompt(10, 20), prompt(11, 37), prompt(12, 9)]
    frees = [free_tokens(model, plugins, p) for p in ps]

    def jobs() -> list[Job]:
        return [Job(ps[0], max_new_tokens=13, identifier=0),
                Job(ps[1], max_new_tokens=40, stop_conditions=[frees[1][first_new(frees[1], 6)]], identifier=1),
                Job(ps[2], max_new_tokens=40, stop_conditions=[stop_string(frees[2], 15)], identifier=2)]

    ref, over = compare(model, plugins, jobs, page_size=4)
    assert [ref[i]["eos_reason"] for i in range(3)] == ["max_new_tokens", "stop_token", "stop_string"]
    assert over.pipeline.discarded == 2  # the two unforeseen ends


def test_job_joining_mid_decode_drains_and_resumes(model, plugins) -> None:
    late = Job(prompt(22, 100), max_new_tokens=8, identifier="late")

    def jobs() -> list[Job]:
        nonlocal late
        late = Job(prompt(22, 100), max_new_tokens=8, identifier="late")
        return [Job(prompt(20), max_new_tokens=30, identifier="a"), Job(prompt(21, 33), max_new_tokens=24, identifier="b")]

    def hook(gen: Generator, emitted: dict) -> None:
        if emitted.get("a") and emitted["a"] >= 6 and late.status == "new":
            gen.enqueue(late)

    # chunked prefill of the late prompt (64-token budget) runs in mixed steps with the decoding jobs
    ref, over = compare(model, plugins, jobs, hook, max_chunk_tokens=64)
    assert set(ref) == {"a", "b", "late"}
    assert over.pipeline.runs >= 2  # drained for the newcomer, resumed once everyone decodes


@pytest.mark.parametrize("cancel_at", [5, 6, 7, 8])
def test_cancel_mid_decode(model, plugins, cancel_at: int) -> None:
    """Page size 4: one of the cancel points falls where the in-flight step completed a page,
    whose prefix-cache registration must be undone."""
    def jobs() -> list[Job]:
        return [Job(prompt(30 + i, 13 + 5 * i), max_new_tokens=30, identifier=i) for i in range(3)]

    def hook(gen: Generator, emitted: dict) -> None:
        for i, at in ((1, cancel_at), (0, cancel_at + 3)):
            job = next((j for j in gen.active if j.identifier == i), None)
            if job is not None and emitted.get(i, 0) >= at:
                gen.cancel(job)

    ref, _ = compare(model, plugins, jobs, hook, page_size=4)
    assert ref[2]["eos_reason"] == "max_new_tokens"
    for i, at in ((1, cancel_at), (0, cancel_at + 3)):  # cancelled: no end result, no token after
        assert "eos_reason" not in ref[i] and len(ref[i]["tokens"]) == at


def test_speculation_never_evicts_prefix_pages(model, plugins) -> None:
    """A full cache whose only reclaimable pages hold a finished job's prefix: the step that ends
    the next job must not evict one of them for a speculative token (the plain loop never would)."""
    ps = 4
    pa = prompt(70, 21)  # + 4 new tokens: 24 cached tokens, 6 full pages left in the prefix cache
    for seed in range(71, 200):
        pb = prompt(seed, 10)
        free = free_tokens(model, plugins, pb)
        k = first_new(free, 3)
        if (len(pb) + k) % ps == 0:  # the ending step's speculative token would open a new page
            break
    else:
        pytest.fail("no prompt whose stop lands on a page boundary")
    pages = 24 // ps + (len(pb) + k) // ps

    def run(overlap: bool) -> tuple:
        gen = make_gen(model, plugins, overlap, page_size=ps, tokens=pages * ps)
        assert gen.cache.allocator.num_pages == pages
        a = drive(gen, [Job(pa, max_new_tokens=4, identifier="a")])
        b = drive(gen, [Job(pb, max_new_tokens=40, stop_conditions=[free[k]], identifier="b")])
        counts, _ = cache_state(gen)
        return a, b, counts

    ref, got = run(False), run(True)
    assert got == ref and ref[1]["b"]["eos_reason"] == "stop_token"
    assert len(ref[2]["lru"]) == pages  # b's pages joined a's, none of a's was evicted


def test_non_greedy_jobs_use_the_plain_loop(model, plugins) -> None:
    def jobs() -> list[Job]:
        return [Job(prompt(40), max_new_tokens=6, sampler="creative", seed=5, identifier="s"),
                Job(prompt(41), max_new_tokens=5, return_probs=True, identifier="p"),
                Job(prompt(42), max_new_tokens=25, identifier="g")]

    _, over = compare(model, plugins, jobs)
    assert over.pipeline.runs == 1  # only once the greedy job runs alone


def test_one_host_read_per_token(model, plugins, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside the model's forward, each overlapped call makes exactly one device->host read (the
    wait on the step's ids) and runs no sampler."""
    reads = {"n": 0, "waits": 0}
    in_forward = [False]
    names = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}

    class CountReads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if not in_forward[0] and getattr(func, "__name__", "") in names:
                reads["n"] += 1
            return func(*args, **(kwargs or {}))

    m = ToyModel(vocab_size=VOCAB, seed=1)
    forward = m.forward_batch

    def counted_forward(meta, cache=None, *, fp32_logits=True):
        in_forward[0] = True
        try:
            return forward(meta, cache, fp32_logits=fp32_logits)
        finally:
            in_forward[0] = False

    m.forward_batch = counted_forward  # type: ignore[method-assign]
    wait = HostRead.wait

    def counted_wait(self):
        reads["waits"] += 1
        return wait(self)

    monkeypatch.setattr(HostRead, "wait", counted_wait)
    for b in (1, 3):
        gen = make_gen(m, plugins, True)
        gen.enqueue([Job(prompt(50 + i), max_new_tokens=20, identifier=i) for i in range(b)])
        gen.iterate()  # prefill (a mixed step, sampled the plain way)
        monkeypatch.setattr(generator_mod, "sample", lambda *a, **k: pytest.fail("sampler ran in overlapped decode"))
        per_call = []
        while gen.num_remaining():
            reads["n"] = reads["waits"] = 0
            with CountReads():
                res = gen.iterate()
            assert {len(r["token_ids"]) for r in res} == {1} and len(res) == b
            per_call.append((reads["n"], reads["waits"]))
        monkeypatch.undo()
        monkeypatch.setattr(HostRead, "wait", counted_wait)
        assert per_call == [(1, 1)] * 19, b
        assert gen.pipeline.spec_launches == 18  # every step but the first ran ahead


def test_random_greedy_jobs_match_plain_loop(plugins) -> None:
    """Random arrivals, lengths, stop tokens/strings and cancels (by tokens seen), shared prefixes."""
    tiny = ToyModel(vocab_size=VOCAB, hidden=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, seed=7)
    rng = random.Random(3)
    base = prompt(60, 40)
    specs = []
    for i in range(14):
        p = base[:rng.randrange(0, 40)] + prompt(100 + i, rng.randrange(1, 20))
        stops: list = [rng.randrange(256) for _ in range(rng.randrange(0, 3))]
        if rng.random() < 0.3:
            stops.append(chr(rng.randrange(32, 127)))
        specs.append((p, rng.randrange(1, 30), stops, rng.randrange(2, 25) if rng.random() < 0.3 else None,
                      rng.randrange(0, 12)))

    def jobs() -> list[Job]:
        return [Job(p, max_new_tokens=n, stop_conditions=s, identifier=i)
                for i, (p, n, s, _, _) in enumerate(specs) if specs[i][4] == 0]

    def hook(gen: Generator, emitted: dict) -> None:
        gen.calls = getattr(gen, "calls", 0) + 1
        for i, (p, n, s, _, at) in enumerate(specs):
            if at == gen.calls:
                gen.enqueue(Job(p, max_new_tokens=n, stop_conditions=s, identifier=i))
        for j in list(gen.active):
            c = specs[j.identifier][3]
            if c is not None and emitted.get(j.identifier, 0) >= c:
                gen.cancel(j)

    plain = make_gen(tiny, plugins, False, page_size=4, max_batch_size=4)
    over = make_gen(tiny, plugins, True, page_size=4, max_batch_size=4)
    ref, got = drive(plain, jobs(), hook), drive(over, jobs(), hook)
    assert len(ref) > 5
    for i, spec in enumerate(specs):
        if spec[3] is None:
            assert got[i] == ref[i], i
        else:
            # a drain returns two steps in one call: a cancel "after c tokens seen" may come a
            # token later than in the plain loop, never with different tokens
            a, b = (got.get(i, {}).get("tokens", []), ref.get(i, {}).get("tokens", []))
            short, long = sorted((a, b), key=len)
            assert long[:len(short)] == short, i
    for gen in (plain, over):
        gen.cache.allocator.check()
        assert gen.cache.allocator.num_live() == 0
    assert over.pipeline.spec_launches > 0


def test_tuning_and_argument_turn_it_off(model, plugins) -> None:
    cache = Cache(model, 256, page_size=16, plugins=plugins)
    assert Generator(model, cache, TOK).pipeline is not None  # default on
    assert Generator(model, cache, TOK, overlap_decode=False).pipeline is None
    off = Tuning.generic()
    off = dataclasses.replace(off, graphs=dataclasses.replace(off.graphs, overlap_decode=False))
    gen = Generator(model, cache, TOK, tuning=off)
    assert gen.pipeline is None
    gen.enqueue(Job(prompt(1), max_new_tokens=4, identifier=0))
    while gen.num_remaining():
        gen.iterate()
