"""On CUDA, a fresh prompt's prefill runs with bf16 activations and bf16 GEMM operands
(``StandardDecoder._prefill_dtype``, ``EXL3_PREFILL_BF16``): every rebuilt-W GEMM sees bf16, the
logits and the cache (stored in fp16) stay within bf16's rounding of the fp16 forward's, the decode
steps after it run as before, and the graphed prefill equals the eager one. The CPU side is
tests/core/test_prefill_bf16.py."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from exl3_core import settings
from exl3_core.archkit.batch import BatchMeta
from exl3_core.bench.models import bench_plugins, build_model, parse_shape
from exl3_core.generator.graphs import PrefillGraphs
from exl3_core.quant.exl3 import linear as exl3_linear

SHAPE = "custom(512,1024,3,8,2,2000)"
PAGE = 64
# bf16 keeps 8 significant bits to fp16's 11, so its rounding error is ~8x fp16's: on the CPU twin of this
# test (tests/core/test_prefill_bf16.py) the logits are 1.2e-2 from the fp16 forward's. A wrong dtype path
# (a cast in the wrong place, W rebuilt wrong) is off by O(1)
TOL = 3e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def model_cache() -> Iterator[tuple]:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, cache = build_model(parse_shape(SHAPE), bpw=4.0, head_bits=6, device="cuda", cache_tokens=4096,
                               page_size=PAGE, plugins=bench_plugins())
    yield model, cache
    model.unload()


@pytest.fixture
def bf16_setting(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    def set_flag(on: bool) -> None:
        monkeypatch.setenv("EXL3_PREFILL_BF16", "1" if on else "0")
        settings.reload()
    yield set_flag
    monkeypatch.delenv("EXL3_PREFILL_BF16", raising=False)
    settings.reload()


def _prefill(model, cache, ids: list[int], pages: list[int], prefix: int = 0) -> torch.Tensor:
    meta = BatchMeta.from_lists([ids], [prefix], device="cuda", page_table=torch.tensor([pages], dtype=torch.int32),
                                page_size=PAGE, logits_indices=torch.tensor([len(ids) - 1], device="cuda"))
    return model.forward_batch(meta, cache).clone()


def _kv(cache, pages: list[int], n: int) -> list[torch.Tensor]:
    idx = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(n)], device="cuda")
    return [t.reshape(-1, *t.shape[2:]).index_select(0, idx).clone()
            for layer in cache.layers for t in layer.attn_tensors()]


def _gemm_dtypes(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The operand dtype of every rebuilt-W GEMM from now on: the grouped ones (q/k/v, gate/up) and the
    single linears' from 65 rows (o_proj, down)."""
    seen: list[torch.dtype] = []
    group, single = exl3_linear.group_gemm, exl3_linear.exl3_matmul

    def spy_group(x2: torch.Tensor, lins: list) -> list[torch.Tensor]:
        seen.append(x2.dtype)
        ys = group(x2, lins)
        assert all(y.dtype == x2.dtype for y in ys)
        return ys

    def spy_single(x: torch.Tensor, layer) -> torch.Tensor:
        y = single(x, layer)
        if x.numel() // x.shape[-1] >= exl3_linear.GROUP_GEMM_MIN_ROWS:
            seen.append(x.dtype)
            assert y.dtype == x.dtype
        return y
    monkeypatch.setattr(exl3_linear, "group_gemm", spy_group)
    monkeypatch.setattr(exl3_linear, "exl3_matmul", spy_single)
    return seen


def test_fresh_prefill_runs_in_bf16_close_to_fp16(model_cache, bf16_setting, monkeypatch: pytest.MonkeyPatch) -> None:
    model, cache = model_cache
    n = 300
    ids = torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(3)).tolist()
    pages = cache.allocator.allocate(-(-n // PAGE))
    try:
        seen = _gemm_dtypes(monkeypatch)
        bf16_setting(False)
        ref = _prefill(model, cache, ids, pages)
        kv_ref = _kv(cache, pages, n)
        assert seen and set(seen) == {torch.float16}
        seen.clear()
        bf16_setting(True)
        got = _prefill(model, cache, ids, pages)
        kv = _kv(cache, pages, n)
        # 3 layers: q/k/v, o, gate/up, down each, but the last block's o, gate/up and down run on 1 row
        assert seen == [torch.bfloat16] * 9
        assert got.dtype == ref.dtype == torch.float32 and got.shape == (1, 2000)
        assert _rel(got, ref) < TOL, _rel(got, ref)
        assert got.argmax() == ref.argmax()
        for a, b in zip(kv, kv_ref):
            assert a.dtype == torch.float16  # the cache keeps its dtype
            assert _rel(a, b) < TOL
    finally:
        cache.allocator.release(pages)


def test_prefix_chunk_and_short_prompt_stay_fp16(model_cache, bf16_setting, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk after cached tokens attends to fp16 keys through the page table, and a prompt below 65
    tokens runs the on-the-fly GEMM: both keep fp16."""
    model, cache = model_cache
    bf16_setting(True)
    pages = cache.allocator.allocate(4)
    try:
        g = torch.Generator().manual_seed(4)
        first = torch.randint(0, 2000, (128,), generator=g).tolist()
        _prefill(model, cache, first, pages)
        seen = _gemm_dtypes(monkeypatch)
        _prefill(model, cache, torch.randint(0, 2000, (100,), generator=g).tolist(), pages, prefix=128)
        assert seen and set(seen) == {torch.float16}
        seen.clear()
        _prefill(model, cache, first[:40], pages)
        assert seen == []  # 40 rows: no rebuilt W at all
    finally:
        cache.allocator.release(pages)


def test_graph_prefill_in_bf16_equals_eager(model_cache, bf16_setting) -> None:
    model, cache = model_cache
    bf16_setting(True)
    n = 500  # bucket 512: the graph runs 512 rows, the eager forward 500
    ids = torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(5)).tolist()
    pages = cache.allocator.allocate(-(-n // PAGE))
    try:
        ref = _prefill(model, cache, ids, pages)
        kv_ref = _kv(cache, pages, n)
        graphs = PrefillGraphs.create(model, cache, 16, 2048)
        assert graphs is not None
        got = graphs.run(ids, pages).float().clone()
        assert _rel(got, ref) < TOL
        for a, b in zip(_kv(cache, pages, n), kv_ref):
            assert _rel(a, b) < TOL
    finally:
        cache.allocator.release(pages)
