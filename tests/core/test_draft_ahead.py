"""Drafting ahead (exl3_core.generator.speculative): a greedy step launches the next step's drafts before it reads
its verification, their positions moved on the device by what it accepted. The drafts are the ones drafting
after the commits proposes (ModelDrafter.propose_shifted against propose), the tokens those of the plain
generator, and drafts that no step verifies (a job ended, was cancelled or rolled back, a job joined) are
dropped without leaving a page live or a stale key the draft would read."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from exl3_core.cache import Cache
from exl3_core.generator import Generator, Job
from exl3_core.generator.drafting import ModelDrafter
from exl3_core.generator.toy import ByteTokenizer, ToyModel
from exl3_core.tuning import Tuning

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 264


def toy(seed: int, hidden: int = 32, layers: int = 2) -> ToyModel:
    return ToyModel(vocab_size=V, hidden=hidden, num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8,
                    seed=seed)


@pytest.fixture(scope="module")
def target() -> ToyModel:
    return toy(1)


def tuning(ahead: bool) -> Tuning:
    base = Tuning.for_device("cpu")
    return dataclasses.replace(base, graphs=dataclasses.replace(base.graphs, draft_ahead=ahead))


def generator(target: ToyModel, plugins, draft: ToyModel | None, ahead: bool, k: int = 3) -> Generator:
    kw = {}
    if draft is not None:
        kw = dict(draft_model=draft, draft_cache=Cache(draft, 8192, page_size=16, plugins=plugins),
                  num_draft_tokens=k, dynamic_draft=False)
    return Generator(target, Cache(target, 8192, page_size=16, plugins=plugins), ByteTokenizer(V), plugins=plugins,
                     max_batch_size=4, tuning=tuning(ahead), **kw)


def run(gen: Generator, jobs: list[Job], arrivals: dict[int, list[Job]], cancel_at: dict[int, Job]) -> dict:
    """identifier -> (tokens, eos reason or None); arrivals and cancels before the given iterations."""
    gen.enqueue(jobs)
    toks: dict = {}
    reason: dict = {}
    step = 0
    while gen.num_remaining() or arrivals:
        if step in arrivals:
            gen.enqueue(arrivals.pop(step))
        if step in cancel_at:
            gen.cancel(cancel_at[step])
        for r in gen.iterate():
            toks.setdefault(r["identifier"], []).extend(r["token_ids"])
            if r["eos"]:
                reason[r["identifier"]] = r["eos_reason"]
        step += 1
    gen.cache.allocator.check()
    assert gen.cache.allocator.num_live() == 0
    if gen.spec is not None:
        dcache = gen.spec.drafter.cache  # type: ignore[attr-defined]
        dcache.allocator.check()
        assert dcache.allocator.num_live() == 0
    return {i: (toks.get(i, []), reason.get(i)) for i in set(toks) | set(reason)}


@pytest.mark.parametrize("draft_seed", [1, 9], ids=["self", "random"])
def test_drafts_ahead_equal_drafts_after_and_tokens_equal_plain(target, plugins, draft_seed: int) -> None:
    """Five greedy jobs, one arriving later (a job waiting, then joining: drafts launched for the old batch
    dropped), one cancelled mid-way, two ended by a stop token the plain run produces mid-output (a step's
    commits ending a job its drafts were launched for). Each finished job has the plain generator's tokens
    and end; the draft fed each token once (no folded first step or catch-up more than drafting after the
    commits), a draft with the target's weights has every draft accepted (its keys and positions are right),
    every verification drafted ahead or says why not, and every page of both caches is free after."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 23, 40, 5, 31)]
    probe = run(generator(target, plugins, None, True),
                [Job(p, max_new_tokens=40, identifier=i, stop_at_eos=False) for i, p in enumerate(prompts)], {}, {})
    # a token each of these jobs first emits mid-way (or as late as there is one)
    stops = {i: [t for n, t in enumerate(out) if n >= 4 and t not in out[:n]][:3 + 2 * i][-1]
             for i in (0, 2) for out in [probe[i][0]]}

    def jobs() -> tuple[list[Job], list[Job]]:
        js = [Job(p, max_new_tokens=40, identifier=i, stop_at_eos=False,
                  stop_conditions=[stops[i]] if i in stops else ()) for i, p in enumerate(prompts)]
        return js[:4], js[4:]

    def once(draft: ToyModel | None, ahead: bool) -> tuple[dict, Generator]:
        gen = generator(target, plugins, draft, ahead)
        first, later = jobs()
        return run(gen, first, {1: later}, {9: first[3]}), gen

    plain, _ = once(None, True)
    draft = toy(draft_seed) if draft_seed != 1 else target
    after, g_after = once(draft, False)
    ahead, g_ahead = once(draft, True)
    for i in (0, 1, 2, 4):
        assert ahead[i] == after[i] == plain[i], f"job {i}"
    assert plain[0][1] == plain[2][1] == "stop_token" and plain[1][1] == "max_new_tokens"
    n = min(len(ahead[3][0]), len(plain[3][0]))  # cancelled: one continuation
    assert ahead[3][1] is None and ahead[3][0][:n] == plain[3][0][:n]
    a, b = g_ahead.spec.stats, g_after.spec.stats
    assert a.drafted > 0 and b.drafted > 0  # near a job's end drafting ahead drafts fewer (the longest outcome's cap)
    da, db = g_ahead.spec.drafter, g_after.spec.drafter  # the draft fed each token once, as when drafting after
    assert (da.folded_steps, da.catch_up_calls) == (db.folded_steps, db.catch_up_calls)  # type: ignore[attr-defined]
    assert b.ahead == 0 and b.not_ahead == {"turned off by the tuning": b.steps}
    # every verification drafted the next step ahead (verified or dropped) or says why not
    assert a.ahead + a.ahead_dropped + sum(a.not_ahead.values()) == a.steps
    assert a.ahead > 0 and a.ahead_dropped > 0 and a.not_ahead.get("a job waiting", 0) > 0
    if draft_seed == 1:
        assert a.accepted == a.drafted  # the target's own argmax, read from keys written ahead
    else:
        assert a.accepted < a.drafted


def test_banned_string_rollback_after_drafting_ahead(target, plugins) -> None:
    """A banned string that rolls a job back after a step drafted ahead for it: the drafts are dropped, the draft
    re-reads the rewritten sequence, and the tokens equal the plain generator's, which never emits the string."""
    prompt = torch.randint(0, 256, (17,), generator=torch.Generator().manual_seed(4)).tolist()
    probe = run(generator(target, plugins, None, True), [Job(prompt, max_new_tokens=30, stop_at_eos=False,
                                                             identifier=0)], {}, {})
    out = probe[0][0]
    i = next(i for i in range(8, len(out)) if 33 <= out[i] < 127)  # a printable byte the job emits mid-way
    text = chr(out[i])

    def once(draft: ToyModel | None) -> tuple[dict, Generator]:
        gen = generator(target, plugins, draft, True)
        job = Job(prompt, max_new_tokens=30, stop_at_eos=False, identifier=0, banned_strings=[text])
        return run(gen, [job], {}, {}), gen

    plain, _ = once(None)
    spec, gen = once(target)
    assert spec[0] == plain[0] and plain[0][0][:i] == out[:i] and text not in ByteTokenizer(V).decode(plain[0][0])
    st = gen.spec.stats
    assert st.ahead > 0 and st.ahead_dropped > 0


class _Forcing(ModelDrafter):
    """Proposes tokens that depend on the sequence's length (as the bench's draft does) while running every forward."""

    def _forced(self, jobs, seqs, K):  # noqa: ANN001, ANN202
        return torch.tensor([[(31 * len(q) + 7 * i + j.identifier) % V for i in range(K)] for j, q in zip(jobs, seqs)])


@pytest.mark.parametrize("cls", [ModelDrafter, _Forcing], ids=["greedy", "forced"])
def test_shifted_proposals_equal_proposals_after_the_commits(plugins, cls: type[ModelDrafter]) -> None:
    """Over rounds of three jobs (a padded bucket) accepting 0 to all of their drafts: the drafts proposed with the
    accepted counts and the last two tokens on the device, before the host knows them, equal those of a twin
    drafter that commits first and proposes after, and once settled the draft state is the twin's."""
    draft = toy(9, hidden=16, layers=1)
    K = 3

    def drafter() -> ModelDrafter:
        return cls(draft, Cache(draft, 2048, page_size=8, plugins=plugins), max_seq_len=256)

    a, b = drafter(), drafter()
    g = torch.Generator().manual_seed(5)
    ja = [Job(torch.randint(0, 256, (n,), generator=g).tolist(), max_new_tokens=64, identifier=i)
          for i, n in enumerate((13, 30, 7))]
    jb = [Job(list(j.seq), max_new_tokens=64, identifier=j.identifier) for j in ja]
    pa, pb = a.propose(ja, [K] * 3), b.propose(jb, [K] * 3)
    for r in range(4):
        assert pa.ids is not None and pb.ids is not None
        da, db = pa.ids.tolist(), pb.ids.tolist()
        assert da == db, f"round {r}"
        m = [(r + i) % (K + 1) for i in range(3)]  # every count from none to all
        bonus = [int(torch.randint(0, V, (), generator=g)) for _ in range(3)]
        last_two = torch.tensor([[([j.seq[-1]] + d)[mm], t] for j, d, mm, t in zip(ja, da, m, bonus)])
        pa = a.propose_shifted(ja, [K] * 3, torch.tensor(m), last_two)
        assert pa is not None
        for j, d, mm, t in zip(ja, da, m, bonus):
            a.settle(j, d, j.seq + d[:mm] + [t], K)
            j.seq += d[:mm] + [t]
        for j, d, mm, t in zip(jb, db, m, bonus):
            j.seq += d[:mm] + [t]
            b.commit(j, d)
        pb = b.propose(jb, [K] * 3)
        for x, y in zip(ja, jb):
            sa, sb = a._seqs[x], b._seqs[y]
            assert (sa.tokens, sa.drafted_from, sa.pending) == (sb.tokens, sb.drafted_from, sb.pending)
    assert pa.ids is not None and pb.ids is not None and pa.ids.tolist() == pb.ids.tolist()
    for j in ja:
        a.release(j)
    assert a.cache.allocator.num_live() == 0
    a.cache.allocator.check()
