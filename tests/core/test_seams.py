"""The declared seams of the execution plan, each with a toy implementation plugged through the *fused*
forms and checked against the reference forward:

* cache storage: a layer type storing keys and values in another dtype and layout;
* linear adapters: an additive side computation on a linear;
* sharding: tensor-parallel shards of attention and MLP (one rank, and two ranks in one process);
* multi-token decode: a decode step carrying k tokens per sequence.

On CPU the fused forms run with the Triton kernels in the interpreter and the EXL3 launches emulated
(:class:`exl3_core.testing.kernels.EmulatedKernels`); tests/gpu/test_seams_gpu.py runs them with the
compiled kernels and CUDA graphs.
"""
from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from exl3_core import ops
from exl3_core.archkit.batch import BatchMeta
from exl3_core.bench.models import bench_plugins, build_model, parse_shape
from exl3_core.cache import Cache
from exl3_core.nn.adapters import attach_adapter, detach_adapter
from exl3_core.nn.module import Communicator
from exl3_core.nn.shard import head_shard
from exl3_core.plan import ExecutionPlan
from exl3_core.plugins import load_plugins
from exl3_core.testing.kernels import EmulatedKernels
from exl3_core.testing.toy_cache import HeadMajorLayer, toy_cache_plugin
from exl3_core.tuning import Tuning

pytest.importorskip("triton")  # the interpreter runs the Triton half of the fused forms

PAGE = 16
TOL = {"rtol": 2e-2, "atol": 2e-2}  # fp16 kernels against the fp16 reference: rounding only


@pytest.fixture
def fused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused path for CPU tensors (what CUDA would say); the Triton interpreter runs the kernels."""
    monkeypatch.setattr(ops, "fused_enabled", lambda t: True)


def _model(shape: str = "custom(256,512,2,4,2,300)", plugins=None, seed: int = 3):
    model, _ = build_model(parse_shape(shape), device="cpu", dtype=torch.float16, seed=seed,
                           plugins=plugins or bench_plugins())
    return model


def _steps(model, plan_or_ref, cache, prompts: list[list[int]], decode: int) -> list[torch.Tensor]:
    """Logits of a prefill of ``prompts`` (one chunk, the last rows) and then ``decode`` single-token steps
    feeding fixed ids: the same token stream for every forward under test."""
    out = []
    pages = [cache.allocator.allocate(4) for _ in prompts]
    table = torch.tensor(pages, dtype=torch.int32)
    past = [0] * len(prompts)
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    meta = BatchMeta.from_lists(prompts, past, page_table=table, page_size=PAGE, logits_indices=ends)
    out.append(plan_or_ref(meta, cache))
    past = [len(p) for p in prompts]
    for step in range(decode):
        toks = [[(7 * step + 11 * b) % 300] for b in range(len(prompts))]
        out.append(plan_or_ref(BatchMeta.from_lists(toks, past, page_table=table, page_size=PAGE), cache))
        past = [p + 1 for p in past]
    return out


def _reference(model):
    def run(meta: BatchMeta, cache: Cache) -> torch.Tensor:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(ops, "fused_enabled", lambda t: False)
            return model.forward_batch(meta, cache)
    return run


def _matches_reference(model, forward, prompts: list[list[int]], decode: int,
                       cache_tokens: int | None = None) -> list[torch.Tensor]:
    """``forward``'s logits over :func:`_steps` on a fresh fp16 cache (4 pages a prompt unless ``cache_tokens``),
    checked within fp16 rounding of the reference forward's on another; returns them."""
    tokens = cache_tokens or 4 * len(prompts) * PAGE
    got = _steps(model, forward, Cache(model, tokens, page_size=PAGE), prompts, decode)
    ref = _steps(model, _reference(model), Cache(model, tokens, page_size=PAGE), prompts, decode)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TOL)
    return got


PROMPTS = [list(range(5, 25)), list(range(40, 53))]


# -- cache storage -------------------------------------------------------------------------------------------
def test_cache_storage_seam(fused: None) -> None:
    import sys

    plugins = load_plugins(extra=[sys.modules["exl3_core.bench.models"], toy_cache_plugin()])
    model = _model(plugins=plugins)
    kernels = EmulatedKernels()
    plan = ExecutionPlan(model, kernels=kernels)
    toy = Cache(model, 12 * PAGE, variant="toy", page_size=PAGE, plugins=plugins)
    plain = Cache(model, 12 * PAGE, page_size=PAGE, plugins=plugins)
    assert isinstance(toy.layers[0], HeadMajorLayer) and toy.layers[0].k.dtype == torch.float32
    assert toy.bytes_for(torch.float16) == toy.storage_size() == 2 * plain.storage_size()
    got = _steps(model, plan.forward, toy, PROMPTS, 3)
    ref = _steps(model, _reference(model), plain, PROMPTS, 3)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TOL)
    # the fused decode steps ran (deferred norms, residual launches) but stored through the toy layer
    assert kernels.calls.get("residual", 0) >= 2 * 3 and kernels.calls.get("group_ex_epilogue", 0) == 0
    assert toy.layers[0].writes == 4
    # with the plain fp16 cache the same plan stores keys and values in the q/k/v launch's epilogue
    kernels.calls.clear()
    plain2 = Cache(model, 12 * PAGE, page_size=PAGE, plugins=plugins)
    got2 = _steps(model, plan.forward, plain2, PROMPTS, 3)
    assert kernels.calls.get("group_ex_epilogue", 0) == 2 * 3
    for a, b in zip(got2, ref):
        torch.testing.assert_close(a, b, **TOL)
    text = "\n".join(plan.cache_report(toy))
    assert "kv/toy" in text and "no in-kernel write target" in text


# -- linear adapters ------------------------------------------------------------------------------------------
class ToyAdapter:
    """``delta(x) = (x A) B``: a low-rank additive side computation (LoRA's shape)."""

    def __init__(self, name: str, n_in: int, n_out: int, rank: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.name = name
        self.a = torch.randn(n_in, rank, generator=g) * 0.2
        self.b = torch.randn(rank, n_out, generator=g) * 0.2
        self.calls = 0

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return (x.float() @ self.a) @ self.b


def test_linear_adapter_seam(fused: None) -> None:
    model = _model()
    block = model.layers[0]
    adapters = []
    for i, lin in enumerate((block.attn.q_proj, block.attn.k_proj, block.attn.v_proj, block.attn.o_proj,
                             block.mlp.gate, block.mlp.up, block.mlp.down)):
        a = ToyAdapter("toy", lin.in_features, lin.out_features, 4, seed=i)
        attach_adapter(lin, a)
        adapters.append(a)
    with pytest.raises(ValueError, match="already has an adapter named 'toy'"):
        attach_adapter(block.mlp.down, ToyAdapter("toy", 1, 1, 1, 0))
    kernels = EmulatedKernels()
    plan = ExecutionPlan(model, kernels=kernels)
    assert plan.executor is not None
    runner = plan.executor.blocks[0].attn_runner
    assert runner is not None and "an adapter's delta must join q/k/v before RoPE" in runner.epilogue_why
    assert not plan.executor.blocks[1].attn_runner.epilogue_why  # type: ignore[union-attr]
    got = _matches_reference(model, plan.forward, PROMPTS, 3, cache_tokens=12 * PAGE)
    assert all(a.calls >= 8 for a in adapters), "every adapter ran in both forwards"
    assert kernels.calls.get("residual_gated", 0) >= 2 * 3, "down kept its fused launch with the adapter on it"
    # the adapters change the result (the test would pass vacuously otherwise)
    for lin in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj, block.attn.o_proj, block.mlp.gate,
                block.mlp.up, block.mlp.down):
        detach_adapter(lin, "toy")
    bare = _steps(model, ExecutionPlan(model, kernels=kernels).forward, Cache(model, 12 * PAGE, page_size=PAGE),
                  PROMPTS, 3)
    assert not torch.allclose(bare[-1], got[-1], **TOL)


# -- sharding ----------------------------------------------------------------------------------------------------
SHARD_SHAPE = "custom(512,1024,2,4,2,300)"  # head dim 128: heads and MLP cut at 128-feature blocks


def _shard(model, rank: int, world: int) -> None:
    for block in model.layers:
        a = block.attn
        a.apply_shard(head_shard(a.num_heads, a.num_kv_heads, rank, world))
        block.mlp.apply_shard(rank, world)


def test_one_rank_shard_equals_unsharded(fused: None) -> None:
    model = _model(SHARD_SHAPE)
    ref = _steps(model, _reference(model), Cache(model, 12 * PAGE, page_size=PAGE), PROMPTS, 2)
    _shard(model, 0, 1)
    assert all(b.attn.shard is not None and b.mlp.down.shard.kind == "row" for b in model.layers)
    kernels = EmulatedKernels()
    got = _steps(model, ExecutionPlan(model, kernels=kernels).forward, Cache(model, 12 * PAGE, page_size=PAGE),
                 PROMPTS, 2)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TOL)
    assert kernels.calls.get("residual", 0) > 0, "one rank reduces nothing: the residual launches stay"


class ThreadComm:
    """All-reduce between ranks that are threads of one process (a test's stand-in for a process group)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.bufs: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=60)
        self.calls = 0

    def rank_view(self, rank: int) -> Communicator:
        comm = self

        class View:
            def __init__(self) -> None:
                self.rank, self.world = rank, comm.world

            def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
                comm.bufs[rank] = t
                comm.barrier.wait()
                total = sum(b.float() for b in comm.bufs if b is not None)
                comm.barrier.wait()
                if rank == 0:
                    comm.calls += 1
                return total.to(t.dtype)  # type: ignore[union-attr]

        return View()


def test_two_rank_shards_sum_to_the_whole() -> None:
    """Two ranks in threads, each with half the heads and half the MLP; the all-reduces after o_proj and
    down give every rank the unsharded logits. The residual launches decline (reduce first, then add).
    (Torch ops here: Triton's interpreter is not thread-safe; the fused forms of a shard are the one-rank
    test's.)"""
    base = _model(SHARD_SHAPE)
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ops, "fused_enabled", lambda t: False)
        ref = base.forward_batch(BatchMeta.full(ids))
    ranks = [_model(SHARD_SHAPE) for _ in range(2)]  # the same seed: the same weights
    for r, model in enumerate(ranks):
        _shard(model, r, 2)
    comm = ThreadComm(2)
    results: list[torch.Tensor | None] = [None, None]
    errors: list[BaseException] = []
    plans = [ExecutionPlan(model, kernels=EmulatedKernels()) for model in ranks]
    assert all("row-parallel shard" in " ".join(p.executor.blocks[0].attn_runner.out.why) for p in plans)  # type: ignore[union-attr]

    def run(r: int) -> None:
        try:
            results[r] = plans[r].forward(BatchMeta.full(ids), comm=comm.rank_view(r))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            comm.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert comm.calls == 2 * len(base.layers), "one all-reduce after o_proj and one after down per layer"
    for out in results:
        assert out is not None
        torch.testing.assert_close(out, ref, **TOL)
    q0 = ranks[0].layers[0].attn.q_proj
    assert q0.out_features == 256 and q0.shard.start == 0 and ranks[1].layers[0].attn.q_proj.shard.start == 256


def test_shard_errors_name_the_counts() -> None:
    with pytest.raises(ValueError, match="num_attention_heads"):
        head_shard(6, 2, 0, 4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        head_shard(12, 3, 0, 2)
    s = head_shard(8, 2, 3, 4)  # more ranks than KV heads: each rank holds its query heads' KV head
    assert (s.q_start, s.q_stop, s.kv_start, s.kv_stop) == (6, 8, 1, 2)
    model = _model("custom(128,384,1,4,2,300)")
    with pytest.raises(ValueError, match="3 blocks of 128, fewer than tensor_parallel_size=4"):
        model.layers[0].mlp.apply_shard(0, 4)  # 384 EXL3 features are three 128-feature blocks: one rank has none
    mlp = model.layers[0].mlp
    mlp.apply_shard(1, 2)  # three blocks over two ranks: 256 and 128 features
    assert (mlp.gate.shard.start, mlp.gate.shard.stop, mlp.down.in_features) == (256, 384, 128)


# -- multi-token decode ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [2, 3])
def test_k_token_step_equals_k_single_steps(fused: None, k: int) -> None:
    model = _model()
    kernels = EmulatedKernels()
    plan = ExecutionPlan(model, kernels=kernels)
    prompts = [list(range(5, 25)), list(range(40, 53))]
    new = [[(5 * i + 17 * b) % 300 for i in range(k)] for b in range(len(prompts))]

    def prefilled() -> tuple[Cache, torch.Tensor, list[int]]:
        cache = Cache(model, 12 * PAGE, page_size=PAGE)
        pages = [cache.allocator.allocate(4) for _ in prompts]
        table = torch.tensor(pages, dtype=torch.int32)
        ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        plan.forward(BatchMeta.from_lists(prompts, [0, 0], page_table=table, page_size=PAGE, logits_indices=ends),
                     cache)
        return cache, table, [len(p) for p in prompts]

    cache, table, past = prefilled()
    meta = BatchMeta.from_lists(new, past, page_table=table, page_size=PAGE, phase="decode")
    assert meta.phase == "decode" and meta.q_per_seq == k and meta.call_shape().q_per_seq == k
    multi = plan.forward(meta, cache).view(len(prompts), k, -1)

    cache1, table1, past1 = prefilled()
    singles = []
    for i in range(k):
        step = BatchMeta.from_lists([[t[i]] for t in new], [p + i for p in past1], page_table=table1, page_size=PAGE)
        singles.append(plan.forward(step, cache1))
    single = torch.stack(singles, dim=1)
    torch.testing.assert_close(multi, single, **TOL)
    with pytest.raises(ValueError, match="same number of new tokens"):
        BatchMeta.from_lists([[1, 2], [3]], [4, 4], page_table=table, page_size=PAGE, phase="decode")


def test_build_batch_pads_k_token_decode_steps() -> None:
    """The generator's host-side builder for a decode step of k tokens per sequence: fixed shapes for a
    bucket (padded sequences write the scratch page), every row's logits, each chunk's last row reported."""
    from exl3_core.generator.batching import Chunk, build_batch

    chunks = [Chunk([5, 6, 7], 10, [2], True), Chunk([8, 9, 1], 3, [4], False), Chunk([2, 2, 2], 0, [6], True)]
    meta, rows = build_batch(chunks, page_size=PAGE, table_width=2, scratch_page=9, device=torch.device("cpu"),
                             decode=True)
    assert meta.batch_size == 4 and meta.q_per_seq == 3 and meta.input_ids.shape == (12,)
    assert meta.cu_seqlens_q.tolist() == [0, 3, 6, 9, 12] and meta.seq_lens_k.tolist() == [13, 6, 3, 3]
    assert meta.positions.tolist()[:9] == [10, 11, 12, 3, 4, 5, 0, 1, 2]
    assert meta.slot_mapping.tolist()[:3] == [2 * PAGE + 10, 2 * PAGE + 11, 2 * PAGE + 12]
    assert meta.slot_mapping.tolist()[9:] == [9 * PAGE] * 3 and meta.page_table[3].tolist() == [9, 9]
    assert rows == [2, 8] and meta.logits_indices is None and meta.max_seqlen_q == 3
    with pytest.raises(ValueError, match="same number of tokens"):
        build_batch([Chunk([1], 0, [0], True), Chunk([1, 2], 0, [1], True)], page_size=PAGE, table_width=2,
                    scratch_page=9, device=torch.device("cpu"), decode=True)


def test_decode_steps_of_9_to_16_rows_take_the_one_launch_forms(fused: None) -> None:
    """A decode step of 9-16 sequences runs the one-launch forms (the kernels' m16 loop: deferred norms, residual
    launches) as a step of up to 8 does, with the reference's logits within fp16 rounding."""
    n = int(torch.randint(9, 17, ()))
    model = _model()
    kernels = EmulatedKernels()
    plan = ExecutionPlan(model, kernels=kernels)
    assert plan.executor is not None and plan.executor.max_rows >= n and not plan.executor.deferred_why
    _matches_reference(model, plan.forward, [list(range(3 + b, 9 + b)) for b in range(n)], 2)
    # o_proj and down of both layers in both decode steps (the prefill's rows take the chain form)
    assert kernels.calls.get("residual", 0) + kernels.calls.get("residual_gated", 0) == 2 * 2 * len(model.layers)


def test_models_wider_than_the_rule_keep_8_one_launch_rows(fused: None) -> None:
    """A model whose residual stream is wider than ``fused_linear_wide_width`` takes the one-launch forms up to
    ``fused_linear_wide_max_rows`` rows: a decode step of 9-16 sequences runs no residual launch there, and its
    logits still equal the reference's."""
    n = int(torch.randint(9, 17, ()))
    model = _model()
    hidden = model.arch_config.hidden_size
    base = Tuning.for_device(torch.device("cpu"))
    narrow = replace(base, kernels=replace(base.kernels, fused_linear_wide_width=hidden))
    wide = replace(base, kernels=replace(base.kernels, fused_linear_wide_width=hidden - 1))
    narrow_plan = ExecutionPlan(model, tuning=narrow, kernels=EmulatedKernels()).executor
    assert narrow_plan.max_rows == 16
    assert "yes one-launch linears from 9 rows (the kernel's m16 loop): up to 16 rows" in \
        [d.line() for d in narrow_plan.report()[0].decisions]
    kernels = EmulatedKernels()
    plan = ExecutionPlan(model, tuning=wide, kernels=kernels)
    assert plan.executor is not None and plan.executor.max_rows == 8
    lines = [d.line() for d in plan.executor.report()[0].decisions]
    assert "1-8 rows" in lines[0]
    assert f"no  one-launch linears from 9 rows (the kernel's m16 loop): residual stream {hidden} wide" in lines[2]
    _matches_reference(model, plan.forward, [list(range(3 + b, 9 + b)) for b in range(n)], 2)
    assert kernels.calls.get("residual", 0) + kernels.calls.get("residual_gated", 0) == 0
