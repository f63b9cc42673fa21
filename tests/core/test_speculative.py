"""Speculative decoding on toy models: the acceptance rule's distribution (chi-square), greedy and
deterministic identity with the plain generator under continuous batching and cancels, text handling
across committed drafts, page and prefix-cache bookkeeping of both caches, the draft-length policy, the
n-gram lookup and the construction errors. (The real model: tests/e2e/test_speculative_smol.py.)"""
from __future__ import annotations

import math
import random

import pytest
import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.cache import Cache
from exl3_core.cache.geometry import LayerGeometry
from exl3_core.filters import Filter
from exl3_core.generator import Generator, Job
from exl3_core.generator.draft_policy import DraftLength, expected_tokens, ideal_speedup
from exl3_core.generator.drafting import NgramDrafter
from exl3_core.generator.speculative import speculative_rule
from exl3_core.generator.toy import ByteTokenizer, ToyModel, _ToyConfig
from exl3_core.sampling import Sampler
from exl3_core.sampling.sampler import final_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 264


def chi2_sf(stat: float, dof: int) -> float:
    """Survival function of the chi-square distribution (regularised upper incomplete gamma)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_test(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed ``counts`` against cell probabilities ``probs`` (cells of probability 0 must be
    empty; they carry no degree of freedom)."""
    n = counts.sum()
    zero = probs <= 0
    assert int(counts[zero].sum()) == 0, "a cell the target excludes was drawn"
    exp = probs[~zero] * n
    stat = float(((counts[~zero] - exp) ** 2 / exp).sum())
    return chi2_sf(stat, int((~zero).sum()) - 1)


# -- the rule ----------------------------------------------------------------------------------
def _markov_run(P: torch.Tensor, Q: torch.Tensor, start: torch.Tensor, K: int, T: int, seed: int,
                lens_max: int | None = None) -> tuple[torch.Tensor, float]:
    """Speculative sampling of T tokens for every chain of ``start`` from the Markov chain with target rows P
    (probabilities, [V, V]) and draft rows Q; returns ``(tokens [N, T], acceptance rate)``."""
    g = torch.Generator().manual_seed(seed)
    N = start.shape[0]
    Vs = P.shape[0]
    chains = [[] for _ in range(N)]
    last = start.clone()
    drafted = accepted = 0
    while min(len(c) for c in chains) < T:
        d = torch.empty((N, K), dtype=torch.int64)
        q = torch.empty((N, K, Vs))
        prev = last
        for i in range(K):
            q[:, i] = Q[prev]
            d[:, i] = torch.multinomial(Q[prev], 1, generator=g).squeeze(1)
            prev = d[:, i]
        ctx = torch.cat([last[:, None], d], 1)  # the token before each target row
        target = torch.log(P[ctx])  # [N, K+1, V] final logits
        lens = torch.full((N,), K) if lens_max is None else torch.randint(0, lens_max + 1, (N,), generator=g)
        v = speculative_rule(target, d, lens, q, torch.rand((N, K), generator=g), torch.rand((N, K + 1), generator=g))
        assert bool(v.ok.all())
        m = v.accepted.tolist()
        tok = v.token.tolist()
        for b in range(N):
            chains[b] += d[b, :m[b]].tolist() + [tok[b]]
            last[b] = chains[b][-1]
        drafted += int(lens.sum())
        accepted += sum(m)
    return torch.tensor([c[:T] for c in chains]), accepted / max(drafted, 1)


def _joint(P: torch.Tensor, start: int, T: int) -> torch.Tensor:
    """Probabilities of every T-token continuation of ``start`` under the chain P (flattened, base V)."""
    Vs = P.shape[0]
    out = P[start]
    for _ in range(T - 1):
        out = (out.reshape(-1, 1) * P[torch.arange(out.numel()) % Vs]).reshape(-1)
    return out


def _index(tokens: torch.Tensor, Vs: int) -> torch.Tensor:
    idx = torch.zeros(tokens.shape[0], dtype=torch.int64)
    for t in range(tokens.shape[1]):
        idx = idx * Vs + tokens[:, t]
    return idx


@pytest.mark.parametrize("lens_max", [None, 3])
def test_rule_samples_the_target_distribution(lens_max: int | None) -> None:
    """24,000 chains of a 5-token Markov target, drafted by a different chain (ragged draft counts in the second
    case): the joint distribution of the first three committed tokens matches the target's (chi-square over
    125 cells), and not the draft's (the same test rejects it: it has power)."""
    Vs, K, T, N = 5, 3, 3, 24_000
    g = torch.Generator().manual_seed(7)
    P = torch.softmax(torch.randn(Vs, Vs, generator=g) * 1.5, -1)
    P[:, 4] = 0.0  # a token the target's sampler excludes (top-k style): never committed
    P /= P.sum(-1, keepdim=True)
    Q = torch.softmax(torch.randn(Vs, Vs, generator=g) * 1.5, -1)
    tokens, rate = _markov_run(P, Q, torch.zeros(N, dtype=torch.int64), K, T, seed=11, lens_max=lens_max)
    counts = torch.bincount(_index(tokens, Vs), minlength=Vs ** T).double()
    want = _joint(P.double(), 0, T)
    assert abs(float(want.sum()) - 1.0) < 1e-6
    assert chi2_test(counts, want) > 1e-3
    wrong = _joint(Q.double(), 0, T)
    stat = float(((counts - wrong * N) ** 2 / (wrong * N)).sum())
    assert chi2_sf(stat, Vs ** T - 1) < 1e-9
    assert 0.05 < rate < 0.95


def test_rule_acceptance_rate_is_sum_of_minimum() -> None:
    """One draft per sequence: it is accepted with probability sum_x min(p(x), q(x)) (Leviathan et al.)."""
    N, Vs = 40_000, 7
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(Vs, generator=g), -1)
    q = torch.softmax(torch.randn(Vs, generator=g), -1)
    d = torch.multinomial(q, N, replacement=True, generator=g)[:, None]
    target = torch.log(p).expand(N, 2, Vs)
    v = speculative_rule(target, d, torch.ones(N, dtype=torch.int64), q.expand(N, 1, Vs),
                         torch.rand((N, 1), generator=g), torch.rand((N, 2), generator=g))
    want = float(torch.minimum(p, q).sum())
    got = float(v.accepted.float().mean())
    assert abs(got - want) < 4 * math.sqrt(want * (1 - want) / N)
    # and the first committed token is p-distributed
    first = torch.where(v.accepted.bool(), d[:, 0], v.token)
    assert chi2_test(torch.bincount(first, minlength=Vs).double(), p.double()) > 1e-3


def test_rule_on_greedy_rows_accepts_the_argmax_prefix() -> None:
    """One-hot targets (a greedy job's final logits) and point-mass drafts: drafts are accepted exactly while
    they equal the argmax, then the argmax follows, whatever the uniforms."""
    S, K, Vs = 64, 4, 11
    g = torch.Generator().manual_seed(5)
    raw = torch.randn(S * (K + 1), Vs, generator=g)
    target = final_logits(raw, [Sampler.greedy()] * raw.shape[0]).view(S, K + 1, Vs)
    am = raw.argmax(-1).view(S, K + 1)
    keep = torch.rand(S, K, generator=g) < 0.7
    d = torch.where(keep, am[:, :K], (am[:, :K] + 1) % Vs)
    lens = torch.randint(0, K + 1, (S,), generator=g)
    v = speculative_rule(target, d, lens, None, torch.rand(S, K, generator=g), torch.rand(S, K + 1, generator=g))
    for s in range(S):
        m = 0
        while m < int(lens[s]) and int(d[s, m]) == int(am[s, m]):
            m += 1
        assert int(v.accepted[s]) == m and int(v.token[s]) == int(am[s, m])
    assert bool((v.probs[torch.arange(S), v.accepted] == 1).all())


# -- the generator -------------------------------------------------------------------------------
class MarkovModel:
    """Logits are ``table[input token]``: a Markov chain as a batch model (position-free, so drafts and
    targets are known distributions)."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.vocab_size = table.shape[0]
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.config = _ToyConfig([])
        self.loaded = True

    def cache_geometry(self) -> tuple[LayerGeometry, ...]:
        return (LayerGeometry("kv", 1, 8, 8),)

    def forward_batch(self, meta: BatchMeta, cache=None, *, fp32_logits: bool = True) -> torch.Tensor:
        ids = meta.input_ids if meta.logits_indices is None else meta.input_ids[meta.logits_indices]
        return self.table[ids].clone()


def test_sampled_jobs_through_the_generator_match_the_target(plugins) -> None:
    """6,000 sampled jobs of 3 tokens on a 4-token Markov target, drafted by a different Markov model with
    sampled drafts: the generator's outputs follow the target's distribution after its sampler (temperature,
    logit bias), and drafts were accepted and rejected along the way."""
    Vs, T = 4, 3
    g = torch.Generator().manual_seed(2)
    target = MarkovModel(torch.randn(Vs, Vs, generator=g) * 1.2)
    draft = MarkovModel(torch.randn(Vs, Vs, generator=g) * 1.2)
    sampler = Sampler.build(temperature=0.8, logit_bias={1: 0.5})
    gen = Generator(target, Cache(target, 1 << 16, page_size=4, plugins=plugins), None, max_batch_size=128,
                    draft_model=draft, draft_cache=Cache(draft, 1 << 16, page_size=4, plugins=plugins),
                    num_draft_tokens=3, dynamic_draft=False)
    N = 6000
    jobs = [Job([2, 0], max_new_tokens=T, sampler=sampler, seed=i, identifier=i, stop_at_eos=False)
            for i in range(N)]
    gen.enqueue(jobs)
    out: dict[int, list[int]] = {}
    while gen.num_remaining():
        for r in gen.iterate():
            out.setdefault(r["identifier"], []).extend(r["token_ids"])
    assert gen.cache.allocator.num_live() == 0 and gen.spec.drafter.cache.allocator.num_live() == 0
    tokens = torch.tensor([out[i] for i in range(N)])
    P = torch.softmax(final_logits(target.table, [sampler] * Vs), -1).double()
    assert chi2_test(torch.bincount(_index(tokens, Vs), minlength=Vs ** T).double(), _joint(P, 0, T)) > 1e-3
    s = gen.spec.stats
    assert 0 < s.accepted < s.drafted


def toy(seed: int = 1, vocab: int = V, **kw) -> ToyModel:
    return ToyModel(vocab_size=vocab, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, seed=seed,
                    **kw)


@pytest.fixture(scope="module")
def target() -> ToyModel:
    return toy(1)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 70, (n,), generator=g).tolist()
    # some prompts repeat a phrase, so that n-gram lookups find matches
    return [torch.randint(0, 256, (k,), generator=g).tolist() * (1 + i % 2) for i, k in enumerate(lens)]


def drive(gen: Generator, jobs: list[Job], *, arrivals: dict[int, list[Job]] | None = None,
          cancel_at: dict[int, Job] | None = None) -> dict:
    """Iterate to the end; ``arrivals[step]`` are enqueued and ``cancel_at[step]`` cancelled before that step.
    Returns identifier -> (tokens, final result)."""
    gen.enqueue(jobs)
    toks: dict = {}
    final: dict = {}
    step = 0
    pending = dict(arrivals or {})
    while gen.num_remaining() or pending:
        if step in pending:
            gen.enqueue(pending.pop(step))
        if cancel_at and step in cancel_at:
            gen.cancel(cancel_at[step])
        for r in gen.iterate():
            toks.setdefault(r["identifier"], []).extend(r["token_ids"])
            if r["eos"]:
                final[r["identifier"]] = r
        step += 1
    return {k: (toks.get(k, []), final.get(k)) for k in set(toks) | set(final)}


def make(model, plugins, *, tokens: int = 8192, page_size: int = 16, draft=None, draft_tokens: int | None = None,
         **kw) -> Generator:
    cache = Cache(model, tokens, page_size=page_size, plugins=plugins)
    if draft is not None:
        dc = Cache(draft, draft_tokens or tokens, page_size=page_size, plugins=plugins)
        kw.update(draft_model=draft, draft_cache=dc)
    return Generator(model, cache, ByteTokenizer(model.vocab_size), plugins=plugins, **kw)


def check_clean(gen: Generator) -> None:
    gen.cache.allocator.check()
    assert gen.cache.allocator.num_live() == 0
    if gen.spec is not None and hasattr(gen.spec.drafter, "cache"):
        gen.spec.drafter.cache.allocator.check()
        assert gen.spec.drafter.cache.allocator.num_live() == 0


DRAFTERS = {
    "self": lambda m: {"draft": m},
    "random": lambda m: {"draft": ToyModel(vocab_size=m.vocab_size, hidden=16, num_layers=1, num_heads=2,
                                           num_kv_heads=1, head_dim=8, seed=9)},
    "ngram": lambda m: {"ngram_draft_tokens": 5},
}


@pytest.mark.parametrize("kind", list(DRAFTERS))
@pytest.mark.parametrize("dynamic", [False, True])
def test_greedy_identity_batched_with_arrivals_and_cancels(target, plugins, kind: str, dynamic: bool) -> None:
    """Twelve greedy jobs, some arriving later and two cancelled mid-way, with max_batch_size 5 so that jobs
    queue: every job that finishes has exactly the plain generator's tokens; no page of either cache stays
    live, and the prefix cache holds the same pages (hashes) as after the plain run."""
    ps = prompts(12, seed=3)
    max_new = [5 + (7 * i) % 30 for i in range(12)]

    def jobs(lo: int, hi: int) -> list[Job]:
        return [Job(ps[i], max_new_tokens=max_new[i], identifier=i, stop_at_eos=False) for i in range(lo, hi)]

    def run(**kw) -> tuple[dict, Generator]:
        gen = make(target, plugins, max_batch_size=5, max_chunk_tokens=64, **kw)
        first, later = jobs(0, 6), jobs(6, 12)
        res = drive(gen, first, arrivals={2: later[:3], 5: later[3:]}, cancel_at={3: first[1], 9: later[4]})
        check_clean(gen)
        return res, gen

    plain, pgen = run()
    spec, sgen = run(dynamic_draft=dynamic, num_draft_tokens=4, **DRAFTERS[kind](target)) if kind != "ngram" else \
        run(dynamic_draft=dynamic, **DRAFTERS[kind](target))
    done = [i for i in range(12) if i not in (1, 10)]
    for i in done:
        assert spec[i][0] == plain[i][0], f"job {i}"
        assert spec[i][1]["eos_reason"] == plain[i][1]["eos_reason"] == "max_new_tokens"
    for i in (1, 10):  # cancelled: no final result; both outputs so far are prefixes of one continuation
        (a, fa), (b, fb) = spec.get(i, ([], None)), plain.get(i, ([], None))
        assert fa is None and fb is None
        n = min(len(a), len(b))
        assert a[:n] == b[:n]
    assert set(sgen.cache.allocator.by_hash) == set(pgen.cache.allocator.by_hash)
    st = sgen.spec.stats
    if not dynamic:
        assert st.steps > 0 and st.drafted > 0
        if kind == "self":
            assert st.accepted == st.drafted  # its own argmax: every draft accepted
        if kind == "random":
            assert st.accepted < st.drafted // 2  # mostly rejected: rollback exercised
    results = [spec[i][1] for i in done]
    assert sum(r["draft_tokens"] for r in results) <= st.drafted
    assert all(r["accepted_draft_tokens"] <= r["draft_tokens"] for r in results)


def test_deterministic_samplers_and_text_rules_match_the_plain_generator(plugins) -> None:
    """Penalties, logit bias and temperature 0 (deterministic, not greedy), a banned string that rolls back
    and a stop string, each drafted by the model itself and by n-gram lookup: the same text and tokens as the
    plain generator."""
    model = toy(4, vocab=128, scale=3.0)  # ASCII only: the text rules see readable strings
    free = make(model, plugins)
    base_prompt = list(b"the cat sat on the mat, the cat sat on the")
    text = free.generate(torch.tensor(base_prompt), max_new_tokens=40, stop_at_eos=False)
    assert len(text) > 30
    banned, stop = text[8:10], text[25:28]
    cases = [
        {"sampler": Sampler.build(temperature=0, repetition_penalty=1.4, frequency_penalty=0.3,
                                  logit_bias={ord("e"): 2.0}, penalty_window=16)},
        {"banned_strings": [banned]},
        {"stop_conditions": [stop]},
    ]
    for case in cases:
        def run(case: dict = case, **kw) -> dict:
            gen = make(model, plugins, **kw)
            jobs = [Job(base_prompt, max_new_tokens=40, identifier=0, stop_at_eos=False, **case),
                    Job(base_prompt[5:], max_new_tokens=33, identifier=1, stop_at_eos=False, **case)]
            out = drive(gen, jobs)
            check_clean(gen)
            return out

        plain = run()
        for kw in ({"draft": model, "num_draft_tokens": 3, "dynamic_draft": False},
                   {"ngram_draft_tokens": 4, "dynamic_draft": False}):
            spec = run(**kw)
            for i in (0, 1):
                assert spec[i][0] == plain[i][0], (case, kw)
                a, b = spec[i][1], plain[i][1]
                assert a["full_completion"] == b["full_completion"] and a["eos_reason"] == b["eos_reason"]
                assert a["job"].draft_tokens > 0
            if "banned_strings" in case:
                assert spec[0][1]["job"].rollbacks > 0 and banned not in spec[0][1]["full_completion"]
            if "stop_conditions" in case:
                assert spec[0][1]["eos_reason"] == "stop_string"


def test_probabilities_and_logits_are_reported_per_committed_token(target, plugins) -> None:
    """return_probs/return_logits under speculation: one probability and one logits row per token, equal to the
    plain generator's (greedy: the target's own rows)."""
    def run(**kw) -> list:
        gen = make(target, plugins, **kw)
        gen.enqueue(Job(list(b"abcabcabcabc"), max_new_tokens=20, stop_at_eos=False, return_probs=True,
                        return_logits=True, identifier=0))
        res = []
        while gen.num_remaining():
            res += [r for r in gen.iterate() if r["token_ids"]]
        check_clean(gen)
        return res

    plain, spec = run(), run(draft=target, num_draft_tokens=4, dynamic_draft=False)
    pt = [t for r in plain for t in r["token_ids"]]
    st = [t for r in spec for t in r["token_ids"]]
    assert pt == st
    pp = torch.tensor([p for r in plain for p in r["token_probs"]])
    sp = torch.tensor([p for r in spec for p in r["token_probs"]])
    torch.testing.assert_close(sp, pp)
    torch.testing.assert_close(torch.cat([r["logits"] for r in spec]), torch.cat([r["logits"] for r in plain]),
                               rtol=1e-4, atol=1e-4)


def test_random_jobs_with_speculation_and_cancels_free_every_page(target, plugins) -> None:
    """Random arrivals, lengths, samplers and cancels with a small cache (pages evicted and shared): both
    caches end with no live page and consistent allocators; finished greedy jobs equal a plain run of them."""
    rng = random.Random(4)
    draft = DRAFTERS["random"](target)["draft"]
    gen = make(target, plugins, tokens=1024, page_size=8, draft=draft, draft_tokens=1024, max_batch_size=6,
               max_chunk_tokens=48, num_draft_tokens=3)
    base = prompts(6, seed=8)
    jobs = []
    for i in range(24):
        p = rng.choice(base)[:rng.randint(1, 60)] + [rng.randrange(256)]
        sampler = None if i % 3 else Sampler.build(temperature=0.7, top_k=20)
        jobs.append(Job(p, max_new_tokens=rng.randint(1, 25), identifier=i, sampler=sampler, seed=i))
    live: list[Job] = []
    out: dict = {}
    finished: list[Job] = []
    while jobs or gen.num_remaining():
        if jobs and rng.random() < 0.5:
            j = jobs.pop()
            live.append(j)
            gen.enqueue(j)
        if live and rng.random() < 0.05:
            gen.cancel(live.pop(rng.randrange(len(live))))
        for r in gen.iterate():
            out.setdefault(r["identifier"], []).extend(r["token_ids"])
            if r["eos"]:
                assert r.get("error") is None, r.get("error")
                finished.append(r["job"])
        gen.cache.allocator.check()
        gen.spec.drafter.cache.allocator.check()
    check_clean(gen)
    assert gen.spec.stats.steps > 0
    greedy = [j for j in finished if j.sampler.is_greedy]
    plain = make(target, plugins, max_batch_size=32)
    ref = drive(plain, [Job(j.prompt, max_new_tokens=j.max_new_tokens, identifier=j.identifier) for j in greedy])
    assert len(greedy) >= 5 and all(out[j.identifier] == ref[j.identifier][0] for j in greedy)


# -- policy and lookups ----------------------------------------------------------------------------
def test_expected_tokens_matches_simulation() -> None:
    g = torch.Generator().manual_seed(0)
    for alpha, k in [(0.6, 3), (0.8, 5), (0.9, 2), (1.0, 4)]:
        acc = torch.rand(200_000, k, generator=g) < alpha
        sim = float(acc.long().cumprod(1).sum(1).float().mean()) + 1
        assert abs(sim - expected_tokens(alpha, k)) < 0.02
        assert ideal_speedup(alpha, k, 0.25) == pytest.approx(expected_tokens(alpha, k) / (0.25 * k + 1))


def test_dynamic_length_follows_acceptance_and_costs() -> None:
    jobs = [Job([1, 2], max_new_tokens=100, identifier=i) for i in range(2)]
    pol = DraftLength(6, draft_cost=0.3, probe_every=4)
    assert pol.needs_timing(2) and pol.choose(jobs, [6, 6]) == [0, 0]
    pol.record_target(2, 1, 0.010)
    pol.record_target(2, 5, 0.011)
    est = pol.estimates()
    assert est["target_ms"] == pytest.approx({"2x1": 10.0, "2x5": 11.0}) and est["draft_ms"] == {}
    for _ in range(10):
        pol.record_acceptance(jobs[0], 6, 6)  # always accepted
        pol.record_acceptance(jobs[1], 6, 0)  # never
    ks = pol.choose(jobs, [6, 6])
    assert ks[0] >= 4 and ks[1] == 0
    assert pol.choose(jobs, [2, 6])[0] == 2  # the cap binds
    # drafting that costs more than it brings: plain, then one probe after probe_every plain steps
    pol.record_draft(2, 0.05)
    assert pol.choose(jobs, [6, 6]) == [0, 0]
    for _ in range(4):
        pol.note_step(False)
    assert pol.choose(jobs, [6, 6]) == [1, 1]
    pol.note_step(True)
    assert pol.choose(jobs, [6, 6]) == [0, 0]
    # a probe that did not pay: the next comes after twice as many plain steps
    for n in range(1, 9):
        pol.note_step(False)
        assert pol.choose(jobs, [6, 6]) == ([1, 1] if n == 8 else [0, 0])
    pol.note_step(True)
    # once drafting pays again, probes return to their first interval
    for _ in range(40):  # the running average of the draft's cost follows cheaper measurements
        pol.record_draft(2, 0.0001)
    assert any(pol.choose(jobs, [6, 6]))
    pol.note_step(True)
    for _ in range(40):
        pol.record_draft(2, 0.05)
    for n in range(1, 5):
        pol.note_step(False)
        assert pol.choose(jobs, [6, 6]) == ([1, 1] if n == 4 else [0, 0])
    fixed = DraftLength(3, dynamic=False)
    assert fixed.choose(jobs, [6, 1]) == [3, 1]


def test_catch_up_forwards_stay_out_of_the_draft_cost(target, plugins) -> None:
    """A step whose draft first catches up tokens it never saw (the prompt; a plain step's token) feeds the cost
    model no per-forward draft time: that cost follows what was missed, not the draft length."""
    gen = make(target, plugins, draft=target, num_draft_tokens=3, dynamic_draft=False)
    assert gen.spec is not None
    proposals, recorded = [], []
    propose, shifted, record = gen.spec.drafter.propose, gen.spec.drafter.propose_shifted, gen.spec.length.record_draft

    def spy_propose(*args):
        prop = propose(*args)
        proposals.append(prop)
        return prop

    def spy_shifted(*args):
        prop = shifted(*args)
        proposals.append(prop)
        return prop

    gen.spec.drafter.propose, gen.spec.drafter.propose_shifted = spy_propose, spy_shifted
    gen.spec.length.record_draft = lambda batch, seconds: recorded.append(seconds) or record(batch, seconds)
    drive(gen, [Job(prompts(1, seed=5)[0], max_new_tokens=24, identifier=0, stop_at_eos=False)])
    with_catch_up = [p for p in proposals if p.catch_up]
    assert with_catch_up and all(p.forwards == max(p.lens) for p in proposals)
    assert gen.spec.stats.ahead > 0 and gen.spec.stats.ahead_dropped == 0  # each proposal was verified
    assert len(recorded) == len(proposals) - len(with_catch_up) > 0
    assert gen.spec.stats.draft_forwards == sum(p.forwards + p.catch_up for p in proposals)


def test_ngram_lookup_prefers_longest_recent_match_and_corpus() -> None:
    d = NgramDrafter(max_n=3, min_n=1, corpus=[[50, 51, 52, 53, 54]])
    j = Job([1, 2, 3, 9, 1, 2, 3, 7, 8, 4, 2, 3], max_new_tokens=10)
    # last 3-gram (4, 2, 3) never occurred; 2-gram (2, 3) latest at index 5 -> continuation 7, 8, 4
    assert d.lookup(j, 3) == [7, 8, 4]
    j.seq += [51, 52]
    assert d.lookup(j, 4) == [53, 54]  # from the corpus (the job's own context has no (51, 52) before)
    j.seq += [99]
    assert d.lookup(j, 4) == []
    # a rollback rebuilds the index from the rewritten sequence: as a fresh drafter indexes it
    del j.seq[-3:]
    j.seq += [2, 3]
    j.rollbacks += 1
    assert d.lookup(j, 2) == [2, 3]
    fresh = NgramDrafter(max_n=3, min_n=1)
    fresh.lookup(j, 1)
    assert d._jobs[j].tables == fresh._jobs[j].tables


# -- construction errors -------------------------------------------------------------------------
class OtherTokenizer(ByteTokenizer):
    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.pieces[300 % vocab_size] = b"zz"


def test_bad_draft_configurations_fail_at_construction(target, plugins) -> None:
    cache = Cache(target, 1024, page_size=16, plugins=plugins)
    tok = ByteTokenizer(V)
    small = toy(2)

    def gen(**kw):
        return Generator(target, cache, tok, plugins=plugins, **kw)

    def dcache(m, n: int = 1024) -> Cache:
        return Cache(m, n, page_size=16, plugins=plugins)

    with pytest.raises(ValueError, match="num_draft_tokens=0 must be an integer >= 1"):
        gen(draft_model=small, draft_cache=dcache(small), num_draft_tokens=0)
    other = toy(3, vocab=300)
    with pytest.raises(ValueError, match="vocabulary has 300 tokens but the model's has 264"):
        gen(draft_model=other, draft_cache=dcache(other))
    with pytest.raises(ValueError, match="draft tokenizer differs from the model's"):
        gen(draft_model=small, draft_cache=dcache(small), draft_tokenizer=OtherTokenizer(V))
    with pytest.raises(ValueError, match="draft_cache holds 512 tokens but the model's cache holds 1024"):
        gen(draft_model=small, draft_cache=dcache(small, 512))
    with pytest.raises(ValueError, match="needs draft_cache"):
        gen(draft_model=small)
    with pytest.raises(ValueError, match="the model's own cache"):
        gen(draft_model=small, draft_cache=cache)
    narrow = ToyModel(vocab_size=V, hidden=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, seed=9)
    with pytest.raises(ValueError, match="built for another model"):
        gen(draft_model=narrow, draft_cache=dcache(small))
    with pytest.raises(ValueError, match="draft_cache given without draft_model"):
        gen(draft_cache=dcache(small))
    with pytest.raises(ValueError, match="not both"):
        gen(draft_model=small, draft_cache=dcache(small), ngram_draft_tokens=3)
    with pytest.raises(ValueError, match="ngram_draft_tokens=-1"):
        gen(ngram_draft_tokens=-1)
    assert gen(draft_model=small, draft_cache=dcache(small)).spec is not None
    assert gen().spec is None


def test_self_draft_of_sampled_jobs_with_penalties_is_accepted(target, plugins) -> None:
    """A model drafting for itself with the job's own sampler, penalties included (their history holds the
    drafts before each position): q equals p, so (almost) every draft is accepted."""
    gen = make(target, plugins, draft=target, num_draft_tokens=4, dynamic_draft=False)
    sampler = Sampler.build(temperature=0.9, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.2)
    jobs = [Job(p, max_new_tokens=30, sampler=sampler, seed=i, identifier=i, stop_at_eos=False)
            for i, p in enumerate(prompts(4, seed=5))]
    drive(gen, jobs)
    check_clean(gen)
    s = gen.spec.stats
    assert s.drafted > 50 and s.accepted >= 0.97 * s.drafted


def test_a_full_draft_cache_skips_drafts_not_jobs(target, plugins) -> None:
    """With almost every draft-cache page taken, jobs draft when pages are free and decode plainly otherwise:
    the same greedy tokens as without drafts, fewer drafts than with a free draft cache."""
    ps = prompts(6, seed=6)

    def run(gen: Generator) -> dict:
        out = drive(gen, [Job(p, max_new_tokens=20, identifier=i, stop_at_eos=False) for i, p in enumerate(ps)])
        return {i: out[i][0] for i in out}

    gen_kw = {"draft": target, "num_draft_tokens": 3, "dynamic_draft": False}
    plain = run(make(target, plugins))
    free = make(target, plugins, **gen_kw)
    assert run(free) == plain
    tight = make(target, plugins, **gen_kw)
    dc = tight.spec.drafter.cache
    held = dc.allocator.allocate(dc.num_pages - 12)  # room for about two sequences' drafts
    assert run(tight) == plain
    dc.allocator.release(held)
    check_clean(tight)
    assert 0 < tight.spec.stats.drafted < free.spec.stats.drafted


class EvenTokens(Filter):
    """Allows even token ids only; records what it is fed (as a boolean mask)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.seen: list[int] = []

    def reset(self) -> None:
        self.seen = []

    def accept_token(self, token: int) -> None:
        assert token % 2 == 0
        self.seen.append(token)

    def get_next_logit_mask(self) -> torch.Tensor:
        return torch.arange(self.vocab) % 2 == 0

    def is_completed(self) -> bool:
        return False


def test_filtered_jobs_decode_plainly_beside_drafting_jobs(target, plugins) -> None:
    """A job with a filter does not draft (its mask depends on every committed token) but runs in the same
    verification steps: its filter is fed exactly its tokens, in order, and every job equals the plain run."""
    ps = prompts(3, seed=9)

    def run(**kw) -> tuple[dict, EvenTokens]:
        f = EvenTokens(V)
        gen = make(target, plugins, **kw)
        jobs = [Job(ps[0], max_new_tokens=25, identifier=0, filters=[f], stop_at_eos=False),
                Job(ps[1], max_new_tokens=25, identifier=1, stop_at_eos=False),
                Job(ps[2], max_new_tokens=25, identifier=2, stop_at_eos=False)]
        out = drive(gen, jobs)
        check_clean(gen)
        return out, f

    plain, _ = run()
    spec, f = run(draft=target, num_draft_tokens=3, dynamic_draft=False)
    assert {i: spec[i][0] for i in spec} == {i: plain[i][0] for i in plain}
    assert f.seen == spec[0][0] and all(t % 2 == 0 for t in f.seen)
    assert spec[0][1]["draft_tokens"] == 0 and spec[1][1]["draft_tokens"] > 0


def test_ngram_corpus_drafts_a_known_continuation(target, plugins) -> None:
    """A corpus holding the greedy continuation: prompt lookup drafts from it and nearly everything is accepted."""
    p = prompts(1, seed=11)[0][:30]
    ref = drive(make(target, plugins), [Job(p, max_new_tokens=30, identifier=0, stop_at_eos=False)])[0][0]
    gen = make(target, plugins, ngram_draft_tokens=6, ngram_corpus=[p[-3:] + ref], dynamic_draft=False)
    out = drive(gen, [Job(p, max_new_tokens=30, identifier=0, stop_at_eos=False)])
    assert out[0][0] == ref
    s = gen.spec.stats
    assert s.accepted >= 0.8 * s.drafted and s.steps <= 10


def test_dynamic_rope_jobs_decode_alike_batched_drafted_and_alone(tmp_path) -> None:
    """Dynamic NTK RoPE rotates each token for its own length, so past max_position_embeddings a job's tokens do
    not depend on the other jobs of its batch, on prefill chunking or on verifying drafted rows in one step."""
    from exl3_core.archkit.config import Config
    from exl3_core.archkit.model import Model
    from exl3_core.testing.arch import build_checkpoint, tiny_variants

    cfg = tiny_variants("LlamaForCausalLM")["rope_dynamic"]
    build_checkpoint("LlamaForCausalLM", cfg, tmp_path, seed=3)
    model = Model.from_config(Config.from_directory(tmp_path)).load()
    max_pos = cfg.max_position_embeddings
    g = torch.Generator().manual_seed(8)
    loop = [5, 6, 7, 8] * 5  # a repeated stretch the n-gram drafter proposes from
    prompts = [torch.randint(0, cfg.vocab_size, (max_pos - 4,), generator=g).tolist() + loop,
               torch.randint(0, cfg.vocab_size, (9,), generator=g).tolist(), loop + [1, 2, 3]]

    def run(jobs_at: dict[int, int], **kw) -> tuple[dict[int, tuple[list[int], torch.Tensor]], Generator]:
        gen = Generator(model, Cache(model, max_num_tokens=1024, page_size=16), None, max_batch_size=4,
                        max_chunk_tokens=16, **kw)
        toks: dict[int, list[int]] = {}
        logits: dict[int, list[torch.Tensor]] = {}
        step = 0
        while gen.num_remaining() or any(s >= step for s in jobs_at):
            if step in jobs_at:
                i = jobs_at[step]
                gen.enqueue(Job(prompts[i], max_new_tokens=2 * max_pos, stop_at_eos=False, identifier=i,
                                return_logits=True))
            for r in gen.iterate():
                toks[r["identifier"]] = toks.get(r["identifier"], []) + r["token_ids"]
                logits.setdefault(r["identifier"], []).append(r["logits"].float().reshape(-1, cfg.vocab_size))
            step += 1
        return {i: (toks[i], torch.cat(logits[i])) for i in toks}, gen

    alone = {i: run({0: i})[0][i] for i in range(len(prompts))}
    batched, _ = run({0: 0, 1: 1, 3: 2})
    drafted, gen = run({0: 0, 1: 1, 3: 2}, ngram_draft_tokens=3)
    for i, (want, want_logits) in alone.items():
        for name, got in (("batched", batched[i]), ("drafted", drafted[i])):
            assert got[0] == want, f"job {i} {name}: other tokens than alone"
            torch.testing.assert_close(got[1], want_logits, rtol=1e-4, atol=1e-4, msg=f"job {i} {name}")
    assert gen.spec is not None and gen.spec.stats.accepted > 0, "no draft was accepted: the check is vacuous"
    check_clean(gen)
