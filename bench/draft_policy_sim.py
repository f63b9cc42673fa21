"""The dynamic draft-length policy (``exl3_core.generator.draft_policy.DraftLength``) on one sequence, simulated.

Each step asks the policy for a draft length; a plain step costs the target's one-row step, a speculative step of
k drafts costs the target at k + 1 rows, k draft forwards and the host work, and accepts each draft with
probability alpha until the first rejection. The policy is fed what the speculator would record (target and draft
times, host time, acceptance). Printed per alpha: the plain rate, the best fixed k and the policy's rate (median and
minimum over seeds): what the policy loses by deciding, with no catch-up prefills or noise, and no first-use cost
unless ``--first-use-ms`` gives one (added to what the policy records of the first step of each row count).

Default costs: an H100 (8B target with graphs, 1B draft): target 2.95 ms at one row, the verification rows as
measured there, a draft forward 1.33 ms with its host share (0.63 ms on the device), 0.5 ms of host work a step.

With ``--score whole`` the policy scores each batch draft length K on the whole step's cost at K (the product
charges the step's fixed host work to every draft token when it picks a sequence's own length, which caps it).
With zero-cost drafts and 1.4 ms of host work (n-gram lookup, as measured on the default model), 5 seeds:
product 1.12x / 1.57x / 2.23x at alpha 0.6 / 0.8 / 0.9, whole 1.37x / 2.05x / 2.89x; with 0.5 ms of host work
alike (1.72x / 2.27x / 3.30x against 1.73x / 2.43x / 3.26x); with the 1B draft (1.33 ms) no difference. On an
H100 the candidate `draft_costs`, which scored the whole cost too, measured the n-gram rewrite at 3.48x against
the product's 3.80x (bench/candidates/README.md): what the simulation leaves out (timing noise, first uses)
decided there.

    python bench/draft_policy_sim.py [--draft-ms 1.33] [--host-ms 0.5] [--tokens 256] [--seeds 20] [--first-use-ms 200]
                                     [--score product|whole]
"""
from __future__ import annotations

import argparse
import random
import statistics

from exl3_core.generator.draft_policy import DraftLength, expected_tokens
from exl3_core.generator.job import Job

#: target step milliseconds at 1..9 rows per sequence (H100, 8B shape, b=1, ctx 256)
TARGET_MS = {1: 2.95, 2: 2.74, 3: 2.96, 4: 3.12, 5: 3.38, 6: 3.53, 7: 3.74, 8: 4.6, 9: 5.53}


class WholeCostLength(DraftLength):
    """The policy with one change: the batch's draft length K scored on the whole step's cost at K, every sequence
    drafting up to K (no per-sequence length from a marginal cost that includes the step's fixed host work)."""

    def choose(self, jobs: list[Job], caps: list[int]) -> list[int]:
        caps = [max(0, min(self.max_k, c)) for c in caps]
        if not self.dynamic or not any(caps):
            return caps
        B = len(jobs)
        if self.relative_cost(B, 1) is None:
            return [0] * B
        alphas = [self.alpha(j) for j in jobs]
        ks, best_gain = [0] * B, 1.0 + self.margin
        for K in range(1, max(caps) + 1):
            cost = self.relative_cost(B, K)
            trial = [min(c, K) for c in caps]
            if cost is not None and (gain := sum(map(expected_tokens, alphas, trial)) / (B * cost)) > best_gain:
                best_gain, ks = gain, trial
        if not any(ks) and self._plain_streak >= self._probe_interval:
            ks = [min(1, c) for c in caps]
        return ks


def simulate(alpha: float, draft_ms: float, host_ms: float, tokens: int, seed: int,
             max_k: int = 8, first_use_ms: float = 0.0, policy_cls: type[DraftLength] = DraftLength
             ) -> tuple[float, int, int]:
    """``(tokens/s, speculative steps, plain steps)`` of the policy decoding ``tokens`` tokens. The first step of
    each row count is recorded ``first_use_ms`` longer (a kernel compile, a graph capture): a cost paid once per
    process, so left out of the rate, which shows what the policy's choices are worth after it."""
    rng = random.Random(seed)
    policy = policy_cls(max_k, dynamic=True, draft_cost=draft_ms / TARGET_MS[1])
    job = Job([1, 2, 3], max_new_tokens=tokens)
    done, ms, spec, plain = 0, 0.0, 0, 0
    used: set[int] = set()

    def target_ms(rows: int) -> float:
        extra = first_use_ms if rows not in used else 0.0
        used.add(rows)
        return TARGET_MS[rows] + extra

    while done < tokens:
        k = policy.choose([job], [max_k])[0]
        if k == 0:
            if policy.needs_timing(1):  # the speculator times a plain step through its own path
                policy.record_target(1, 1, target_ms(1) / 1e3)
            ms, done, plain = ms + TARGET_MS[1], done + 1, plain + 1
            policy.note_step(False)
            continue
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        ms += TARGET_MS[k + 1] + k * draft_ms + host_ms
        done, spec = done + accepted + 1, spec + 1
        policy.record_acceptance(job, k, accepted)
        policy.record_target(1, k + 1, target_ms(k + 1) / 1e3)
        policy.record_draft(1, draft_ms / 1e3)
        policy.record_host(host_ms / 1e3)
        policy.note_step(True)
    return done / ms * 1e3, spec, plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft-ms", type=float, default=1.33)
    ap.add_argument("--host-ms", type=float, default=0.5)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--first-use-ms", type=float, default=0.0,
                    help="extra cost of the first step of each row count (a compile, a capture)")
    ap.add_argument("--score", choices=("product", "whole"), default="product",
                    help="the product's policy, or each length scored on the whole step's cost")
    a = ap.parse_args()
    cls = WholeCostLength if a.score == "whole" else DraftLength
    plain = 1e3 / TARGET_MS[1]
    for alpha in (0.6, 0.8, 0.9):
        best_rate, best_k = max((expected_tokens(alpha, k) / (TARGET_MS[k + 1] + k * a.draft_ms + a.host_ms) * 1e3, k)
                                for k in range(1, 9))
        runs = [simulate(alpha, a.draft_ms, a.host_ms, a.tokens, s, first_use_ms=a.first_use_ms, policy_cls=cls)
                for s in range(a.seeds)]
        rates = [r[0] for r in runs]
        print(f"alpha {alpha}: plain {plain:.0f} tok/s; best fixed k={best_k} {best_rate / plain:.2f}x; policy median "
              f"{statistics.median(rates) / plain:.2f}x, min {min(rates) / plain:.2f}x "
              f"(seed 0: {runs[0][1]} speculative / {runs[0][2]} plain steps)")


if __name__ == "__main__":
    main()
