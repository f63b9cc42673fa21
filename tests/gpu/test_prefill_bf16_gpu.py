"""On CUDA, a fresh prompt's prefill runs with bf16 activations and bf16 GEMM operands (the execution
plan's ``DecoderExecutor._bf16``, ``FusionTuning.prefill_bf16``): every rebuilt-W GEMM sees bf16, the
logits and the cache (stored in fp16) stay within bf16's rounding of the fp16 forward's, the decode
steps after it run as before, and the graphed prefill equals the eager one. The CPU side is
tests/core/test_prefill_bf16.py."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.bench.models import bench_plugins, build_model, parse_shape
from exl3_core.generator.graphs import PrefillGraphs
from exl3_core.plan import ExecutionPlan
from exl3_core.quant.exl3 import linear as exl3_linear
from exl3_core.tuning import Tuning

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
    cache.free()


def _plan(model, kernels, bf16: bool) -> ExecutionPlan:
    """The model's plan with the bf16 prefill on or off in its tuning; rebuilt-W GEMMs through ``kernels``."""
    base = Tuning.for_device(model.device)
    tuning = dataclasses.replace(base, fusion=dataclasses.replace(base.fusion, prefill_bf16=bf16))
    plan = ExecutionPlan(model, tuning, kernels)
    assert plan.executor is not None and (plan.executor.bf16_why == []) is bf16, plan.executor.bf16_why
    return plan


def _prefill(plan: ExecutionPlan, cache, ids: list[int], pages: list[int], prefix: int = 0) -> torch.Tensor:
    meta = BatchMeta.from_lists([ids], [prefix], device="cuda", page_table=torch.tensor([pages], dtype=torch.int32),
                                page_size=PAGE, logits_indices=torch.tensor([len(ids) - 1], device="cuda"))
    return plan.forward(meta, cache).clone()


def _kv(cache, pages: list[int], n: int) -> list[torch.Tensor]:
    idx = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(n)], device="cuda")
    return [t.reshape(-1, *t.shape[2:]).index_select(0, idx).clone()
            for layer in cache.layers for t in layer.attn_tensors()]


class GemmDtypes:
    """The operand dtype of every rebuilt-W GEMM of the plans built with :meth:`plan`: the grouped ones
    (q/k/v, gate/up: the plan's kernels) and the single linears' from 65 rows (o_proj, down: their own
    forward, ``linear.exl3_matmul``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, counting_kernels: type) -> None:
        self.kernels = counting_kernels()
        self.seen: list[torch.dtype] = self.kernels.rebuild_dtypes  # the grouped GEMMs append here
        single = exl3_linear.exl3_matmul

        def spy_single(x: torch.Tensor, layer: exl3_linear.EXL3Linear) -> torch.Tensor:
            y = single(x, layer)
            if x.numel() // x.shape[-1] >= exl3_linear.REBUILD_MIN_ROWS:
                self.seen.append(x.dtype)
                assert y.dtype == x.dtype
            return y
        monkeypatch.setattr(exl3_linear, "exl3_matmul", spy_single)

    def plan(self, model, bf16: bool) -> ExecutionPlan:
        return _plan(model, self.kernels, bf16)


@pytest.fixture
def gemm_dtypes(monkeypatch: pytest.MonkeyPatch, counting_kernels: type) -> Iterator[GemmDtypes]:
    yield GemmDtypes(monkeypatch, counting_kernels)


def test_fresh_prefill_runs_in_bf16_close_to_fp16(model_cache, gemm_dtypes: GemmDtypes) -> None:
    model, cache = model_cache
    n = 300
    ids = torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(3)).tolist()
    pages = cache.allocator.allocate(-(-n // PAGE))
    try:
        seen = gemm_dtypes.seen
        ref = _prefill(gemm_dtypes.plan(model, False), cache, ids, pages)
        kv_ref = _kv(cache, pages, n)
        assert seen and set(seen) == {torch.float16}
        seen.clear()
        got = _prefill(gemm_dtypes.plan(model, True), cache, ids, pages)
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


def test_prefix_chunk_and_short_prompt_stay_fp16(model_cache, gemm_dtypes: GemmDtypes) -> None:
    """A chunk after cached tokens attends to fp16 keys through the page table, and a prompt below 65
    tokens runs the on-the-fly GEMM: both keep fp16."""
    model, cache = model_cache
    plan = gemm_dtypes.plan(model, True)
    pages = cache.allocator.allocate(4)
    try:
        g = torch.Generator().manual_seed(4)
        first = torch.randint(0, 2000, (128,), generator=g).tolist()
        _prefill(plan, cache, first, pages)
        seen = gemm_dtypes.seen
        assert seen and set(seen) == {torch.bfloat16}  # the fresh 128-token prompt
        seen.clear()
        _prefill(plan, cache, torch.randint(0, 2000, (100,), generator=g).tolist(), pages, prefix=128)
        assert seen and set(seen) == {torch.float16}
        seen.clear()
        _prefill(plan, cache, first[:40], pages)
        assert seen == []  # 40 rows: no rebuilt W at all
    finally:
        cache.allocator.release(pages)


def test_graph_prefill_in_bf16_equals_eager(model_cache, counting_kernels: type) -> None:
    model, cache = model_cache
    kernels = counting_kernels()
    plan = _plan(model, kernels, True)
    n = 500  # bucket 512: the graph runs 512 rows, the eager forward 500
    ids = torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(5)).tolist()
    pages = cache.allocator.allocate(-(-n // PAGE))
    try:
        ref = _prefill(plan, cache, ids, pages)
        assert set(kernels.rebuild_dtypes) == {torch.bfloat16}
        kv_ref = _kv(cache, pages, n)
        graphs = PrefillGraphs.create(plan, cache, 16, 2048)
        assert graphs is not None
        got = graphs.run(ids, pages).float().clone()
        assert _rel(got, ref) < TOL
        for a, b in zip(_kv(cache, pages, n), kv_ref):
            assert _rel(a, b) < TOL
    finally:
        cache.allocator.release(pages)
