"""CUDA-graph prefill (one fresh sequence padded to a token bucket) equals the eager forward of the same
execution plan."""
from __future__ import annotations

import pytest
import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.bench.models import bench_plugins, build_model, parse_shape
from exl3_core.generator import Generator, Job
from exl3_core.generator.graphs import PrefillGraphs, decline_reason
from exl3_core.plan import ExecutionPlan

SHAPE = "custom(512,1024,3,8,2,2000)"
PAGE = 64
TOL = 1e-2  # fp16 activations; cuBLAS picks other kernels for other row counts (see test_graph_decode)
# where one side prefilled in bf16 and the other in fp16 (a fresh prompt's replay against a mixed eager
# step, FusionTuning.prefill_bf16): bf16's rounding, ~8x fp16's (tests/gpu/test_prefill_bf16_gpu.py)
TOL_BF16 = 3e-2


@pytest.fixture(scope="module")
def model_cache():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, cache = build_model(parse_shape(SHAPE), bpw=4.0, head_bits=6, device="cuda", cache_tokens=8192,
                               page_size=PAGE, plugins=bench_plugins())
    yield model, cache
    model.unload()
    cache.free()


def _eager(plan: ExecutionPlan, cache, ids: list[int], pages: list[int]) -> torch.Tensor:
    meta = BatchMeta.from_lists([ids], [0], device="cuda", page_table=torch.tensor([pages], dtype=torch.int32),
                                page_size=PAGE, logits_indices=torch.tensor([len(ids) - 1], device="cuda"))
    return plan.forward(meta, cache)


def _kv(cache, pages: list[int], n: int) -> list[torch.Tensor]:
    """Keys and values of the first ``n`` positions of a sequence on ``pages``, every layer."""
    out = []
    idx = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(n)], device="cuda")
    for layer in cache.layers:
        for t in layer.attn_tensors():
            out.append(t.reshape(-1, *t.shape[2:]).index_select(0, idx).float())
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


@pytest.mark.parametrize("n", [1, 5, 16, 100, 130, 500])
def test_graph_prefill_equals_eager(model_cache, n: int) -> None:
    """Logits of the last token and every real position's cache entries match the eager forward on
    the same pages; two different prompts in one bucket replay with their own inputs."""
    model, cache = model_cache
    plan = ExecutionPlan(model)
    width = 16
    assert decline_reason(plan, cache, width, "prefill") is None
    graphs = PrefillGraphs.create(plan, cache, width, 2048)
    assert graphs is not None
    bucket = graphs.bucket(n, 0, -(-n // PAGE))
    assert bucket == plan.tuning.graphs.prefill_bucket(n, 2048) and bucket is not None and bucket >= n
    g = torch.Generator().manual_seed(n)
    pages = cache.allocator.allocate(-(-n // PAGE))
    try:
        for rep in range(2):
            ids = torch.randint(0, 2000, (n,), generator=g).tolist()
            ref = _eager(plan, cache, ids, pages)
            kv_ref = _kv(cache, pages, n)
            cache_before = [t.clone() for layer in cache.layers for t in layer.attn_tensors()]
            for layer in cache.layers:
                for t in layer.attn_tensors():
                    t[pages] = 0  # wipe the sequence's pages: the graph must write them itself
            got = graphs.run(ids, pages).clone()
            assert got.shape == ref.shape == (1, 2000)
            assert _rel(ref, got) < TOL, (rep, _rel(ref, got))
            for a, b in zip(kv_ref, _kv(cache, pages, n)):
                assert _rel(a, b) < TOL
            # nothing outside the sequence's pages and the scratch page changed
            scratch = cache.scratch_page
            after = [t for layer in cache.layers for t in layer.attn_tensors()]
            for a, b in zip(cache_before, after):
                keep = [p for p in range(a.shape[0]) if p not in pages and p != scratch]
                assert torch.equal(a[keep], b[keep])
        assert graphs.replays == 2
    finally:
        cache.allocator.release(pages)
        graphs.reset()


def test_generator_uses_prefill_graph(model_cache) -> None:
    """A fresh prompt's first token comes from the replayed prefill; the whole greedy continuation
    matches an eager generator up to a near-tie."""
    model, cache = model_cache
    prompt = torch.randint(0, 2000, (77,), generator=torch.Generator().manual_seed(5)).tolist()
    outs = []
    for graphed in (False, True):
        cache.allocator.clear_prefix_cache()  # else the second run would reuse the first one's pages
        gen = Generator(model, cache, None, max_batch_size=2, max_seq_len=512)
        if not graphed:
            gen.prefill_graphs = None
        else:
            assert gen.prefill_graphs is not None
        job = Job(prompt, max_new_tokens=8, stop_at_eos=False, return_logits=True)
        gen.enqueue(job)
        toks, logits = [], []
        while gen.num_remaining():
            for r in gen.iterate():
                toks += r["token_ids"]
                if len(r.get("logits", [])):
                    logits.append(r["logits"])
        outs.append((toks, torch.cat(logits)))
        if graphed:
            assert gen.prefill_graphs is not None and gen.prefill_graphs.replays == 1
            # the same prompt again: its first full page comes from the prefix cache, so the rest is a
            # chunk after a cached prefix, replayed by the prefix variant (paged attention)
            again = Job(prompt, max_new_tokens=1, stop_at_eos=False)
            gen.enqueue(again)
            while gen.num_remaining():
                gen.iterate()
            assert again.cached_tokens >= PAGE and gen.prefill_graphs.replays == 2  # after a cached prefix
    (ta, la), (tb, lb) = outs
    assert _rel(la[0], lb[0]) < TOL  # the first token's logits: prefill graph vs eager prefill
    if ta[0] != tb[0]:
        top = la[0].topk(2).values
        assert top[0] - top[1] <= TOL * la[0].abs().max(), "graph and eager prefill pick different tokens at a clear margin"


@pytest.mark.parametrize("past,n", [(64, 1), (64, 40), (128, 200), (300, 77)])
def test_graph_chunk_after_prefix_equals_eager(model_cache, past: int, n: int) -> None:
    """A chunk after ``past`` cached tokens (paged attention over them) replays like the eager
    forward of the same chunk over the same cache."""
    model, cache = model_cache
    plan = ExecutionPlan(model)
    width = 16
    graphs = PrefillGraphs.create(plan, cache, width, 2048)
    assert graphs is not None and graphs.bucket(n, past, -(-(past + n) // PAGE)) is not None
    g = torch.Generator().manual_seed(past + n)
    pages = cache.allocator.allocate(-(-(past + n) // PAGE))
    try:
        prefix = torch.randint(0, 2000, (past,), generator=g).tolist()
        _eager(plan, cache, prefix, pages)  # the cached prefix
        for rep in range(2):
            ids = torch.randint(0, 2000, (n,), generator=g).tolist()
            meta = BatchMeta.from_lists([ids], [past], device="cuda", page_table=torch.tensor([pages], dtype=torch.int32),
                                        page_size=PAGE, logits_indices=torch.tensor([n - 1], device="cuda"))
            ref = plan.forward(meta, cache)
            kv_ref = _kv(cache, pages, past + n)
            slots = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(past, past + n)], device="cuda")
            for layer in cache.layers:
                for t in layer.attn_tensors():
                    t.view(-1, *t.shape[2:])[slots] = 0  # the graph must write the chunk's entries itself
            got = graphs.run(ids, pages, past).clone()
            assert _rel(ref, got) < TOL, (rep, _rel(ref, got))
            for a, b in zip(kv_ref, _kv(cache, pages, past + n)):
                assert _rel(a, b) < TOL  # the prefix untouched, the chunk's keys/values rewritten alike
        assert graphs.replays == 2
    finally:
        cache.allocator.release(pages)
        graphs.reset()


def test_long_chunks_run_eagerly(model_cache) -> None:
    model, cache = model_cache
    graphs = PrefillGraphs.create(ExecutionPlan(model), cache, 16, 1024)
    assert graphs is not None
    assert graphs.bucket(100, 0, 2) == 128
    assert graphs.bucket(100, 64, 3) == 128  # after a cached prefix
    assert graphs.bucket(100, 16 * PAGE - 100, 16) is None  # padded to 128, positions would run past the table
    assert graphs.bucket(100, 0, 17) is None  # wider than the page table
    assert graphs.bucket(1025, 0, 17) is None  # beyond max_tokens
    assert graphs.bucket(600, 0, 10) is None  # would pad 600 -> 768 (< 90% full above 512 tokens)
    assert graphs.bucket(700, 0, 11) == 768
    with pytest.raises(ValueError, match="no bucket"):
        graphs.run([1] * 1025, list(range(17)))


def test_mixed_step_splits_into_two_replays(model_cache) -> None:
    """A prompt arriving while another job decodes: the mixed step runs as a decode replay plus a
    prefill replay, and both jobs' tokens match an all-eager generator up to a near-tie."""
    model, cache = model_cache
    g = torch.Generator().manual_seed(11)
    first, second = (torch.randint(0, 2000, (n,), generator=g).tolist() for n in (40, 100))
    outs = []
    for graphed in (False, True):
        cache.allocator.clear_prefix_cache()
        gen = Generator(model, cache, None, max_batch_size=4, max_seq_len=512, overlap_decode=False)
        if not graphed:
            gen.graphs = gen.prefill_graphs = None
        a = Job(first, max_new_tokens=12, stop_at_eos=False, identifier="a", return_logits=True)
        b = Job(second, max_new_tokens=6, stop_at_eos=False, identifier="b", return_logits=True)
        toks: dict[str, list[int]] = {"a": [], "b": []}
        logits: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
        gen.enqueue(a)
        steps = 0
        while gen.num_remaining():
            if steps == 3:
                gen.enqueue(b)  # a is decoding now: b's prompt makes a mixed step
                before = (gen.graphs.replays, gen.prefill_graphs.replays) if graphed else None
                calls = gen.forward_calls
            for r in gen.iterate():
                toks[r["identifier"]] += r["token_ids"]
                if len(r.get("logits", [])):
                    logits[r["identifier"]].append(r["logits"])
            if steps == 3:
                if graphed:
                    assert (gen.graphs.replays, gen.prefill_graphs.replays) == (before[0] + 1, before[1] + 1)
                    assert gen.forward_calls == calls + 2  # two forwards: the decode rows, then b's chunk
                else:
                    assert gen.forward_calls == calls + 1  # one mixed eager forward
            steps += 1
        outs.append((toks, {k: torch.cat(v) for k, v in logits.items()}))
    (ta, la), (tb, lb) = outs
    # b's 100-token prompt: the graph replays it alone, a fresh prompt, in bf16; the eager step mixes it
    # with a's decode row, in fp16
    for k, tol in (("a", TOL), ("b", TOL_BF16)):
        assert len(ta[k]) == len(tb[k])
        n = next((i for i in range(len(ta[k])) if ta[k][i] != tb[k][i]), len(ta[k]))
        if n < len(ta[k]):
            top = la[k][n].topk(2).values
            assert top[0] - top[1] <= tol * la[k][n].abs().max(), f"{k}: graph and eager part at {n} with a clear margin"
        assert n >= 1 and _rel(la[k][:n], lb[k][:n]) < tol
