"""The execution plan's seams on the GPU, through the compiled kernels and CUDA graphs: a toy cache layer
type, an additive adapter, a one-rank shard and a k-token decode step each give the reference result.
(The same seams on CPU, through emulated kernels: tests/core/test_seams.py.)"""
from __future__ import annotations

import sys

import pytest
import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.bench.models import build_model, parse_shape
from exl3_core.cache import Cache
from exl3_core.generator.batching import Chunk, build_batch, meta_to_device
from exl3_core.generator.graphs import DecodeGraphs
from exl3_core.nn.adapters import attach_adapter
from exl3_core.nn.shard import head_shard
from exl3_core.plan import ExecutionPlan
from exl3_core.plugins import load_plugins
from exl3_core.testing.toy_cache import HeadMajorLayer, toy_cache_plugin

SHAPE = "custom(512,1024,2,4,2,2000)"  # head dim 128: k/v widths and shards at 128-feature blocks
PAGE = 64
TOL = {"rtol": 3e-2, "atol": 3e-2}


@pytest.fixture(scope="module")
def plugins():  # noqa: ANN201
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return load_plugins(extra=[sys.modules["exl3_core.bench.models"], toy_cache_plugin()])


def _model(plugins, shape: str = SHAPE):  # noqa: ANN001, ANN202
    model, _ = build_model(parse_shape(shape), device="cuda", dtype=torch.float16, seed=4, plugins=plugins)
    return model


def _reference(model, meta: BatchMeta, cache: Cache) -> torch.Tensor:  # noqa: ANN001
    """The model's own forward, fp32 on the CPU path's maths but on the GPU's tensors."""
    return model.forward_batch(meta, cache)


def _decode_steps(run, cache: Cache, prompts: list[list[int]], steps: int, k: int = 1) -> list[torch.Tensor]:  # noqa: ANN001
    """Prefill, then ``steps`` decode steps of ``k`` fixed tokens per sequence, through ``run(meta, cache)``."""
    pages = [cache.allocator.allocate(4) for _ in prompts]
    W = 4
    out = []
    past = [0] * len(prompts)
    chunks = [Chunk(p, 0, pg, True) for p, pg in zip(prompts, pages)]
    meta, _ = build_batch(chunks, page_size=PAGE, table_width=W, scratch_page=cache.scratch_page,
                          device=torch.device("cuda"), decode=False)
    out.append(run(meta, cache))
    past = [len(p) for p in prompts]
    for s in range(steps):
        toks = [[(13 * s + 7 * b + i) % 2000 for i in range(k)] for b in range(len(prompts))]
        chunks = [Chunk(t, p, pg, True) for t, p, pg in zip(toks, past, pages)]
        meta, _ = build_batch(chunks, page_size=PAGE, table_width=W, scratch_page=cache.scratch_page,
                              device=torch.device("cpu"), decode=True)
        out.append(run(meta, cache)[: len(prompts) * k].float().clone())
        past = [p + k for p in past]
    return out


def _graphed(plan: ExecutionPlan, cache: Cache):  # noqa: ANN202
    graphs = DecodeGraphs.create(plan, cache, 4)
    assert graphs is not None, "decode graphs declined on CUDA"

    def run(meta: BatchMeta, c: Cache) -> torch.Tensor:
        if meta.phase == "decode" and graphs.accepts(meta):
            logits, _ = graphs.run(meta)
            return logits
        return plan.forward(meta if meta.input_ids.is_cuda else meta_to_device(meta, plan.device), c)
    return run, graphs


def _eager_reference(model):  # noqa: ANN001, ANN202
    def run(meta: BatchMeta, c: Cache) -> torch.Tensor:
        return _reference(model, meta if meta.input_ids.is_cuda else meta_to_device(meta, model.device), c)
    return run


PROMPTS = [list(range(5, 45)), list(range(100, 121))]


def test_toy_cache_through_graphs(plugins) -> None:  # noqa: ANN001
    model = _model(plugins)
    plan = ExecutionPlan(model)
    toy = Cache(model, 16 * PAGE, variant="toy", page_size=PAGE, plugins=plugins)
    assert isinstance(toy.layers[0], HeadMajorLayer)
    run, graphs = _graphed(plan, toy)
    got = _decode_steps(run, toy, PROMPTS, 4)
    ref = _decode_steps(_eager_reference(model), Cache(model, 16 * PAGE, page_size=PAGE, plugins=plugins), PROMPTS, 4)
    assert graphs.replays == 4
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), **TOL)


def test_adapter_through_graphs(plugins) -> None:  # noqa: ANN001
    model = _model(plugins)

    class Toy:
        def __init__(self, n_in: int, n_out: int, seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            self.name = "toy"
            self.a = (torch.randn(n_in, 4, generator=g) * 0.2).cuda()
            self.b = (torch.randn(4, n_out, generator=g) * 0.2).cuda()

        def delta(self, x: torch.Tensor) -> torch.Tensor:
            return (x.float() @ self.a) @ self.b

    blk = model.layers[0]
    for i, lin in enumerate((blk.attn.q_proj, blk.attn.k_proj, blk.attn.v_proj, blk.attn.o_proj, blk.mlp.gate,
                             blk.mlp.up, blk.mlp.down)):
        attach_adapter(lin, Toy(lin.in_features, lin.out_features, i))
    cache = Cache(model, 16 * PAGE, page_size=PAGE, plugins=plugins)
    run, _ = _graphed(ExecutionPlan(model), cache)
    got = _decode_steps(run, cache, PROMPTS, 3)
    ref = _decode_steps(_eager_reference(model), Cache(model, 16 * PAGE, page_size=PAGE, plugins=plugins), PROMPTS, 3)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), **TOL)


def test_one_rank_shard_through_graphs(plugins) -> None:  # noqa: ANN001
    model = _model(plugins)
    ref = _decode_steps(_eager_reference(model), Cache(model, 16 * PAGE, page_size=PAGE, plugins=plugins), PROMPTS, 3)
    for b in model.layers:
        b.attn.apply_shard(head_shard(b.attn.num_heads, b.attn.num_kv_heads, 0, 1))
        b.mlp.apply_shard(0, 1)
    cache = Cache(model, 16 * PAGE, page_size=PAGE, plugins=plugins)
    run, _ = _graphed(ExecutionPlan(model), cache)
    got = _decode_steps(run, cache, PROMPTS, 3)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), **TOL)


@pytest.mark.parametrize("k", [2, 4])
def test_k_token_step_through_graphs_equals_k_single_steps(plugins, k: int) -> None:  # noqa: ANN001
    model = _model(plugins)
    plan = ExecutionPlan(model)
    cache = Cache(model, 16 * PAGE, page_size=PAGE, plugins=plugins)
    run, graphs = _graphed(plan, cache)
    multi = _decode_steps(run, cache, PROMPTS, 2, k=k)
    assert graphs.replays == 2 and any(key[1] == k for key in graphs._graphs)
    single_cache = Cache(model, 16 * PAGE, page_size=PAGE, plugins=plugins)
    pages = [single_cache.allocator.allocate(4) for _ in PROMPTS]
    meta, _ = build_batch([Chunk(p, 0, pg, True) for p, pg in zip(PROMPTS, pages)], page_size=PAGE, table_width=4,
                          scratch_page=single_cache.scratch_page, device=torch.device("cuda"), decode=False)
    plan.forward(meta, single_cache)
    past = [len(p) for p in PROMPTS]
    for s in range(2):
        rows = []
        for i in range(k):
            toks = [[(13 * s + 7 * b + i) % 2000] for b in range(len(PROMPTS))]
            m, _ = build_batch([Chunk(t, p + i, pg, True) for t, p, pg in zip(toks, past, pages)], page_size=PAGE,
                               table_width=4, scratch_page=single_cache.scratch_page, device=torch.device("cuda"),
                               decode=True)
            rows.append(plan.forward(m, single_cache)[: len(PROMPTS)])
        single = torch.stack(rows, dim=1).reshape(len(PROMPTS) * k, -1)
        torch.testing.assert_close(multi[s + 1], single.float(), **TOL)
        past = [p + k for p in past]
