"""Speculative decoding on the real default model (SmolLM2-135M-Instruct, fp32 on the CPU): greedy output
token for token equal to the plain generator's on 20 prompts, with SmolLM2 drafting for itself (every draft
accepted), with a small random draft model of its vocabulary (most drafts rejected: rollback in both caches)
and with n-gram lookup; each job alone and all of them batched with staggered arrivals and cancels. No page of
either cache is live afterwards."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from smol_gguf import imported_model

from exl3_core import Cache, Config, Generator, Job, Model, Tokenizer
from exl3_core.generator.toy import ToyModel

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at",
    "Repeat exactly: the quick brown fox jumps over the lazy dog. Again: the quick brown fox",
    "List the days of the week: Monday, Tuesday, Wednesday,",
    "import numpy as np\nx = np.arange(10)\ny = np.arange(10)\nz =",
    "Question: What is 2 + 2? Answer:",
    "The sun rises in the east and sets in the",
    "Copy: red green blue red green blue red green",
    "A haiku about the sea:",
    "Photosynthesis is the process by which",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
    "The opposite of hot is",
    "My favourite book is",
    "1, 2, 3, 4, 5, 6,",
    "In machine learning, a neural network",
    "Hello, my name is",
    "The best way to learn a language is",
]
#: new tokens per prompt: short (a forward of the model costs ~0.1 s on one core), a few drafting steps each
NEW = [4 + (3 * i) % 5 for i in range(len(PROMPTS))]
CACHE = 4096


@pytest.fixture(scope="module")
def smol() -> tuple[Model, Tokenizer]:
    d = imported_model()
    cfg = Config.from_directory(d)
    model = Model.from_config(cfg)
    model.load("cpu", dtype=torch.float32)
    return model, Tokenizer.from_config(cfg)


@pytest.fixture(scope="module")
def prompts(smol) -> list[list[int]]:
    _, tok = smol
    return [tok.encode(p)[0].tolist() for p in PROMPTS]


@pytest.fixture(scope="module")
def plain(smol, prompts) -> list[list[int]]:
    """The plain generator's greedy tokens (all jobs in one batch: a dozen forwards instead of a hundred)."""
    model, tok = smol
    gen = Generator(model, Cache(model, CACHE, page_size=16), tok)
    jobs = [Job(p, max_new_tokens=n, stop_at_eos=False, identifier=i) for i, (p, n) in enumerate(zip(prompts, NEW))]
    gen.enqueue(jobs)
    out: dict[int, list[int]] = {}
    while gen.num_remaining():
        for r in gen.iterate():
            out.setdefault(r["identifier"], []).extend(r["token_ids"])
    return [out[i] for i in range(len(jobs))]


def run_alone(gen: Generator, prompt: list[int], n: int) -> list[int]:
    gen.enqueue(Job(prompt, max_new_tokens=n, stop_at_eos=False))
    out: list[int] = []
    while gen.num_remaining():
        for r in gen.iterate():
            out += r["token_ids"]
    return out


def drafts(kind: str, model: Model, tok: Tokenizer) -> dict[str, Any]:
    if kind == "self":
        return {"draft_model": model, "draft_cache": Cache(model, CACHE, page_size=16), "num_draft_tokens": 3,
                "dynamic_draft": False, "draft_tokenizer": tok}
    if kind == "random":
        rnd = ToyModel(vocab_size=model.config.hf.vocab_size, hidden=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=16, seed=3)
        return {"draft_model": rnd, "draft_cache": Cache(rnd, CACHE, page_size=16), "num_draft_tokens": 3,
                "dynamic_draft": False}
    return {"ngram_draft_tokens": 4, "dynamic_draft": False}


def check_clean(gen: Generator) -> None:
    for cache in [gen.cache] + ([gen.spec.drafter.cache] if hasattr(gen.spec.drafter, "cache") else []):
        cache.allocator.check()
        assert cache.allocator.num_live() == 0


# the batched test below covers every kind in CI; each job alone, for the draft models, with -m slow
@pytest.mark.parametrize("kind", [pytest.param("self", marks=pytest.mark.slow),
                                  pytest.param("random", marks=pytest.mark.slow), "ngram"])
def test_greedy_identity_each_job_alone(smol, prompts, plain, kind: str) -> None:
    model, tok = smol
    gen = Generator(model, Cache(model, CACHE, page_size=16), tok, **drafts(kind, model, tok))
    for i, (p, n) in enumerate(zip(prompts, NEW)):
        assert run_alone(gen, p, n) == plain[i], f"prompt {i}: {PROMPTS[i]!r}"
    check_clean(gen)
    s = gen.spec.stats
    assert s.steps > 0
    if kind == "self":
        assert s.accepted >= 0.9 * s.drafted  # its own argmax (ties aside)
    if kind == "random":
        assert s.accepted < 0.2 * s.drafted  # nearly every draft rolled back


@pytest.mark.parametrize("kind", ["self", "random", "ngram"])
def test_greedy_identity_batched_with_arrivals_and_cancels(smol, prompts, plain, kind: str) -> None:
    """Eight jobs first, four more every two steps (at most eight running: the rest queue), two cancelled."""
    model, tok = smol
    gen = Generator(model, Cache(model, CACHE, page_size=16), tok, max_batch_size=8, **drafts(kind, model, tok))
    jobs = [Job(p, max_new_tokens=n, stop_at_eos=False, identifier=i) for i, (p, n) in enumerate(zip(prompts, NEW))]
    cancel = {1: jobs[3], 5: jobs[13]}  # the longest outputs: neither can have finished by then
    cancelled: dict[int, str] = {}
    gen.enqueue(jobs[:8])
    out: dict[int, list[int]] = {}
    done: set[int] = set()
    step = 0
    while gen.num_remaining() or step <= 8:
        if step in (2, 4, 6, 8):
            gen.enqueue(jobs[8 + (step // 2 - 1) * 3:8 + (step // 2) * 3])
        if step in cancel:
            cancelled[cancel[step].identifier] = cancel[step].status
            gen.cancel(cancel[step])
        for r in gen.iterate():
            out.setdefault(r["identifier"], []).extend(r["token_ids"])
            if r["eos"]:
                done.add(r["identifier"])
        step += 1
    check_clean(gen)
    assert cancelled[3] == "active" and done == set(range(len(jobs))) - set(cancelled)
    for i in done:
        assert out[i] == plain[i], f"prompt {i}: {PROMPTS[i]!r}"
    for i in cancelled:
        assert out.get(i, []) == plain[i][:len(out.get(i, []))]
    assert gen.spec.stats.steps > 0


@pytest.mark.slow  # the GPU pipeline's ngram stage runs this bench whole; greedy identity stays in the default run
def test_ngram_bench_reports_each_draft_rule_over_the_answer_and_past_it() -> None:
    """``exl3 bench --ngram-bench`` on the CPU: the dynamic and the fixed draft length give the plain run's tokens,
    over ``new_tokens`` and over the answer alone (which ends at the model's end-of-turn), with the statistics and
    the dynamic policy's estimates each row needs to be read."""
    from exl3_core.bench.spec import run_ngram_bench

    out = run_ngram_bench(batches=(1,), new_tokens=84, k=4, device="cpu", log=lambda s: None)
    answer = out["answer_tokens"]
    assert 8 < answer < 84  # the rewrite ends inside the run
    rows = {(r["span"], r["draft"]): r for r in out["runs"]}
    assert set(rows) == {(s, d) for s in ("tokens", "answer") for d in ("dynamic", "k=4")}
    for (span, draft), r in rows.items():
        assert r["same_tokens"], (span, draft)
        assert r["new_tokens"] == (84 if span == "tokens" else answer)
        st = r["ngram_stats"]
        assert st["draft_tokens"] > 0 and 0.0 < st["acceptance_rate"] <= 1.0
        assert ("policy" in st) == (draft == "dynamic")
    # a copying answer is drafted in long runs: far fewer speculative steps than tokens
    assert rows[("answer", "k=4")]["ngram_stats"]["spec_steps"] < answer / 2
