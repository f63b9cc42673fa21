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
