"""Host-side rules of CUDA-graph decode and prefill: buckets, tuning, when graphs are declined."""
from __future__ import annotations

import dataclasses

import pytest

from exl3_core import settings
from exl3_core.generator.graphs import decline_reason
from exl3_core.tuning import PREFILL_BUCKETS, GraphTuning, Tuning


def test_prefill_bucket_is_the_smallest_that_holds_the_chunk() -> None:
    g = GraphTuning()
    for n in range(1, 2049):
        b = g.prefill_bucket(n, 2048)
        fits = [x for x in PREFILL_BUCKETS if x >= n]
        if b is None:
            # declined only above the loose range, when the chunk would fill too little of its bucket
            assert fits[0] > g.prefill_loose_max and n < g.prefill_min_fill * fits[0], n
        else:
            assert b == fits[0], n
    assert g.prefill_bucket(100, 2048) == 128 and g.prefill_bucket(16, 2048) == 16 and g.prefill_bucket(17, 2048) == 32
    assert g.prefill_bucket(2048, 2048) == 2048 and g.prefill_bucket(1900, 2048) == 2048
    assert g.prefill_bucket(1100, 2048) is None  # 1100 of 1536: 72% full, the padding would cost device time
    assert g.prefill_bucket(300, 256) is None and g.prefill_bucket(200, 256) == 256  # max_tokens caps the bucket
    assert g.prefill_bucket(2049, 4096) is None  # beyond the largest bucket
    assert GraphTuning(prefill_max_tokens=512).prefill_bucket(600) is None
    with pytest.raises(ValueError, match="prefill_max_tokens"):
        GraphTuning(prefill_max_tokens=-1)
    with pytest.raises(ValueError, match="increasing"):
        GraphTuning(prefill_buckets=(64, 32))


def test_graphs_declined_by_tuning_and_setting(clean_settings: pytest.MonkeyPatch) -> None:
    import torch

    from exl3_core.bench.models import build_model, parse_shape
    from exl3_core.plan import ExecutionPlan

    model, cache = build_model(parse_shape("custom(64,128,1,4,2,300)"), device="cpu", dtype=torch.float32,
                               cache_tokens=256, page_size=64)
    base = Tuning.generic()
    no_prefill = dataclasses.replace(base, graphs=dataclasses.replace(base.graphs, prefill_max_tokens=0))
    assert "prefill graphs off" in (decline_reason(ExecutionPlan(model, no_prefill), cache, 4, "prefill") or "")
    assert "not CUDA" in (decline_reason(ExecutionPlan(model, no_prefill), cache, 4, "decode") or "")
    clean_settings.setenv("EXL3_CUDA_GRAPHS", "0")
    settings.reload()
    assert not Tuning.for_device("cpu").graphs.enabled
    assert "CUDA graphs off" in (decline_reason(ExecutionPlan(model), cache, 4, "decode") or "")


def test_cpu_generator_runs_prefill_eagerly(clean_settings: pytest.MonkeyPatch) -> None:
    import torch

    from exl3_core.bench.models import bench_plugins, build_model, parse_shape
    from exl3_core.generator import Generator, Job

    model, cache = build_model(parse_shape("custom(64,128,2,4,2,300)"), bpw=4.0, head_bits=6, device="cpu",
                               cache_tokens=512, page_size=64, plugins=bench_plugins())
    try:
        gen = Generator(model, cache, None, max_batch_size=2, max_seq_len=256)
        assert "not CUDA" in (decline_reason(gen.plan, cache, gen.table_width, "prefill") or "")
        assert gen.prefill_graphs is None and gen.graphs is None
        job = Job(torch.arange(1, 40).tolist(), max_new_tokens=3, stop_at_eos=False)
        gen.enqueue(job)
        n = 0
        while gen.num_remaining():
            n += sum(len(r["token_ids"]) for r in gen.iterate())
        assert n == 3
    finally:
        model.unload()


def test_mixed_steps_split_only_when_both_parts_replay(clean_settings: pytest.MonkeyPatch) -> None:
    """The generator's split of a mixed step (decode rows + a prefill chunk) into two graph replays:
    only when the rows fit a decode bucket and the chunk has a prefill bucket (stub runners here)."""
    from types import SimpleNamespace

    from exl3_core.bench.models import bench_plugins, build_model, parse_shape
    from exl3_core.generator import Generator, Job
    from exl3_core.generator.batching import Chunk

    model, cache = build_model(parse_shape("custom(64,128,2,4,2,300)"), bpw=4.0, head_bits=6, device="cpu",
                               cache_tokens=512, page_size=64, plugins=bench_plugins())
    try:
        gen = Generator(model, cache, None, max_batch_size=4, max_seq_len=256)

        def row(n: int) -> tuple[Job, Chunk]:
            j = Job(list(range(1, n + 1)), max_new_tokens=4)
            j.cached = n - 1  # prompt done: the next chunk is one decode token
            return j, Chunk([n], n - 1, [0], True)

        def chunk(n: int) -> tuple[Job, Chunk]:
            j = Job(list(range(1, n + 1)), max_new_tokens=4)
            return j, Chunk(list(range(1, n + 1)), 0, [1], True)

        d1, d2, d3, c10, c20, c12 = row(5), row(6), row(7), chunk(10), chunk(20), chunk(12)
        assert gen._graph_parts([d1, c10], False) == [[d1, c10]]  # on CPU there are no graph runners
        gen.graphs = SimpleNamespace(max_bucket=2)
        gen.prefill_graphs = SimpleNamespace(bucket=lambda n, past, pages: 16 if n <= 16 else None)
        assert gen._graph_parts([d1, c10], False) == [[d1], [c10]]
        assert gen._graph_parts([d1, d2, c10], False) == [[d1, d2], [c10]]
        assert gen._graph_parts([d1, d2], True) == [[d1, d2]]  # pure decode: one step
        assert gen._graph_parts([c10], False) == [[c10]]  # a lone chunk: one step
        assert gen._graph_parts([d1, c20], False) == [[d1, c20]]  # the chunk has no bucket
        assert gen._graph_parts([d1, d2, d3, c10], False) == [[d1, d2, d3, c10]]  # rows beyond the decode bucket
        assert gen._graph_parts([d1, c10, c12], False) == [[d1, c10, c12]]  # two chunks
        gen.prefill_graphs = None
        assert gen._graph_parts([d1, c10], False) == [[d1, c10]]
    finally:
        model.unload()
