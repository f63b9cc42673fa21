"""Features composed at random: each seed draws a tiny architecture, a cache (fp16 or quantized at random widths,
page size, a size small enough to preempt), a drafter (none, n-gram or the model itself), batch and chunk limits,
``max_seq_len``, and jobs with LoRA choices, penalties, seeded sampling (without a drafter: drafted samples
follow the same distribution, not the same draws), priorities, shared prefixes, staggered arrivals and a
cancel. Every job that is not cancelled must give what it gives alone on a plain generator over the same cache
kind, and no page may stay live. A quantized cache may part a job at a near-tie only (its codes can round
across a step when a batched product differs in the last bit: README, quantized cache)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from exl3_core.archkit.config import Config
from exl3_core.archkit.model import Model
from exl3_core.cache import Cache
from exl3_core.generator import Generator, Job
from exl3_core.sampling import Sampler
from exl3_core.testing.arch import build_checkpoint, parted_only_at_near_tie, tiny_variants
from exl3_core.testing.lora import random_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: (architecture, variant): a Qwen3 whose head dim allows the quantized cache, a GQA Llama with dynamic RoPE,
#: a Qwen2 with a sliding window, a mixture of experts and a latent (MLA) cache, which may be quantized too
MODELS = (("Qwen3ForCausalLM", "h192_untied_bias"), ("LlamaForCausalLM", "rope_dynamic"),
          ("Qwen2ForCausalLM", "sliding_upper"), ("Qwen3MoeForCausalLM", "norm_topk_dense_first"),
          ("DeepseekV3ForCausalLM", "q_full_halfsplit"))
CHOICES: tuple[dict[str, float] | None, ...] = (None, {"a": 1.0}, {"b": 0.7}, {"a": 0.5, "b": 0.5})


@dataclass
class Tiny:
    model: Model
    vocab: int
    quantizable: bool  # its cache geometry fits the quantized cache's groups
    latent: bool  # an MLA cache: one width for keys and values


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> list[Tiny]:
    out = []
    for arch, variant in MODELS:
        cfg = tiny_variants(arch)[variant]
        d = tmp_path_factory.mktemp(variant)
        build_checkpoint(arch, cfg, d, seed=3)
        model = Model.from_config(Config.from_directory(d)).load()
        linears = {m.key: (m.in_features, m.out_features) for m in model.modules()
                   if hasattr(m, "adapters") and ".layers." in getattr(m, "key", "")}
        for i, name in enumerate("ab"):
            random_adapter(d / f"lora_{name}", linears, r=4 + 4 * i, seed=20 + i, gain=3.0)
            model.load_lora(d / f"lora_{name}", name=name)
        try:
            Cache(model, max_num_tokens=64, variant="quant")
            quantizable = True
        except ValueError:
            quantizable = False
        latent = any(getattr(m, "cache_kind", "") == "mla" for m in model.modules())
        out.append(Tiny(model, cfg.vocab_size, quantizable, latent))
    return out


def _drive(gen: Generator, joins: dict[int, list[Job]], cancels: dict[int, Job]) -> dict[Any, dict[str, Any]]:
    """Iterate to the end, enqueueing ``joins[step]`` and cancelling ``cancels[step]`` before that step."""
    out: dict[Any, dict[str, Any]] = {}
    step = 0
    while gen.num_remaining() or any(s >= step for s in joins):
        gen.enqueue(joins.get(step, []))
        if step in cancels and cancels[step].status in ("queued", "active"):
            gen.cancel(cancels[step])
        for r in gen.iterate():
            o = out.setdefault(r["identifier"], {"tokens": [], "logits": []})
            o["tokens"] += r["token_ids"]
            o["logits"].append(r["logits"])
            if r["eos"]:
                o["end"] = r["eos_reason"]
        step += 1
        assert step < 5000, "the generator stopped making progress"
    return out


def _trial(models: list[Tiny], seed: int) -> list[str]:
    """One random composition; what went wrong (empty: nothing)."""
    rng = random.Random(seed)
    t = rng.choice(models)
    bits = None if rng.random() < 0.4 or not t.quantizable else (rng.randint(3, 8), rng.randint(3, 8))
    if bits is not None and t.latent:
        bits = (bits[0], bits[0])
    kind = {} if bits is None else {"variant": "quant", "k_bits": bits[0], "v_bits": bits[1]}
    page_size = rng.choice([8, 16, 32])
    max_seq_len = rng.randint(90, 130) if rng.random() < 0.3 else None
    drafter = rng.choice(["none", "ngram", "self"])
    jobs_spec = []
    for i in range(rng.randint(3, 8)):
        n = rng.randint(1, 40)
        motif = [rng.randrange(t.vocab) for _ in range(rng.randint(1, 6))]
        prompt = (motif * 40)[:n] if rng.random() < 0.5 else [rng.randrange(t.vocab) for _ in range(n)]
        if jobs_spec and rng.random() < 0.3:  # a prefix of the first job's prompt: shared pages
            first = jobs_spec[0]["prompt"]
            prompt = first[:rng.randint(1, len(first))] + prompt
        jobs_spec.append({"prompt": prompt, "new": rng.randint(1, 14), "loras": rng.choice(CHOICES),
                          "penalties": rng.random() < 0.3, "priority": rng.choice([0, 0, 1, -1]),
                          "sampled": drafter == "none" and rng.random() < 0.4, "seed": rng.randrange(2**31)})

    def job(i: int) -> Job:
        s = jobs_spec[i]
        sampler = None
        if s["sampled"] or s["penalties"]:
            sampler = Sampler.build(temperature=0.9 if s["sampled"] else 0, top_p=0.95 if s["sampled"] else 1.0,
                                    repetition_penalty=1.3 if s["penalties"] else 1.0,
                                    frequency_penalty=0.2 if s["penalties"] else 0.0)
        return Job(s["prompt"], max_new_tokens=s["new"], stop_at_eos=False, identifier=i, loras=s["loras"],
                   sampler=sampler, priority=s["priority"], seed=s["seed"], return_logits=True)

    alone: dict[Any, dict[str, Any]] = {}
    for i in range(len(jobs_spec)):
        gen = Generator(t.model, Cache(t.model, max_num_tokens=1024, page_size=page_size, **kind), max_batch_size=1,
                        max_chunk_tokens=64, max_seq_len=max_seq_len)
        alone.update(_drive(gen, {0: [job(i)]}, {}))

    draft: dict[str, Any] = {}
    if drafter == "ngram":
        draft = {"ngram_draft_tokens": rng.randint(1, 5), "dynamic_draft": rng.random() < 0.5}
    elif drafter == "self":
        draft = {"draft_model": t.model, "draft_cache": Cache(t.model, max_num_tokens=4096, page_size=page_size, **kind),
                 "num_draft_tokens": rng.randint(1, 4), "dynamic_draft": rng.random() < 0.5}
    cache = Cache(t.model, max_num_tokens=rng.choice([96, 160, 1024]), page_size=page_size, **kind)
    gen = Generator(t.model, cache, max_batch_size=rng.randint(2, 6), max_chunk_tokens=rng.choice([7, 16, 64]),
                    max_seq_len=max_seq_len, **draft)
    jobs = [job(i) for i in range(len(jobs_spec))]
    joins: dict[int, list[Job]] = {}
    for j in jobs:
        joins.setdefault(rng.choice([0, 0, 1, 2, 4]), []).append(j)
    cancels = {rng.randint(1, 6): rng.choice(jobs)} if rng.random() < 0.3 else {}
    mixed = _drive(gen, joins, cancels)

    problems = [f"{cache.allocator.num_live()} pages still live"] if cache.allocator.num_live() else []
    cancelled = {j.identifier for j in cancels.values()}
    for i, want in alone.items():
        if i in cancelled:
            continue
        got = mixed.get(i)
        if got is None:
            problems.append(f"job {i}: no result")
            continue
        if bits is None:
            if got["tokens"] != want["tokens"]:
                problems.append(f"job {i}: {got['tokens']} against {want['tokens']} alone")
        else:
            why = parted_only_at_near_tie(want["tokens"], got["tokens"], torch.cat(want["logits"]),
                                          got_logits=torch.cat(got["logits"]) if jobs_spec[i]["sampled"] else None)
            if why:
                problems.append(f"job {i}: {why}")
        if got["tokens"] == want["tokens"] and got.get("end") != want.get("end"):
            problems.append(f"job {i}: ended by {got.get('end')} against {want.get('end')} alone")
    where = (f"seed {seed}: {MODELS[models.index(t)]}, cache {kind or 'fp16'} page {page_size}, drafter {drafter}, "
             f"jobs {[(len(s['prompt']), s['new'], s['loras'], s['penalties'], s['sampled'], s['priority']) for s in jobs_spec]}")
    return [f"{where}: {p}" for p in problems]


@pytest.mark.parametrize("seed", range(12))
def test_random_compositions_equal_each_job_alone(tiny: list[Tiny], seed: int) -> None:
    assert _trial(tiny, seed) == []


@pytest.mark.slow
def test_many_random_compositions_equal_each_job_alone(tiny: list[Tiny]) -> None:
    problems = [p for seed in range(12, 400) for p in _trial(tiny, seed)]
    assert problems == []
