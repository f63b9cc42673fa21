"""Host-side rules of CUDA-graph decode and prefill: buckets, settings, when graphs are declined."""
from __future__ import annotations

import pytest

from exl3_core import settings
from exl3_core.generator.graphs import PREFILL_BUCKETS, PREFILL_LOOSE_MAX, PREFILL_MIN_FILL, decline_reason, \
    prefill_bucket


def test_prefill_bucket_is_the_smallest_that_holds_the_chunk() -> None:
    for n in range(1, 2049):
        b = prefill_bucket(n, 2048)
        fits = [x for x in PREFILL_BUCKETS if x >= n]
        if b is None:
            # declined only above the loose range, when the chunk would fill too little of its bucket
            assert fits[0] > PREFILL_LOOSE_MAX and n < PREFILL_MIN_FILL * fits[0], n
        else:
            assert b == fits[0], n
    assert prefill_bucket(100, 2048) == 128 and prefill_bucket(16, 2048) == 16 and prefill_bucket(17, 2048) == 32
    assert prefill_bucket(2048, 2048) == 2048 and prefill_bucket(1900, 2048) == 2048
    assert prefill_bucket(1100, 2048) is None  # 1100 of 1536: 72% full, the padding would cost device time
    assert prefill_bucket(300, 256) is None and prefill_bucket(200, 256) == 256  # max_tokens caps the bucket
    assert prefill_bucket(2049, 4096) is None  # beyond the largest bucket


def test_prefill_graph_setting(clean_settings: pytest.MonkeyPatch) -> None:
    assert settings.get().prefill_graph_max == 2048
    clean_settings.setenv("EXL3_PREFILL_GRAPH_MAX", "512")
    assert settings.reload().prefill_graph_max == 512
    clean_settings.setenv("EXL3_PREFILL_GRAPH_MAX", "0")
    settings.reload()
    assert decline_reason(object(), None, "prefill") == "disabled by EXL3_PREFILL_GRAPH_MAX=0"
    assert decline_reason(object(), None, "decode") != "disabled by EXL3_PREFILL_GRAPH_MAX=0"
    clean_settings.setenv("EXL3_CUDA_GRAPHS", "0")
    settings.reload()
    assert decline_reason(object(), None, "prefill") == "disabled by EXL3_CUDA_GRAPHS=0"
    for bad in ("-1", "lots"):
        clean_settings.setenv("EXL3_PREFILL_GRAPH_MAX", bad)
        with pytest.raises(ValueError, match="EXL3_PREFILL_GRAPH_MAX"):
            settings.reload()
    clean_settings.delenv("EXL3_PREFILL_GRAPH_MAX")
    settings.reload()


def test_cpu_generator_runs_prefill_eagerly(clean_settings: pytest.MonkeyPatch) -> None:
    import torch

    from exl3_core.bench.models import bench_plugins, build_model, parse_shape
    from exl3_core.generator import Generator, Job

    model, cache = build_model(parse_shape("custom(64,128,2,4,2,300)"), bpw=4.0, head_bits=6, device="cpu",
                               cache_tokens=512, page_size=64, plugins=bench_plugins())
    try:
        assert "not CUDA" in (decline_reason(model, cache, "prefill") or "")
        gen = Generator(model, cache, None, max_batch_size=2, max_seq_len=256)
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
