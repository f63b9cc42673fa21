"""The scheduler on CUDA, where decode replays graphs, greedy decode runs one step ahead and prefill
chunks replay prefill graphs: jobs outgrowing the cache are preempted and recomputed with the output
they have alone, and the step budget keeps a stream flowing while a long prompt is prefilled.

The fairness figure of the 8B shape (``-s`` prints it; the CPU bound of 3x is asserted in
tests/e2e/test_generator_fairness.py)::

    pytest -s tests/gpu/test_scheduler_gpu.py
"""
from __future__ import annotations

import statistics
import time

import pytest
import torch

from exl3_core.bench.models import bench_plugins, build_model, parse_shape
from exl3_core.generator import Generator, Job
from exl3_core.testing.arch import parted_only_at_near_tie

SMALL = "custom(512,1024,3,8,2,2000)"
PAGE = 64


@pytest.fixture(scope="module")
def small():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, cache = build_model(parse_shape(SMALL), bpw=4.0, head_bits=6, device="cuda", cache_tokens=1024,
                               page_size=PAGE, plugins=bench_plugins())
    yield model, cache
    model.unload()


def _outputs(gen: Generator, jobs: list[Job]) -> dict[int, tuple[list[int], torch.Tensor | None]]:
    """Each job's tokens and, where it asked for them, its logits per token."""
    gen.enqueue(jobs)
    toks: dict[int, list[int]] = {j.identifier: [] for j in jobs}
    logits: dict[int, list[torch.Tensor]] = {j.identifier: [] for j in jobs}
    while gen.num_remaining():
        for r in gen.iterate():
            assert r.get("eos_reason") != "error", r
            toks[r["identifier"]] += r["token_ids"]
            if "logits" in r:
                logits[r["identifier"]].append(r["logits"])
    return {i: (toks[i], torch.cat(logits[i]).float().cpu() if logits[i] else None) for i in toks}


def test_preempted_jobs_match_running_alone_on_cuda(small) -> None:
    model, cache = small
    specs = [(400, 500, None), (300, 400, {"temperature": 0.8, "top_k": 40}), (200, 300, None)]

    def jobs() -> list[Job]:
        return [Job(torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(i)).tolist(),
                    max_new_tokens=m, sampler=s, seed=i, stop_at_eos=False, identifier=i, return_logits=True)
                for i, (n, m, s) in enumerate(specs)]

    cache.allocator.clear_prefix_cache()
    gen = Generator(model, cache, None, max_batch_size=4)
    gen.capture_graphs()
    together = _outputs(gen, jobs())
    assert gen.scheduler.preemptions >= 1
    assert cache.allocator.num_live() == 0
    for job, (_, _, sampler) in zip(jobs(), specs):
        cache.allocator.clear_prefix_cache()  # alone means computed alone, not read from the run above
        want, want_logits = _outputs(Generator(model, cache, None, max_batch_size=4), [job])[job.identifier]
        got, got_logits = together[job.identifier]
        # a batch of four rounds otherwise than one sequence: the runs may part at a near-tie (greedy) or
        # where one draw falls between two nearly equal distributions (sampled), nowhere else
        assert want_logits is not None and got_logits is not None
        why = parted_only_at_near_tie(want, got, want_logits, got_logits=got_logits if sampler else None)
        assert why is None, f"job {job.identifier}: {why}"


def test_stream_gap_while_a_long_prompt_is_prefilled_8b() -> None:
    """Records the 8B shape's stream gap during an 8x-budget prefill against its unloaded gap, the mixed steps'
    kernels compiled by an earlier prefill of the same size."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, cache = build_model(parse_shape("8b"), bpw=4.0, head_bits=6, device="cuda", cache_tokens=16384,
                               plugins=bench_plugins())
    try:
        gen = Generator(model, cache, None, max_batch_size=8)
        gen.capture_graphs()
        budget = gen.scheduler.step_tokens
        stream = Job(list(range(1, 65)), max_new_tokens=100_000, stop_at_eos=False, identifier="stream")
        gen.enqueue(stream)

        def step() -> tuple[float, int]:
            n = stream.new_tokens
            torch.cuda.synchronize()
            t = time.perf_counter()
            gen.iterate()
            torch.cuda.synchronize()
            return time.perf_counter() - t, stream.new_tokens - n

        def prefill_beside_the_stream(ident: str) -> list[tuple[float, int]]:
            long = Job(torch.randint(0, 1000, (8 * budget,)).tolist(), max_new_tokens=1, identifier=ident)
            gen.enqueue(long)
            loaded = []
            while long.status != "done":
                loaded.append(step())
                assert len(loaded) < 100
            return loaded

        for _ in range(20):  # warm-up: prefill, graphs, the one-step-ahead loop
            step()
        # and once through the mixed steps, whose kernels (chunk shapes beside a decode row) compile on first use
        prefill_beside_the_stream("warm-up")
        unloaded = [step() for _ in range(30)]
        per_token = statistics.median(t / max(n, 1) for t, n in unloaded)
        loaded = prefill_beside_the_stream("long")
        assert all(n >= 1 for _, n in loaded)  # the stream got a token every step
        gaps = sorted(t / n for t, n in loaded)
        worst = gaps[-1]
        print(f"\n8b, step budget {budget}: unloaded gap {per_token * 1e3:.2f} ms, worst gap during an "
              f"{8 * budget}-token prefill {worst * 1e3:.2f} ms ({worst / per_token:.2f}x; median "
              f"{statistics.median(gaps) / per_token:.2f}x), {len(loaded)} steps")
    finally:
        model.unload()
