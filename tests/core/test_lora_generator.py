"""LoRA through the generator: a batch mixing four adapters (one job with a weighted pair) and base rows,
joining at different steps, gives every job exactly what it gets alone; adapters loaded and unloaded while
jobs run affect only the jobs that name them; prompts share prefix-cache pages only under the same choice."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from exl3_core.archkit.config import Config
from exl3_core.archkit.model import Model
from exl3_core.cache import Cache
from exl3_core.generator import Generator, Job, JobError
from exl3_core.generator.batching import bucket_size
from exl3_core.lora import LoraError
from exl3_core.lora.registry import attached
from exl3_core.testing.arch import build_checkpoint, tiny_variants
from exl3_core.testing.lora import random_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCH = "Qwen3ForCausalLM"
NEW = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Path, int]:
    """A tiny Qwen3 model with adapters a-e written (not loaded) under the returned folder."""
    cfg = next(iter(tiny_variants(ARCH).values()))
    d = tmp_path_factory.mktemp("qwen3")
    build_checkpoint(ARCH, cfg, d, seed=2)
    model = Model.from_config(Config.from_directory(d)).load()
    linears = {m.key: (m.in_features, m.out_features) for m in model.modules()
               if hasattr(m, "adapters") and ".layers." in getattr(m, "key", "")}
    ads = tmp_path_factory.mktemp("adapters")
    for i, (name, r) in enumerate((("a", 2), ("b", 4), ("c", 8), ("d", 16), ("e", 3))):
        # strong deltas: a tiny random model's greedy tokens must change under every adapter
        random_adapter(ads / name, linears, r=r, seed=10 + i, rslora=name == "c", gain=3.0)
    return model, ads, cfg.vocab_size


def _gen(model: Model, **kw: Any) -> Generator:
    return Generator(model, Cache(model, max_num_tokens=1024, page_size=16), max_batch_size=8, max_chunk_tokens=64,
                     **kw)


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(gen: Generator, joins: dict[int, list[Job]]) -> dict[Any, dict[str, Any]]:
    """Iterate to the end, enqueueing ``joins[step]`` before that step; identifier -> tokens, logits, result."""
    out: dict[Any, dict[str, Any]] = {}
    step = 0
    while gen.num_remaining() or any(s >= step for s in joins):
        gen.enqueue(joins.get(step, []))
        for r in gen.iterate():
            o = out.setdefault(r["identifier"], {"tokens": [], "logits": []})
            o["tokens"] += r["token_ids"]
            if "logits" in r:
                o["logits"].append(r["logits"])
            if r["eos"]:
                o["end"] = r
        step += 1
    return out


CHOICES: list[dict[str, float] | None] = [{"a": 1.0}, {"b": 1.0}, None, {"c": 1.0}, {"d": 0.5, "a": -1.0}, None]


def _jobs(vocab: int, logits: bool) -> list[Job]:
    return [Job(_prompt(vocab, 9 + 7 * i, i), max_new_tokens=NEW, stop_at_eos=False, identifier=i, loras=c,
                return_logits=logits) for i, c in enumerate(CHOICES)]


@pytest.mark.parametrize("logits", [True, False], ids=["plain_loop", "overlapped_loop"])
def test_mixed_batch_staggered_joins_equal_jobs_alone(setup: tuple[Model, Path, int], logits: bool) -> None:
    model, ads, vocab = setup
    for n in "abcd":
        model.load_lora(ads / n, name=n)
    try:
        alone = {}
        for job in _jobs(vocab, logits):
            alone.update(_run(_gen(model), {0: [job]}))
        gen = _gen(model)
        jobs = _jobs(vocab, logits)
        mixed = _run(gen, {0: jobs[:2], 1: jobs[2:4], 3: jobs[4:5], 4: jobs[5:]})
        if not logits:
            assert gen.pipeline is not None and gen.pipeline.launches > 0, "the overlapped loop never ran"
        for i, c in enumerate(CHOICES):
            assert mixed[i]["tokens"] == alone[i]["tokens"], f"job {i} ({c}) in the mixed batch"
            if logits:
                a, b = torch.cat(mixed[i]["logits"]), torch.cat(alone[i]["logits"])
                assert (a - b).abs().max() <= 1e-5 * b.abs().max(), f"job {i} ({c}): logits differ"
        # the choices matter: every job with adapters generates other tokens than the base model would
        for job in _jobs(vocab, logits):
            if job.loras:
                job.loras = {}
                base = _run(_gen(model), {0: [job]})
                assert base[job.identifier]["tokens"] != alone[job.identifier]["tokens"], \
                    f"job {job.identifier}'s adapters do not change its tokens: the comparison would be vacuous"
    finally:
        for n in "abcd":
            model.unload_lora(n)


@pytest.mark.parametrize("draft", ["ngram", "self"])
def test_speculative_rows_verify_under_their_jobs_adapters(setup: tuple[Model, Path, int], draft: str) -> None:
    """Speculative decoding over the mixed batch (n-gram drafts, or the model drafting for itself without its
    adapters): every job gets the plain generator's greedy tokens, drafts were verified and accepted, and no page
    is left in use."""
    model, ads, vocab = setup
    for n in "abcd":
        model.load_lora(ads / n, name=n)
    try:
        def jobs() -> list[Job]:  # prompts that repeat themselves, so that the n-gram lookup finds matches
            return [Job(_prompt(vocab, 9 + 7 * i, i) * 2, max_new_tokens=16, stop_at_eos=False, identifier=i, loras=c)
                    for i, c in enumerate(CHOICES)]

        plain = _run(_gen(model), {0: jobs()[:3], 2: jobs()[3:]})
        kw: dict[str, Any] = ({"ngram_draft_tokens": 3} if draft == "ngram" else
                              {"draft_model": model, "draft_cache": Cache(model, max_num_tokens=1024, page_size=16),
                               "num_draft_tokens": 3})
        gen = _gen(model, dynamic_draft=False, **kw)
        got = _run(gen, {0: jobs()[:3], 2: jobs()[3:]})
        for i, c in enumerate(CHOICES):
            assert got[i]["tokens"] == plain[i]["tokens"], f"job {i} ({c}) under speculative decoding"
        assert gen.spec is not None and gen.spec.stats.accepted > 0
        assert gen.cache.allocator.num_live() == 0
    finally:
        for n in "abcd":
            model.unload_lora(n)


@pytest.mark.parametrize(("batch", "k"), [(5, 8), (100, 8), (3, 2)])
def test_choice_buffers_hold_the_largest_padded_verification_step(setup: tuple[Model, Path, int], batch: int,
                                                                   k: int) -> None:
    """A graph of a verification step (its batch padded to a bucket, k + 1 rows per sequence) finds every row it
    needs in the adapter choice's buffers, which cannot grow while a graph is captured."""
    model, ads, _ = setup
    model.load_lora(ads / "a", name="a")
    try:
        Generator(model, Cache(model, max_num_tokens=1024, page_size=16), max_batch_size=batch, max_chunk_tokens=64,
                  ngram_draft_tokens=k)
        selection = attached(model).selection  # type: ignore[union-attr]
        selection.ensure(bucket_size(batch) * (k + 1), capturing=True)  # raises where it would have to grow
    finally:
        model.unload_lora("a")


def test_load_and_unload_while_jobs_run(setup: tuple[Model, Path, int]) -> None:
    model, ads, vocab = setup
    model.load_lora(ads / "a", name="a")
    model.load_lora(ads / "b", name="b")
    try:
        def jobs() -> list[Job]:
            return [Job(_prompt(vocab, 12, 20 + i), max_new_tokens=NEW, stop_at_eos=False, identifier=n, loras=c)
                    for i, (n, c) in enumerate((("A", {"a": 1.0}), ("B", {"b": 1.0}), ("base", None)))]

        ref = _run(_gen(model), {0: jobs()})
        later = Job(_prompt(vocab, 10, 30), max_new_tokens=NEW, stop_at_eos=False, identifier="E", loras={"e": 1.0})
        with pytest.raises(LoraError, match="'e' is loaded|no LoRA adapter named 'e'"):
            _gen(model).enqueue(later)
        gen = _gen(model)
        gen.enqueue(jobs())
        out: dict[Any, dict[str, Any]] = {}
        step = 0
        while gen.num_remaining():
            if step == 3:
                gen.unload_lora("b")
                gen.load_lora(ads / "e", name="e")
                gen.enqueue(Job(_prompt(vocab, 10, 30), max_new_tokens=NEW, stop_at_eos=False, identifier="E",
                                loras={"e": 1.0}))
            for r in gen.iterate():
                o = out.setdefault(r["identifier"], {"tokens": []})
                o["tokens"] += r["token_ids"]
                if r["eos"]:
                    o["end"] = r
            step += 1
        assert out["B"]["end"]["eos_reason"] == "error" and "'b'" in str(out["B"]["end"]["error"])
        assert "unloaded" in str(out["B"]["end"]["error"])
        for n in ("A", "base"):
            assert out[n]["tokens"] == ref[n]["tokens"] and out[n]["end"]["eos_reason"] == "max_new_tokens"
        alone_e = _run(_gen(model), {0: [Job(_prompt(vocab, 10, 30), max_new_tokens=NEW, stop_at_eos=False,
                                             identifier="E", loras={"e": 1.0})]})
        assert out["E"]["tokens"] == alone_e["E"]["tokens"]
        # generate() names the failing job; a job naming an unloaded adapter is refused at once
        with pytest.raises(LoraError, match="'b'"):
            _gen(model).generate(torch.tensor(_prompt(vocab, 8, 1)), max_new_tokens=2, loras={"b": 1.0})
        assert _gen(model).generate(torch.tensor(_prompt(vocab, 8, 1)), max_new_tokens=2, loras={"e": 1.0}) == ""
    finally:
        for n in model.lora_names():
            model.unload_lora(n)


def test_unload_fails_running_job_under_generate(setup: tuple[Model, Path, int]) -> None:
    """A job whose adapter goes away mid-run ends with an error that ``generate`` raises, naming the adapter."""
    model, ads, vocab = setup
    model.load_lora(ads / "a", name="a")
    gen = _gen(model)
    calls = {"n": 0}
    step = gen.iterate

    def iterate() -> list[Any]:
        calls["n"] += 1
        if calls["n"] == 3:
            model.unload_lora("a")
        return step()

    gen.iterate = iterate  # type: ignore[method-assign]
    with pytest.raises(JobError, match="'a'.*unloaded"):
        gen.generate(torch.tensor(_prompt(vocab, 8, 2)), max_new_tokens=NEW, loras={"a": 1.0}, stop_at_eos=False)


def test_prefix_cache_pages_shared_only_under_the_same_choice(setup: tuple[Model, Path, int]) -> None:
    model, ads, vocab = setup
    model.load_lora(ads / "a", name="a")
    try:
        prompt = _prompt(vocab, 70, 5)  # four full pages of 16 shareable
        gen = _gen(model)

        def job(i: int, loras: dict[str, float] | None) -> Job:
            return Job(prompt, max_new_tokens=3, stop_at_eos=False, identifier=i, loras=loras)

        first = _run(gen, {0: [job(0, None)]})
        with_a = _run(gen, {0: [job(1, {"a": 1.0})]})
        again = _run(gen, {0: [job(2, {"a": 1.0})]})
        half = _run(gen, {0: [job(3, {"a": 0.5})]})
        assert first[0]["end"]["cached_tokens"] == 0
        assert with_a[1]["end"]["cached_tokens"] == 0, "a job with an adapter reused the base model's pages"
        assert again[2]["end"]["cached_tokens"] == 64 and again[2]["tokens"] == with_a[1]["tokens"]
        assert half[3]["end"]["cached_tokens"] == 0, "another weight reused the pages of weight 1"
        alone = _run(_gen(model), {0: [job(1, {"a": 1.0})]})
        assert with_a[1]["tokens"] == alone[1]["tokens"]
    finally:
        model.unload_lora("a")


def test_job_checks_its_choice() -> None:
    with pytest.raises(TypeError, match="mapping"):
        Job([1, 2], loras=["a"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="finite"):
        Job([1, 2], loras={"a": float("nan")})
    assert Job([1, 2], loras={"a": 1}).loras == {"a": 1.0}
