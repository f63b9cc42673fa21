"""The draft model's catch-up after steps it did not see (plain steps, jobs that skipped drafting): a short
gap is folded into the first draft step (one decode step of a row bucket per sequence, no eager prefill),
a long one still runs the eager prefill first. Greedy output stays the plain generator's, the folded
drafts equal the eager path's, and each job of a batch with different gaps drafts what it drafts alone."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.cache import Cache
from exl3_core.generator import Generator, Job, drafting
from exl3_core.generator.drafting import FOLD_MAX_ROWS, FOLD_ROW_BUCKETS, ModelDrafter, Proposal
from exl3_core.generator.toy import ByteTokenizer, ToyModel
from exl3_core.sampling import Sampler
from exl3_core.tuning import Tuning

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 264


def toy(seed: int) -> ToyModel:
    return ToyModel(vocab_size=V, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, seed=seed)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def fold_rows(missing: int) -> int | None:
    """The first draft step's rows per sequence for a sequence missing ``missing`` tokens (None: eager)."""
    return next((r for r in FOLD_ROW_BUCKETS if max(2 + missing, 2) <= r <= FOLD_MAX_ROWS), None)


class Recorder:
    """Spies on a generator's draft model: per proposal, the tokens each drafting job's draft state lacked
    (before its last two), the first draft step's rows per sequence, and the draft plan's prefill forwards."""

    def __init__(self, drafter: ModelDrafter) -> None:
        self.drafter = drafter
        self.proposals: list[tuple[list[int], list[int], Proposal]] = []  # (missing, lengths, proposal)
        self.first_rows: list[int] = []
        self.prefills = 0
        propose, draft, forward = drafter.propose, drafter._draft, drafter.plan.forward

        def spy_propose(jobs: list[Job], ks: list[int]) -> Proposal:
            missing = [len(j.seq) - 2 - len(drafter._seqs[j].tokens) if j in drafter._seqs else len(j.seq) - 2
                       for j, k in zip(jobs, ks) if k > 0]
            lengths = [len(j.seq) for j, k in zip(jobs, ks) if k > 0]
            prop = propose(jobs, ks)
            self.proposals.append((missing, lengths, prop))
            return prop

        def spy_draft(jobs: list[Job], K: int, first_rows: int = 2) -> Any:
            self.first_rows.append(first_rows)
            return draft(jobs, K, first_rows)

        def spy_forward(meta: BatchMeta, *args: Any, **kw: Any) -> Any:
            self.prefills += meta.phase != "decode"
            return forward(meta, *args, **kw)

        drafter.propose, drafter._draft, drafter.plan.forward = spy_propose, spy_draft, spy_forward


def speculative(target: ToyModel, draft: ToyModel, plugins: Any, off: Callable[[Job], bool],
                k: int = 3) -> tuple[Generator, Recorder]:
    """A greedy speculative generator whose draft lengths are the fixed ``k`` except for jobs where ``off(job)``
    holds (no draft: a plain step when no job drafts). It drafts after each step's commits (not ahead of them:
    ``off`` reads the committed sequence; tests/core/test_draft_ahead.py drafts ahead)."""
    base = Tuning.for_device("cpu")
    tuning = dataclasses.replace(base, graphs=dataclasses.replace(base.graphs, draft_ahead=False))
    gen = Generator(target, Cache(target, 4096, page_size=8, plugins=plugins), ByteTokenizer(V), plugins=plugins,
                    draft_model=draft, draft_cache=Cache(draft, 4096, page_size=8, plugins=plugins),
                    num_draft_tokens=k, dynamic_draft=False, max_batch_size=4, tuning=tuning)
    assert gen.spec is not None and isinstance(gen.spec.drafter, ModelDrafter)
    choose = gen.spec.length.choose
    gen.spec.length.choose = lambda jobs, caps: [0 if off(j) else n for j, n in zip(jobs, choose(jobs, caps))]
    return gen, Recorder(gen.spec.drafter)


def run(gen: Generator, jobs: list[Job]) -> dict[Any, list[int]]:
    gen.enqueue(jobs)
    out: dict[Any, list[int]] = {j.identifier: [] for j in jobs}
    while gen.num_remaining():
        for r in gen.iterate():
            out[r["identifier"]] += r["token_ids"]
    return out


def windows(*spans: tuple[int, int]) -> Callable[[Job], bool]:
    """Drafting off while a job's generated-token count is inside one of ``spans`` (``[lo, hi)``)."""
    return lambda j: any(lo <= len(j.seq) - len(j.prompt) < hi for lo, hi in spans)


@pytest.fixture(scope="module")
def target() -> ToyModel:
    return toy(1)


@pytest.mark.parametrize("same", [True, False])
def test_greedy_output_with_drafting_off_and_on_equals_plain(target, plugins, same: bool) -> None:
    """Drafting switched off for stretches of 1, 6, 11 and 22 generated tokens: the tokens equal the plain
    generator's; a draft with the target's weights still has every draft accepted (the folded first steps
    left its keys and values right); every short gap was folded into the first draft step (no catch-up
    forward, the rows its gap needs), only the prompt and the long gap ran the eager prefill, and the cost
    model saw the folded steps' draft time as that of ordinary draft steps."""
    def jobs() -> list[Job]:
        return [Job(prompt(37, 0), max_new_tokens=72, identifier=0, stop_at_eos=False)]

    plain = run(Generator(target, Cache(target, 4096, page_size=8, plugins=plugins), ByteTokenizer(V),
                          plugins=plugins), jobs())
    draft = toy(1) if same else toy(9)
    gen, rec = speculative(target, draft, plugins, windows((5, 6), (16, 22), (30, 41), (46, 68)))
    recorded: list[float] = []
    record = gen.spec.length.record_draft
    gen.spec.length.record_draft = lambda batch, seconds: recorded.append(seconds) or record(batch, seconds)
    assert run(gen, jobs()) == plain
    st = gen.spec.stats
    assert st.drafted > 0 and st.plain_steps > 0
    if same:
        assert st.accepted == st.drafted
    drafter = gen.spec.drafter
    eager = 0
    folded = []
    for (missing, lengths, prop), rows in zip(rec.proposals, rec.first_rows):
        want = fold_rows(max(missing))
        if want is None or any(n < want for n in lengths):
            eager += 1
            assert prop.catch_up >= 1 and rows == 2
        else:
            assert prop.catch_up == 0 and rows == want
            if rows > 2:
                folded.append(max(missing))
    assert eager == drafter.catch_up_calls == rec.prefills == 2  # the prompt and the 22-token gap
    assert len(folded) == drafter.folded_steps and {fold_rows(m) for m in folded} >= {4, 8, 16}
    assert len(recorded) == len(rec.proposals) - eager > len(folded)
    assert st.draft_forwards == sum(p.forwards + p.catch_up for _, _, p in rec.proposals)


def test_with_the_cap_at_two_rows_every_gap_catches_up_eagerly(target, plugins,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap lowered to two rows (no folding): every gap is caught up by an eager prefill first (the plain
    path), each such proposal counting its catch-up forward, with the tokens and acceptances of the folded run."""
    def jobs() -> list[Job]:
        return [Job(prompt(37, 0), max_new_tokens=40, identifier=0, stop_at_eos=False)]

    folded_gen, folded_rec = speculative(target, toy(1), plugins, windows((6, 8), (16, 22)))
    out = run(folded_gen, jobs())
    assert folded_rec.prefills == 1 and folded_gen.spec.drafter.folded_steps >= 1
    monkeypatch.setattr(drafting, "FOLD_MAX_ROWS", 2)
    gen, rec = speculative(target, toy(1), plugins, windows((6, 8), (16, 22)))
    assert run(gen, jobs()) == out
    assert set(rec.first_rows) == {2} and gen.spec.drafter.folded_steps == 0
    eager = [p for m, _, p in rec.proposals if max(m) > 0]
    assert len(eager) >= 2 and all(p.catch_up == 1 for p in eager)
    assert all(p.catch_up == 0 for m, _, p in rec.proposals if max(m) <= 0)
    assert gen.spec.drafter.catch_up_calls == rec.prefills == len(eager)
    assert gen.spec.stats.accepted == gen.spec.stats.drafted
    assert (gen.spec.stats.drafted, gen.spec.stats.steps) == (folded_gen.spec.stats.drafted,
                                                              folded_gen.spec.stats.steps)


def test_two_jobs_with_different_gaps_in_one_batch(target, plugins) -> None:
    """Two jobs whose drafting pauses at different times, so that they draft together after different gaps:
    one folded first step feeds both the larger gap's rows (the other re-feeding positions its draft holds),
    no eager catch-up runs after the prompts, both get the plain generator's tokens, and a draft with the
    target's weights has every draft of either job accepted. (Draft by draft against each job alone: the
    drafter tests below.)"""
    ps = [prompt(29, 1), prompt(45, 2)]
    spans = {0: [(8, 11)], 1: [(2, 11), (18, 20)]}

    def off(j: Job) -> bool:
        return windows(*spans[j.identifier])(j)

    def jobs() -> list[Job]:
        return [Job(p, max_new_tokens=30, identifier=i, stop_at_eos=False) for i, p in enumerate(ps)]

    gen, rec = speculative(target, toy(1), plugins, off)
    both = jobs()
    out = run(gen, both)
    plain = run(Generator(target, Cache(target, 4096, page_size=8, plugins=plugins), ByteTokenizer(V),
                          plugins=plugins), jobs())
    assert out == plain
    mixed = [(m, r) for (m, _, _), r in zip(rec.proposals, rec.first_rows) if len(m) == 2 and len(set(m)) == 2]
    assert any(r > 2 and r == fold_rows(max(m)) for m, r in mixed), rec.proposals
    assert gen.spec.drafter.catch_up_calls == rec.prefills == 1  # the two prompts, together
    assert all(j.accepted_draft_tokens == j.draft_tokens > 0 for j in both)


# -- the drafter alone: folded drafts equal the eager path's ---------------------------------------------
def _history(d: ModelDrafter, jobs: list[Job], gaps: list[int], K: int) -> Proposal:
    """Draft once for ``jobs`` (their prompts caught up), accept each job's first draft and reject the second,
    then add ``gaps[b]`` tokens the draft never sees, and draft again: that proposal."""
    first = d.propose(jobs, [K] * len(jobs))
    assert first.ids is not None
    drafted = first.ids.tolist()
    for b, j in enumerate(jobs):
        j.seq += [drafted[b][0], (drafted[b][1] + 1) % V]
        d.commit(j, drafted[b])
        j.seq += [(7 * n + 11 * j.identifier + 3) % 256 for n in range(gaps[b])]
    return d.propose(jobs, [K] * len(jobs))


def _drafter(draft: ToyModel, plugins: Any) -> ModelDrafter:
    return ModelDrafter(draft, Cache(draft, 2048, page_size=8, plugins=plugins), max_seq_len=256)


def _jobs(ids: list[int]) -> list[Job]:
    sampler = Sampler.build(temperature=1.0)
    out = []
    for i in ids:
        j = Job(prompt(30 + 9 * i, 10 + i), max_new_tokens=64, sampler=sampler, identifier=i)
        j.rng = torch.Generator().manual_seed(100 + i)
        out.append(j)
    return out


@pytest.mark.parametrize("gaps", [(3, 9), (0, 15), (2, 2)])
def test_folded_drafts_equal_eager_and_alone(plugins, monkeypatch: pytest.MonkeyPatch, gaps: tuple[int, int]) -> None:
    """Sampled drafts (their distributions q compared) of two jobs after different gaps: the batch's folded
    first step gives each job the draft ids and q the eager catch-up path gives, and those it gets alone."""
    draft = toy(9)
    K = 3
    d = _drafter(draft, plugins)
    got = _history(d, _jobs([0, 1]), list(gaps), K)
    # after the commit the draft lacks only the target's correction, so it misses gap - 1 tokens before the last two
    assert got.catch_up == 0 and d.catch_up_calls == 1 and d.folded_steps == (max(gaps) > 1)
    monkeypatch.setattr(drafting, "FOLD_MAX_ROWS", 2)
    ref_d = _drafter(draft, plugins)
    ref = _history(ref_d, _jobs([0, 1]), list(gaps), K)
    assert ref.catch_up == (max(gaps) > 1) and ref_d.folded_steps == 0
    monkeypatch.undo()
    assert got.ids is not None and got.q is not None and ref.ids is not None and ref.q is not None
    assert got.ids.tolist() == ref.ids.tolist()
    torch.testing.assert_close(got.q, ref.q, rtol=1e-4, atol=1e-5)
    for b in (0, 1):
        one = _history(_drafter(draft, plugins), _jobs([b]), [gaps[b]], K)
        assert one.ids is not None and one.q is not None
        assert one.ids[0].tolist() == got.ids[b].tolist()
        torch.testing.assert_close(one.q[0], got.q[b], rtol=1e-4, atol=1e-5)
