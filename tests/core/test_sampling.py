"""Sampling steps against their definitions, on fixed logits with many seeded draws."""
from __future__ import annotations

import math

import pytest
import torch

from exl3_core.plugins import load_plugins
from exl3_core.sampling import (
    STEPS,
    FrequencyPenalty,
    LogitBias,
    MinP,
    PresencePenalty,
    RepetitionPenalty,
    Sampler,
    SamplerValueError,
    StepContext,
    Temperature,
    TokenBan,
    TopK,
    TopP,
    Typical,
    resolve_sampler,
    sample,
)

V = 40
N = 20000


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(7)) * 2.0


def draw_many(logits: torch.Tensor, sampler: Sampler, n: int = N, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = sample(logits.expand(n, -1).contiguous(), [sampler] * n, torch.rand(n, generator=g))
    assert bool(out.ok.all())
    return out.ids


def check_distribution(ids: torch.Tensor, expect: torch.Tensor) -> None:
    """Samples outside the support never occur; inside, a chi-square test at ~6 sigma."""
    n = ids.numel()
    counts = torch.bincount(ids, minlength=expect.numel()).double()
    support = expect > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {torch.nonzero(counts * ~support).flatten()}"
    e = expect[support].double() * n
    chi2 = float(((counts[support] - e) ** 2 / e).sum())
    df = max(int(support.sum()) - 1, 1)
    assert chi2 < df + 6 * math.sqrt(2 * df), f"chi2={chi2:.1f} for df={df}"


def renorm(p: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    q = torch.where(keep, p, torch.zeros_like(p))
    return q / q.sum()


@pytest.mark.parametrize("T", [0.5, 1.0, 1.7])
def test_temperature_matches_softmax(logits: torch.Tensor, T: float) -> None:
    check_distribution(draw_many(logits, Sampler([Temperature(temperature=T)])), torch.softmax(logits / T, -1))


def test_temperature_zero_and_empty_pipeline_are_greedy(logits: torch.Tensor) -> None:
    am = int(logits.argmax())
    assert set(draw_many(logits, Sampler([Temperature(temperature=0.0)]), 500).tolist()) == {am}
    assert set(draw_many(logits, Sampler(), 10).tolist()) == {am}


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k(logits: torch.Tensor, k: int) -> None:
    p = torch.softmax(logits, -1)
    keep = torch.zeros(V, dtype=torch.bool)
    keep[sorted(range(V), key=lambda i: -float(logits[i]))[:k]] = True
    check_distribution(draw_many(logits, Sampler([TopK(top_k=k)])), renorm(p, keep))


@pytest.mark.parametrize("top_p", [0.3, 0.75, 0.95])
def test_top_p_never_leaves_the_nucleus(logits: torch.Tensor, top_p: float) -> None:
    p = torch.softmax(logits, -1)
    order = sorted(range(V), key=lambda i: -float(p[i]))
    keep = torch.zeros(V, dtype=torch.bool)
    mass = 0.0
    for i in order:  # smallest most-likely set with mass >= top_p
        keep[i] = True
        mass += float(p[i])
        if mass >= top_p:
            break
    check_distribution(draw_many(logits, Sampler([TopP(top_p=top_p)])), renorm(p, keep))


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_threshold(logits: torch.Tensor, min_p: float) -> None:
    p = torch.softmax(logits, -1)
    keep = p >= min_p * p.max()
    check_distribution(draw_many(logits, Sampler([MinP(min_p=min_p)])), renorm(p, keep))


@pytest.mark.parametrize("tau", [0.2, 0.6, 0.9])
def test_typical(logits: torch.Tensor, tau: float) -> None:
    p = torch.softmax(logits.double(), -1)
    H = float(-(p * p.log()).sum())
    order = sorted(range(V), key=lambda i: abs(-math.log(float(p[i])) - H))
    keep = torch.zeros(V, dtype=torch.bool)
    mass = 0.0
    for i in order:
        keep[i] = True
        mass += float(p[i])
        if mass >= tau:
            break
    check_distribution(draw_many(logits, Sampler([Typical(typical=tau)])), renorm(p.float(), keep))


def _hist(rows: list[list[int]], W: int) -> torch.Tensor:
    h = torch.full((len(rows), W), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            h[i, W - len(r):] = torch.tensor(r)
    return h


def test_penalties_change_exactly_the_seen_tokens(logits: torch.Tensor) -> None:
    hist_tokens = [3, 5, 5, 9, 5, 30]
    window = 4  # sees 5, 9, 5, 30
    ctx = StepContext(vocab_size=V, history=_hist([hist_tokens], 8))
    counts = {5: 2, 9: 1, 30: 1}
    x = logits[None].clone()
    for cls, pen in ((RepetitionPenalty, 1.3), (FrequencyPenalty, 0.4), (PresencePenalty, 0.7)):
        step = cls(penalty=pen, window=window)
        y = cls.apply(x.clone(), cls.batch_params([step], x.device), ctx)[0]
        changed = {i for i in range(V) if float(y[i]) != float(x[0, i])}
        assert changed == set(counts), (cls.name, changed)
        for t, c in counts.items():
            l0 = float(x[0, t])
            want = {RepetitionPenalty: l0 / pen if l0 > 0 else l0 * pen, FrequencyPenalty: l0 - pen * c,
                    PresencePenalty: l0 - pen}[cls]
            assert math.isclose(float(y[t]), want, rel_tol=1e-6), (cls.name, t)


def test_penalty_windows_are_per_row(logits: torch.Tensor) -> None:
    hist = _hist([[1, 2, 3], [1, 2, 3]], 3)
    steps = [PresencePenalty(penalty=1.0, window=1), PresencePenalty(penalty=1.0, window=3)]
    x = logits[None].repeat(2, 1)
    y = PresencePenalty.apply(x.clone(), PresencePenalty.batch_params(steps, x.device),
                              StepContext(vocab_size=V, history=hist))
    assert torch.nonzero(y[0] != x[0]).flatten().tolist() == [3]
    assert torch.nonzero(y[1] != x[1]).flatten().tolist() == [1, 2, 3]


def test_logit_bias_and_token_ban(logits: torch.Tensor) -> None:
    am = int(logits.argmax())
    s = Sampler([TokenBan(tokens=[am]), LogitBias(bias={0: 5.0, 1: -2.0})])
    ids = draw_many(logits, s, 20000)
    assert am not in ids.tolist()
    expect = logits.clone()
    expect[0] += 5.0
    expect[1] -= 2.0
    expect[am] = float("-inf")
    check_distribution(ids, torch.softmax(expect, -1))


def test_rows_are_independent(logits: torch.Tensor) -> None:
    samplers = [Sampler.build(temperature=0.0), Sampler.build(temperature=1.0, top_k=2),
                Sampler.build(temperature=0.8, top_p=0.5, repetition_penalty=1.5),
                Sampler([TokenBan(tokens=[int(logits.argmax())])]), Sampler.build(temperature=2.0, min_p=0.2)]
    B = len(samplers)
    x = torch.randn(B, V, generator=torch.Generator().manual_seed(3)) * 2
    hist = _hist([[1, 2], [], [int(x[2].argmax())], [4], [5, 6, 7]], 4)
    u = torch.rand(B, generator=torch.Generator().manual_seed(4))
    together = sample(x, samplers, u, history=hist, want_probs=True)
    for b in range(B):
        alone = sample(x[b:b + 1], [samplers[b]], u[b:b + 1], history=hist[b:b + 1], want_probs=True)
        assert int(alone.ids[0]) == int(together.ids[b])
        assert math.isclose(float(alone.probs[0]), float(together.probs[b]), rel_tol=1e-6)


def test_everything_banned_is_reported_not_sampled() -> None:
    x = torch.zeros(2, 4)
    out = sample(x, [Sampler([TokenBan(tokens=[0, 1, 2, 3])]), Sampler()], torch.rand(2))
    assert out.ok.tolist() == [False, True]


@pytest.mark.parametrize("kwargs", [{"temperature": -0.1}, {"top_p": 1.5}, {"top_p": 0.0}, {"min_p": -0.1},
                                    {"min_p": 2.0}, {"top_k": -1}, {"top_k": 2.5}, {"typical": 0.0},
                                    {"repetition_penalty": 0.0}, {"temperature": float("nan")},
                                    {"penalty_window": -5, "repetition_penalty": 1.2}])
def test_invalid_values_raise_clearly(kwargs: dict) -> None:
    with pytest.raises(SamplerValueError) as e:
        Sampler.build(**kwargs)
    assert next(iter(kwargs)).split("_")[-1] in str(e.value)


def test_registry_exposes_every_step_and_preset() -> None:
    plugins = load_plugins(autoload=False)
    specs = plugins.sampler_specs()
    assert {c.name for c in STEPS} <= set(specs)
    for name, spec in specs.items():
        s = resolve_sampler(name, plugins)
        assert isinstance(s, Sampler)
        if spec.kind == "step" and name != "greedy":
            assert type(plugins.sampler(name)) is type and any(type(st).name == name for st in s.steps)
    assert resolve_sampler("greedy", plugins).is_greedy
    with pytest.raises(LookupError, match="top_p"):
        resolve_sampler("no_such_sampler", plugins)


def test_logit_bias_plus_inf_forces_the_token(logits: torch.Tensor) -> None:
    inf = float("inf")
    for temperature in (1.0, 0.7, 0.0):  # sampled and greedy: +inf is a force, not an overflow
        ids = draw_many(logits, Sampler.build(temperature=temperature, logit_bias={5: inf}), 2000)
        assert set(ids.tolist()) == {5}
    # several forced tokens: only they, equally likely; the others' logits no longer matter
    ids = draw_many(logits, Sampler.build(logit_bias={5: inf, 9: inf, 1: 3.0}), 20000)
    expect = torch.zeros(V)
    expect[[5, 9]] = 0.5
    check_distribution(ids, expect)
    # a ban of an earlier step wins over a force; a -inf bias bans
    am = int(logits.argmax())
    s = Sampler([TokenBan(tokens=[5]), LogitBias(bias={5: inf, 9: inf, am: -inf})])
    assert set(draw_many(logits, s, 2000).tolist()) == {9}
    s = Sampler([TokenBan(tokens=[5]), LogitBias(bias={5: inf, am: -inf})])
    ids = draw_many(logits, s, 20000)
    ban = logits.clone()
    ban[[5, am]] = -inf
    check_distribution(ids, torch.softmax(ban, -1))
    # rows without a force in the same batch are untouched
    x = torch.stack([logits, logits])
    out = LogitBias.apply(x.clone(), LogitBias.batch_params([LogitBias(bias={5: inf}), LogitBias(bias={5: 1.0})],
                                                            x.device), StepContext(vocab_size=V))
    assert torch.isfinite(out[0]).sum() == 1 and out[0, 5] == 0
    expect_row = logits.clone()
    expect_row[5] += 1.0
    assert torch.equal(out[1], expect_row)


def test_extreme_parameters_keep_a_token_or_fail_at_creation(logits: torch.Tensor) -> None:
    """Values that pass validation but round to 0 (or beyond) in float32 still leave the most likely
    token; integers beyond float range are refused when the sampler is built."""
    am = int(logits.argmax())
    for s in (Sampler.build(top_p=1e-300), Sampler.build(min_p=1.0), Sampler.build(top_k=2**63, top_p=1e-45),
              Sampler.build(temperature=1e-300, top_p=1e-300)):
        ids = draw_many(logits, s, 500)
        assert set(ids.tolist()) == {am}, s
    p = torch.softmax(logits, -1)
    entropy = -(p * p.log()).sum()
    most_typical = int((-p.log() - entropy).abs().argmin())
    assert set(draw_many(logits, Sampler.build(typical=1e-300), 500).tolist()) == {most_typical}
    for bad in ({"top_k": 10**400}, {"temperature": 10**400}, {"repetition_penalty": -(10**400)}):
        with pytest.raises(SamplerValueError, match="finite"):
            Sampler.build(**bad)
