"""``exl3 bench --draft SHAPE``: speculative decoding speed at controlled acceptance rates, against its ideal.

A random-weight target (``--shape``, self-predicting: see :class:`~exl3_core.bench.models.RandomSource`) and
draft (``--draft``) of one vocabulary are built. The plain generator
decodes ``batch`` random prompts first: its tokens/s is the baseline and its greedy tokens are the target's
continuation. The bench draft (:class:`OracleDrafter`) then runs every forward the draft model would (catch-up,
the two-token step, k - 1 one-token steps, the read of its tokens), but proposes at each position the target's
continuation with probability alpha and another token otherwise, so each draft is accepted with probability
alpha while the ones before it were. For each alpha and each k the generator's tokens/s with the draft is
compared with the baseline and with the ideal speedup [(1 - alpha^(k+1)) / (1 - alpha)] / (k c + 1), where
c = draft step time / target step time, both measured (a replayed decode step on CUDA). Also measured, to say
what binds: the target's step at k + 1 rows per sequence (verification), and the host time per speculative
step that neither forward accounts for. A last run per alpha leaves the draft length to the dynamic policy
(after one unmeasured run of it, a fresh policy: what it measures is the policy, not first-use compiles).

``--ngram-bench`` adds prompt lookup on the real default model (the embedded one): a chat prompt that
asks for a paragraph to be rewritten with one word changed (copy-heavy), greedy, at batch 1 and 16, against
the plain generator.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from exl3_core.bench.models import BenchShape, build_model, shape_dict
from exl3_core.bench.run import GRAPH_STEP_REPLAYS, decode_meta, decode_rate, time_median
from exl3_core.generator.batching import to_device_async
from exl3_core.generator.draft_policy import DraftLength, expected_tokens, ideal_speedup
from exl3_core.generator.drafting import ModelDrafter
from exl3_core.generator.job import Job
from exl3_core.generator.speculative import SpecStats


class OracleDrafter(ModelDrafter):
    """The bench draft: the draft model's forwards, the target's continuation with probability ``alpha``.

    :param reference: job identifier -> the target's greedy continuation of that job's prompt.
    :param vocab: vocabulary size (a rejected proposal is another token of it).
    """

    def __init__(self, model: Any, cache: Any, *, max_seq_len: int, alpha: float, reference: dict[Any, list[int]],
                 vocab: int, seed: int = 0) -> None:
        super().__init__(model, cache, max_seq_len=max_seq_len)
        self.alpha = alpha
        self.reference = reference
        self.vocab = vocab
        self._rng = random.Random(seed)

    def _forced(self, jobs: list[Job], seqs: Sequence[list[int]], K: int) -> torch.Tensor | None:
        # plain Python on the host: the bench's own work per step stays small beside the engine's host time
        rng = self._rng
        out: list[int] = []
        for job, seq in zip(jobs, seqs):
            ref = self.reference[job.identifier]
            done = len(seq) - len(job.prompt)
            for i in range(K):
                want = ref[done + i] if done + i < len(ref) else 0
                out.append(want if rng.random() < self.alpha else (want + rng.randrange(1, self.vocab)) % self.vocab)
        return to_device_async(torch.tensor(out, dtype=torch.int64).view(len(jobs), K), self.device)


def _decode_tokens(gen: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, dict[int, list[int]]]:
    """Tokens/s of the decode phase (from every job's first token to the last) and each job's tokens."""
    jobs = [Job(p, max_new_tokens=new_tokens + 1, stop_at_eos=False, identifier=i) for i, p in enumerate(prompts)]
    return decode_rate(gen, jobs)


def step_time(model: Any, cache: Any, *, batch: int, ctx: int, rows: int) -> float:
    """Seconds of one decode step of ``batch`` sequences with ``rows`` new tokens each after ``ctx`` cached
    ones, as the generator runs it (a replayed graph on CUDA, else the eager forward)."""
    from exl3_core.generator.graphs import DecodeGraphs
    from exl3_core.plan import ExecutionPlan

    plan = ExecutionPlan(model)
    graphs = DecodeGraphs.create(plan, cache, cache.max_pages_per_seq(ctx + rows))
    meta, pages = decode_meta(model, cache, batch=batch, ctx=ctx, rows=rows,
                              device=torch.device("cpu") if graphs is not None else model.device)
    try:
        if graphs is not None:
            n = GRAPH_STEP_REPLAYS
            t = time_median(lambda: [graphs.run(meta) for _ in range(n)], model.device, warmup=2, iters=7) / n
            graphs.reset()
            return t
        return time_median(lambda: plan.forward(meta, cache), model.device, warmup=1, iters=3)
    finally:
        cache.allocator.release(pages)


def run_spec_bench(shape: BenchShape, draft_shape: BenchShape, *, alphas: tuple[float, ...] = (0.6, 0.8, 0.9),
                   ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8), batch: int = 1, ctx: int = 256, new_tokens: int = 256,
                   bpw: float = 4.0, head_bits: int | None = 6, codebook: str = "mcg",
                   device: str | torch.device | None = None, dynamic: bool = True, seed: int = 0,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every figure of the module docstring (the draft-model part) as one dict."""
    from exl3_core import settings
    from exl3_core.generator import Generator

    if shape.vocab != draft_shape.vocab:
        raise ValueError(f"--draft {draft_shape.vocab}-token vocabulary differs from --shape's {shape.vocab}; a draft "
                         f"shares the target's vocabulary")
    for a in alphas:
        if not 0.0 <= a < 1.0:
            raise ValueError(f"--draft-alphas: {a} is not in [0, 1)")
    if not ks or min(ks) < 1:
        raise ValueError(f"--draft-k {ks}: every draft length must be >= 1")
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    ps = settings.get().page_size
    per_seq = -(-(ctx + new_tokens + max(ks) + 8) // ps) + 1
    tokens = 2 * ps * per_seq * batch
    # a self-predicting target: its greedy continuation, which the oracle proposes, is the same through the
    # verification rows as through one-row steps, so acceptance is alpha for the whole run
    target, cache = build_model(shape, bpw=bpw, head_bits=head_bits, codebook=codebook, device=dev,
                                cache_tokens=tokens, seed=seed, self_predicting=True)
    draft, dcache = build_model(draft_shape, bpw=bpw, head_bits=head_bits, codebook=codebook, device=dev,
                                cache_tokens=tokens, seed=seed + 1)
    out: dict[str, Any] = {"shape": shape_dict(shape), "draft_shape": shape_dict(draft_shape), "batch": batch,
                           "ctx": ctx, "new_tokens": new_tokens,
                           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    t_target = step_time(target, cache, batch=batch, ctx=ctx, rows=1)
    t_draft = step_time(draft, dcache, batch=batch, ctx=ctx, rows=1)
    c = t_draft / t_target
    verify = {k: step_time(target, cache, batch=batch, ctx=ctx, rows=k + 1) for k in ks}
    out.update(target_step_ms=t_target * 1e3, draft_step_ms=t_draft * 1e3, c=c,
               verify_step_ms={str(k + 1): t * 1e3 for k, t in verify.items()})
    log(f"target step {t_target * 1e3:.3f} ms, draft step {t_draft * 1e3:.3f} ms: c = {c:.3f}; verification at k+1 rows: "
        + ", ".join(f"{k + 1}: {t * 1e3:.3f} ms" for k, t in verify.items()))
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, shape.vocab, (ctx,), generator=g).tolist() for _ in range(batch)]
    max_seq = ctx + new_tokens + max(ks) + 8

    plain = Generator(target, cache, None, max_batch_size=batch, max_seq_len=max_seq)
    _decode_tokens(plain, [p[:64] for p in prompts], 4)  # warm-up: compiles, captures
    plain.capture_graphs()
    base, ref = _decode_tokens(plain, prompts, new_tokens)
    out["plain_tok_s"] = base
    log(f"plain decode b={batch} ctx={ctx}: {base:.1f} tok/s")
    # one speculative generator for every run (its graphs captured once): each run sets the draft length
    # policy and the oracle's alpha
    gen = Generator(target, cache, None, max_batch_size=batch, max_seq_len=max_seq, draft_model=draft,
                    draft_cache=dcache, num_draft_tokens=max(ks), dynamic_draft=False)
    assert gen.spec is not None
    oracle = OracleDrafter(draft, dcache, max_seq_len=gen.max_seq_len, alpha=0.0, reference=ref, vocab=shape.vocab,
                           seed=seed + 7)
    gen.spec.drafter = oracle
    gen.capture_graphs()
    # warm-up: every run once, unmeasured, on the measured prompts at the first alpha, so that no measured run
    # pays a first-use cost: the eager parts (the draft's catch-up prefills, its widened first steps) compile
    # their kernels per shape, and rejections at alpha 0 would never reach the shapes that accepted drafts lead
    # to (on a GPU with a cold kernel cache the first measured run lost most of its rate to them)
    runs = [(k, False) for k in ks] + ([(max(ks), True)] if dynamic else [])
    oracle.alpha = alphas[0] if alphas else 0.0
    for k, dyn in runs:
        gen.spec.length = DraftLength(k, dynamic=dyn, draft_cost=c)
        _decode_tokens(gen, prompts, new_tokens)
    out["alphas"] = []
    for a in alphas:
        oracle.alpha = a
        row: dict[str, Any] = {"alpha": a, "runs": []}
        for k, dyn in runs:
            if dyn:  # once unmeasured: the draft's catch-up prefills after plain stretches of every length this
                # alpha leads to compile their kernels on first use
                gen.spec.length = DraftLength(k, dynamic=True, draft_cost=c)
                _decode_tokens(gen, prompts, new_tokens)
            gen.spec.length = DraftLength(k, dynamic=dyn, draft_cost=c)
            gen.spec.stats = SpecStats()
            tok_s, got = _decode_tokens(gen, prompts, new_tokens)
            st = gen.spec.stats
            wall = new_tokens * batch / tok_s  # seconds of the decode phase
            steps = st.steps + st.plain_steps + st.timed_plain_steps
            r = {"k": k, "dynamic": dyn, "tok_s": tok_s, "speedup": tok_s / base, "same_tokens": got == ref,
                 "acceptance": st.accepted / st.drafted if st.drafted else 0.0,
                 "tokens_per_step": st.committed / st.steps / batch if st.steps else 0.0,
                 "spec_steps": st.steps, "plain_steps": st.plain_steps + st.timed_plain_steps}
            if dyn:  # what the dynamic policy's choices rested on
                r["policy"] = gen.spec.length.estimates()
            if not dyn:
                ideal = ideal_speedup(a, k, c)
                # what a step costs: verification and k draft forwards on the device, the rest on the host
                device_ms = (verify[k] + k * t_draft) * 1e3
                r.update(ideal=ideal, fraction_of_ideal=r["speedup"] / ideal,
                         expected_tokens=expected_tokens(a, k), step_ms=wall / max(steps, 1) * 1e3,
                         device_ms_per_step=device_ms, host_ms_per_step=wall / max(steps, 1) * 1e3 - device_ms)
            row["runs"].append(r)
            log(f"alpha {a:.2f} k={'dyn' if dyn else k}: {tok_s:.1f} tok/s, x{r['speedup']:.2f}"
                + (f" (ideal x{r['ideal']:.2f}: {100 * r['fraction_of_ideal']:.0f}%; step {r['step_ms']:.2f} ms of which "
                   f"device {r['device_ms_per_step']:.2f}, host {r['host_ms_per_step']:.2f})" if not dyn else
                   f" (acceptance {r['acceptance']:.2f}, {r['spec_steps']} speculative / {r['plain_steps']} plain steps; "
                   f"policy's estimates {r['policy']})"))
        fixed = [r for r in row["runs"] if not r["dynamic"]]
        best = max(fixed, key=lambda r: r["speedup"])
        best_ideal = max(fixed, key=lambda r: r["ideal"])
        row.update(best_k=best["k"], best_speedup=best["speedup"], ideal_best_k=best_ideal["k"],
                   ideal_best=best_ideal["ideal"], fraction_of_best_ideal=best["speedup"] / best_ideal["ideal"])
        out["alphas"].append(row)
    target.unload()
    draft.unload()
    return out


#: the paragraph the n-gram bench asks the model to rewrite (copy-heavy output)
PARAGRAPH = ("The old lighthouse stood at the edge of the cliff for more than two hundred years. Every night its keeper "
             "climbed the narrow stairs, lit the great lamp and watched the ships pass safely through the dark water. "
             "When the storms came, the light was the only thing the sailors could see, and many of them owed their "
             "lives to the quiet man who never missed a single night.")


def rewrite_prompt(tok: Any) -> list[int]:
    """The n-gram bench's prompt: the chat-formatted request to rewrite :data:`PARAGRAPH` (copy-heavy output)."""
    text = tok.apply_chat_template([{"role": "user", "content": "Rewrite this paragraph word for word, but say "
                                     "'tower' instead of 'lighthouse':\n\n" + PARAGRAPH}], add_generation_prompt=True)
    return tok.encode(text, add_bos=False)[0].tolist()


def answer_length(tokens: list[int], tok: Any) -> int:
    """Tokens of a generated answer up to and including its first end-of-turn token (0: it has none)."""
    return next((i + 1 for i, t in enumerate(tokens) if t in tok.eos_token_ids), 0)


def run_ngram_bench(*, batches: tuple[int, ...] = (1, 16), new_tokens: int = 128, k: int = 4,
                    device: str | torch.device | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Prompt lookup on the default model for a rewriting prompt, against the plain generator, per batch size:
    the dynamic draft length and a fixed ``k``, over ``new_tokens`` tokens (past the end of the answer) and over
    the answer alone (up to its end-of-turn token, as the plain run wrote it)."""
    from exl3_core import Cache, Config, Generator, Model, Tokenizer
    from exl3_core.convert.default_model import default_model_dir

    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    d = default_model_dir(progress=False)
    cfg = Config.from_directory(d)
    model = Model.from_config(cfg)
    tokens = max(batches) * 1024
    cache = Cache(model, max_num_tokens=tokens)
    model.load(device=dev, dtype=torch.float16 if dev.type == "cuda" else torch.float32, caches=[cache])
    tok = Tokenizer.from_config(cfg)
    prompt = rewrite_prompt(tok)
    out: dict[str, Any] = {"prompt_tokens": len(prompt), "new_tokens": new_tokens, "k": k, "runs": []}
    variants: tuple[tuple[str, dict[str, Any]], ...] = (
        ("plain", {}), ("dynamic", {"ngram_draft_tokens": k}),
        (f"k={k}", {"ngram_draft_tokens": k, "dynamic_draft": False}))
    answer = 0
    for b in batches:
        gens = {}
        for name, kw in variants:  # each captured once, for both spans
            gens[name] = gen = Generator(model, cache, tok, max_batch_size=b, **kw)
            _decode_tokens(gen, [prompt] * b, 8)
            gen.capture_graphs()
        for span in ("tokens", "answer"):
            n = new_tokens if span == "tokens" else answer
            if n < 2:
                continue
            res: dict[str, tuple[float, dict[int, list[int]], Any]] = {}
            for name, gen in gens.items():
                spec = gen.spec
                if spec is not None:  # each run starts with what the policy learns from nothing
                    spec.length = DraftLength(k, dynamic=spec.length.dynamic)
                    spec.stats = SpecStats()
                tok_s, got = _decode_tokens(gen, [prompt] * b, n)
                res[name] = (tok_s, got, None if spec is None else
                             {**spec.stats.as_dict(), **({"policy": spec.length.estimates()} if spec.length.dynamic else {})})
            base_rate, ref, _ = res["plain"]
            if span == "tokens" and not answer:
                answer = out["answer_tokens"] = answer_length(ref[0], tok)
            for name, (rate, got, stats) in res.items():
                if name == "plain":
                    continue
                same = got == ref
                r: dict[str, Any] = {"batch": b, "span": span, "new_tokens": n, "draft": name, "plain_tok_s": base_rate,
                                     "ngram_tok_s": rate, "speedup": rate / base_rate, "same_tokens": same,
                                     "ngram_stats": stats}
                out["runs"].append(r)
                log(f"n-gram b={b} {name}, {n} tokens{' (the answer)' if span == 'answer' else ''}: {rate:.1f} tok/s "
                    f"vs plain {base_rate:.1f}: x{r['speedup']:.2f}; acceptance {stats['acceptance_rate']:.2f}, "
                    f"{stats['spec_steps']} speculative / {stats['plain_steps']} plain steps; same tokens: {same}"
                    + (f"; policy's estimates {stats['policy']}" if "policy" in stats else ""))
    out["sample"] = tok.decode(torch.tensor(ref[0][:80]))
    model.unload()
    return out
