"""``exl3 bench --draft`` on CPU: the bench draft's acceptance is alpha per token, and one tiny run reports
every figure with the same greedy tokens as the plain generator."""
from __future__ import annotations

import pytest
import torch

from exl3_core.bench.models import build_model, parse_shape
from exl3_core.bench.spec import OracleDrafter, run_spec_bench
from exl3_core.generator.draft_policy import ideal_speedup
from exl3_core.generator.job import Job

TARGET = "custom(256,384,2,4,2,700)"
DRAFT = "custom(128,256,1,2,1,700)"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_oracle_proposes_the_reference_with_probability_alpha() -> None:
    draft, cache = build_model(parse_shape(DRAFT), device="cpu", cache_tokens=512)
    ref = torch.randint(0, 700, (400,), generator=torch.Generator().manual_seed(1)).tolist()
    job = Job([5, 6, 7], max_new_tokens=500, identifier="a")
    job.seq += ref[:10]
    for alpha in (0.3, 0.8):
        o = OracleDrafter(draft, cache, max_seq_len=512, alpha=alpha, reference={"a": ref}, vocab=700, seed=2)
        forced = torch.cat([o._forced([job], [job.seq], 8) for _ in range(500)])  # [500, 8]
        hit = forced == torch.tensor(ref[10:18])
        assert abs(float(hit.float().mean()) - alpha) < 0.03
        assert bool(((forced >= 0) & (forced < 700)).all())


def test_run_spec_bench_cpu() -> None:
    res = run_spec_bench(parse_shape(TARGET), parse_shape(DRAFT), alphas=(0.5,), ks=(1, 3), ctx=16, new_tokens=10,
                         device="cpu", log=lambda s: None)
    assert res["c"] > 0 and res["plain_tok_s"] > 0 and set(res["verify_step_ms"]) == {"2", "4"}
    (row,) = res["alphas"]
    runs = {(r["k"], r["dynamic"]): r for r in row["runs"]}
    assert set(runs) == {(1, False), (3, False), (3, True)}
    for (k, dyn), r in runs.items():
        assert r["same_tokens"] and r["tok_s"] > 0 and r["speedup"] == pytest.approx(r["tok_s"] / res["plain_tok_s"])
        if not dyn:
            assert r["spec_steps"] > 0 and 0 <= r["acceptance"] <= 1
            assert r["ideal"] == pytest.approx(ideal_speedup(0.5, k, res["c"]))
    assert row["best_k"] in (1, 3)
    with pytest.raises(ValueError, match="vocabulary"):
        run_spec_bench(parse_shape(TARGET), parse_shape("custom(128,256,1,2,1,600)"), device="cpu")
    with pytest.raises(ValueError, match="draft-alphas"):
        run_spec_bench(parse_shape(TARGET), parse_shape(DRAFT), alphas=(1.0,), device="cpu")


def test_bench_cli_draft_writes_json(tmp_path) -> None:
    import json

    from exl3_core.cli import main

    out = tmp_path / "spec.json"
    rc = main(["bench", "--shape", TARGET, "--draft", DRAFT, "--device", "cpu", "--draft-k", "2", "--draft-alphas",
               "0.7", "--new-tokens", "6", "--contexts", "16", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["draft"]
    assert res["alphas"][0]["alpha"] == 0.7 and [r["k"] for r in res["alphas"][0]["runs"]] == [2, 2]
    assert main(["bench", "--shape", TARGET, "--draft", DRAFT, "--device", "cpu", "--draft-k", "0"]) == 1


def test_self_predicting_target_keeps_its_continuation_across_kernel_paths() -> None:
    """The bench target's greedy next token is its current one by a margin far above rounding, so one-row steps
    and several-row verification agree; the run's acceptance is then alpha (within sampling noise)."""
    model, cache = build_model(parse_shape(TARGET), device="cpu", dtype=torch.float16, cache_tokens=256,
                               self_predicting=True)
    ids = torch.randint(0, 700, (1, 24), generator=torch.Generator().manual_seed(3))
    logits = model.forward(ids)[0].float()  # [24, vocab]
    top = logits.topk(2, dim=-1)
    assert torch.equal(top.indices[:, 0], ids[0])
    gap = top.values[:, 0] - top.values[:, 1]
    assert float(gap.min()) > 0.2 * float(logits.std()), gap.min()
    with pytest.raises(ValueError, match="--head-bits"):
        build_model(parse_shape(TARGET), device="cpu", head_bits=None, self_predicting=True)


def test_spec_bench_acceptance_is_alpha() -> None:
    res = run_spec_bench(parse_shape(TARGET), parse_shape(DRAFT), alphas=(0.7,), ks=(4,), ctx=16, new_tokens=300,
                         device="cpu", dynamic=False, log=lambda s: None)
    (r,) = res["alphas"][0]["runs"]
    assert r["same_tokens"]
    # accepted / drafted of k = 4 geometric drafts at alpha 0.7: (alpha + ... + alpha^4) / 4
    want = sum(0.7 ** i for i in range(1, 5)) / 4
    assert abs(r["acceptance"] - want) < 0.12, (r["acceptance"], want)


def test_parted_only_at_near_tie() -> None:
    from exl3_core.testing.arch import parted_only_at_near_tie

    logits = torch.zeros(4, 10)
    logits[:, 3] = 5.0
    logits[2, 7] = 4.95  # step 2 is a near-tie between tokens 3 and 7
    want = [3, 3, 3, 3]
    assert parted_only_at_near_tie(want, list(want), logits) is None
    assert parted_only_at_near_tie(want, [3, 3, 7, 1], logits) is None
    assert "top-2 gap is 5.000" in parted_only_at_near_tie(want, [3, 4, 3, 3], logits)
    assert "lengths differ" in parted_only_at_near_tie(want, want[:3], logits)
    # sampled: a parting where both runs' distributions agree is a draw on the other side of a boundary
    assert parted_only_at_near_tie(want, [3, 4, 3, 3], logits, got_logits=logits * 1.001) is None
    assert "apart" in parted_only_at_near_tie(want, [3, 4, 3, 3], logits, got_logits=logits.flip(-1))
