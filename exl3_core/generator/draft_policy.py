"""How many tokens each sequence drafts per speculative step: a fixed k, or one that follows its acceptance.

With per-token acceptance probability alpha (each draft accepted independently until the first
rejection), a verification of k drafts commits on average :func:`expected_tokens` = (1 - alpha^(k+1)) /
(1 - alpha) tokens. Its cost, relative to a plain decode step, is that of a target step over k+1 rows
per sequence plus k draft forwards plus the host work a speculative step does not overlap.

:class:`DraftLength` (dynamic) estimates every term from what it sees: each sequence's acceptance (decayed
counts, a prior for new sequences), and the measured seconds of verification steps per (batch bucket,
rows per sequence), of plain steps per bucket (timed through the speculative path, since the overlapped
plain loop cannot be timed step by step), of draft forwards per bucket and of the speculative step's
host work. Per sequence it picks the k that maximises expected tokens per unit of cost, then for the
batch the largest draft length whose predicted throughput beats the plain step's; when none does the
step is plain ("no draft when it would not pay"). After ``probe_every`` plain steps in a row it
drafts one token per sequence, so that acceptance and costs keep being measured; each probe that finds
drafting still not paying doubles the wait before the next (up to 1024 steps).
"""
from __future__ import annotations

from dataclasses import dataclass

from exl3_core.generator.batching import bucket_size
from exl3_core.generator.job import Job


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens committed on average by verifying ``k`` drafts of per-token acceptance ``alpha``."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def ideal_speedup(alpha: float, k: int, c: float) -> float:
    """Expected tokens per step over its cost k*c + 1 (``c``: draft step time / target step time): the
    speedup of speculation with free verification rows and no host overhead."""
    return expected_tokens(alpha, k) / (k * c + 1.0)


@dataclass
class _Acceptance:
    accepted: float = 0.0
    trials: float = 0.0  # accepted drafts plus rejections (drafts after a rejection were never tried)


#: weight of a measurement in the running averages of step times
_EMA = 0.25
#: most plain steps between two probes
_MAX_PROBE_INTERVAL = 1024
#: relative cost of one more verification row per sequence before any is measured (memory-bound decode)
_ROW_COST_PRIOR = 0.02


class DraftLength:
    """Draft lengths per sequence (see the module docstring).

    :param max_k: the most tokens a sequence drafts in one step.
    :param dynamic: False: always ``max_k`` (capped by what a sequence may still generate).
    :param draft_cost: draft forward time / plain target step time, assumed until measured (0 for a
        drafter without forwards, such as n-gram lookup).
    :param prior: acceptance assumed for a sequence with no history, with the weight of ``prior_weight``
        observed drafts.
    :param decay: weight of older observations per new one (recent acceptance counts more).
    :param probe_every: plain steps in a row after which one token per sequence is drafted anyway (doubling
        while probes find drafting not paying).
    :param margin: the predicted gain over a plain step a speculative step must reach.
    """

    def __init__(self, max_k: int, *, dynamic: bool = True, draft_cost: float = 0.0, prior: float = 0.7,
                 prior_weight: float = 2.0, decay: float = 0.9, probe_every: int = 8, margin: float = 0.03) -> None:
        if max_k < 1:
            raise ValueError(f"DraftLength: max_k={max_k} must be >= 1")
        self.max_k = max_k
        self.dynamic = dynamic
        self.draft_cost = draft_cost
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.probe_every, self.margin = probe_every, margin
        self._acc: dict[Job, _Acceptance] = {}
        self._t_target: dict[tuple[int, int], float] = {}  # (bucket, rows per sequence) -> seconds
        self._t_draft: dict[int, float] = {}  # bucket -> seconds per draft forward
        self._host = 0.0  # seconds of unoverlapped host work per speculative step
        self._plain_streak = 0
        self._probe_interval = probe_every  # plain steps before the next probe

    # -- observations ---------------------------------------------------------------------------
    def alpha(self, job: Job) -> float:
        a = self._acc.get(job)
        acc, trials = (a.accepted, a.trials) if a is not None else (0.0, 0.0)
        return (acc + self.prior * self.prior_weight) / (trials + self.prior_weight)

    def record_acceptance(self, job: Job, drafted: int, accepted: int) -> None:
        if drafted < 1:
            return
        a = self._acc.setdefault(job, _Acceptance())
        a.accepted = a.accepted * self.decay + accepted
        a.trials = a.trials * self.decay + accepted + (1 if accepted < drafted else 0)

    def record_target(self, batch: int, rows: int, seconds: float) -> None:
        """A target step of ``batch`` sequences, ``rows`` tokens each, took ``seconds``."""
        key = (bucket_size(batch), rows)
        old = self._t_target.get(key)
        self._t_target[key] = seconds if old is None else old + _EMA * (seconds - old)

    def record_draft(self, batch: int, seconds_per_forward: float) -> None:
        key = bucket_size(batch)
        old = self._t_draft.get(key)
        self._t_draft[key] = seconds_per_forward if old is None else old + _EMA * (seconds_per_forward - old)

    def record_host(self, seconds: float) -> None:
        self._host += _EMA * (max(seconds, 0.0) - self._host)

    def forget(self, job: Job) -> None:
        self._acc.pop(job, None)

    def needs_timing(self, batch: int) -> bool:
        """Whether a plain step of ``batch`` sequences has yet to be timed (the dynamic policy needs it)."""
        return self.dynamic and (bucket_size(batch), 1) not in self._t_target

    # -- predictions ------------------------------------------------------------------------------
    def target_time(self, batch: int, rows: int) -> float | None:
        """Seconds of a target step over ``rows`` tokens per sequence (measured, or from the plain step's
        time and the measured cost per extra row); None before any plain step of the bucket was timed."""
        b = bucket_size(batch)
        t1 = self._t_target.get((b, 1))
        if t1 is None:
            return None
        t = self._t_target.get((b, rows))
        if t is not None:
            return t
        slopes = [(tn / t1 - 1.0) / (n - 1) for (bb, n), tn in self._t_target.items() if bb == b and n > 1]
        slope = max(0.0, sum(slopes) / len(slopes)) if slopes else _ROW_COST_PRIOR
        return t1 * (1.0 + slope * (rows - 1))

    def relative_cost(self, batch: int, k: int, drafting: bool = True) -> float | None:
        """A speculative step of ``k`` drafts per sequence over a plain step (None: not yet known)."""
        t1 = self.target_time(batch, 1)
        tk = self.target_time(batch, k + 1)
        if t1 is None or tk is None or t1 <= 0:
            return None
        td = self._t_draft.get(bucket_size(batch))
        draft = (td if td is not None else self.draft_cost * t1) if drafting else 0.0
        return (tk + k * draft + self._host) / t1

    def estimates(self) -> dict[str, object]:
        """What the policy currently believes, for reports: milliseconds of target steps per
        ``"bucket x rows"``, of a draft forward per bucket and of a speculative step's host work."""
        return {"target_ms": {f"{b}x{n}": t * 1e3 for (b, n), t in sorted(self._t_target.items())},
                "draft_ms": {str(b): t * 1e3 for b, t in sorted(self._t_draft.items())},
                "host_ms": self._host * 1e3, "probe_interval": self._probe_interval}

    # -- decisions ---------------------------------------------------------------------------------
    def choose(self, jobs: list[Job], caps: list[int]) -> list[int]:
        """Draft length per job (0: no draft), at most ``caps[b]`` (what the job may still generate, what the
        drafter can propose)."""
        caps = [max(0, min(self.max_k, c)) for c in caps]
        if not self.dynamic or not any(caps):
            return caps
        B = len(jobs)
        unit = self.relative_cost(B, 1)
        if unit is None:
            return [0] * B  # the speculator times a plain step first
        step = max(unit - 1.0, 1e-6)  # marginal cost of one more draft token per step
        alphas = [self.alpha(j) for j in jobs]
        best_k = []
        for a, cap in zip(alphas, caps):
            scores = [expected_tokens(a, k) / (1.0 + step * k) for k in range(cap + 1)]
            best_k.append(max(range(cap + 1), key=lambda k: (scores[k], -k)))
        ks = [0] * B
        best_gain = 1.0 + self.margin
        for K in range(1, max(best_k) + 1):
            cost = self.relative_cost(B, K)
            if cost is None:
                continue
            trial = [min(k, K) for k in best_k]
            gain = sum(expected_tokens(a, k) for a, k in zip(alphas, trial)) / (B * cost)
            if gain > best_gain:
                best_gain, ks = gain, trial
        if not any(ks) and self._plain_streak >= self._probe_interval:  # keep acceptance and costs measured
            ks = [min(1, c) for c in caps]
        return ks

    def note_step(self, drafted: bool) -> None:
        """A decode step ran, speculative (``drafted``) or plain: counts the plain ones in a row. A probe that
        does not lead to drafting doubles the wait for the next one (probes cost where drafting does not pay)."""
        if not drafted:
            self._plain_streak += 1
            return
        if self._plain_streak >= self._probe_interval:
            self._probe_interval = min(2 * self._probe_interval, _MAX_PROBE_INTERVAL)
        else:
            self._probe_interval = self.probe_every
        self._plain_streak = 0
