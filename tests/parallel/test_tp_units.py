"""The pieces of tensor parallelism that need no worker process: share arithmetic, uneven cuts (two ranks
as threads), the metadata's wire form, the rules' refusals, and ``tensor_parallel_size=1`` (the sharded
path in this process alone)."""
from __future__ import annotations

import itertools
import multiprocessing
import threading

import pytest
import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.bench.models import build_model, parse_shape
from exl3_core.cache import Cache
from exl3_core.cache.geometry import LayerGeometry
from exl3_core.generator.toy import ToyModel
from exl3_core.nn.linear import DenseLinear
from exl3_core.nn.module import Module
from exl3_core.nn.shard import block_split
from exl3_core.parallel import ParallelError, RankSharder
from exl3_core.parallel.comm import meta_header, pack_meta, unpack_meta
from exl3_core.parallel.protocol import PluginRecipe
from exl3_core.parallel.sharding import check_model
from exl3_core.plan import ExecutionPlan
from exl3_core.plugins import load_plugins


@pytest.mark.parametrize("n,world,g", [(512, 4, 128), (384, 2, 128), (300, 2, 128), (160, 3, 1), (768, 4, 128),
                                       (7, 7, 1)])
def test_block_split_covers_every_feature_once(n: int, world: int, g: int) -> None:
    shares = block_split(n, world, g)
    assert shares[0][0] == 0 and shares[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(shares))
    assert all(a % g == 0 and b > a for a, b in shares)
    sizes = [-(-(b - a) // g) for a, b in shares]  # blocks per rank, as even as they go
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_block_split_refuses_ranks_without_a_block() -> None:
    with pytest.raises(ValueError, match="300 vocabulary rows make only 3 blocks of 128, fewer than "
                                         "tensor_parallel_size=4"):
        block_split(300, 4, 128, "vocabulary rows")
    with pytest.raises(ValueError, match="3 experts are fewer than tensor_parallel_size=4"):
        block_split(3, 4, 1, "experts")


class _ThreadSum:
    """All-reduce between two ranks that are threads of this process."""

    def __init__(self) -> None:
        self.bufs: list[torch.Tensor | None] = [None, None]
        self.barrier = threading.Barrier(2, timeout=60)

    def view(self, rank: int) -> object:
        outer = self

        class View:
            world = 2

            def __init__(self) -> None:
                self.rank = rank

            def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
                outer.bufs[rank] = t
                outer.barrier.wait()
                total = sum(b for b in outer.bufs if b is not None)
                outer.barrier.wait()
                return total  # type: ignore[return-value]

        return View()


def test_uneven_cuts_add_up_to_the_whole() -> None:
    """Three 128-feature blocks of the MLP and of the vocabulary over two ranks (256 + 128, 256 + 44): the
    reductions give the whole hidden states and the vocabulary slices join into the whole logits."""
    shape = parse_shape("custom(128,384,2,4,2,300,128)")
    ref, _ = build_model(shape, device="cpu", dtype=torch.float32, seed=4)
    ids = torch.randint(0, 300, (1, 11), generator=torch.Generator().manual_seed(0))
    want = ref.forward(ids)[0]
    ranks = [build_model(shape, device="cpu", dtype=torch.float32, seed=4)[0] for _ in range(2)]
    for r, model in enumerate(ranks):
        for m in list(model.exl3_modules()):
            RankSharder(r, 2).shard_module(m)
    assert ranks[1].layers[0].mlp.down.in_features == 128 and ranks[1].head.vocab_range == (256, 300)
    comm, out, errors = _ThreadSum(), [None, None], []

    def run(r: int) -> None:
        try:
            plan = ExecutionPlan(ranks[r])
            out[r] = plan.executor.forward(BatchMeta.full(ids), None, None, comm.view(r))  # type: ignore[union-attr]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            comm.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    got = torch.cat([out[0], out[1]], dim=1)
    assert out[0].shape[1] == 256 and out[1].shape[1] == 44
    assert float((got - want).abs().max()) <= 1e-4


def test_metadata_survives_its_wire_form() -> None:
    table = torch.tensor([[3, 1, 4], [2, 0, 5]], dtype=torch.int32)
    metas = [BatchMeta.from_lists([[5, 6, 7], [8, 9]], [16, 3], page_table=table, page_size=16,
                                  logits_indices=torch.tensor([2, 4])),
             BatchMeta.from_lists([[1], [2]], [20, 7], page_table=table, page_size=16),
             BatchMeta.full(torch.arange(10).view(2, 5)),
             BatchMeta.from_lists([[1, 2]], [0], page_table=table[:1], page_size=16,
                                  logits_indices=torch.zeros(0, dtype=torch.int64))]
    for meta in metas:
        h = meta_header(meta)
        buf = pack_meta(meta, torch.device("cpu"))
        assert buf.dtype == torch.int64 and buf.numel() == h.numel
        back = unpack_meta(h, buf.clone())
        for f in ("input_ids", "positions", "cu_seqlens_q", "seq_lens_k", "page_table", "slot_mapping",
                  "logits_indices"):
            a, b = getattr(meta, f), getattr(back, f)
            assert (a is None) == (b is None), f
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(a, b), f
        assert (back.max_seqlen_q, back.max_seqlen_k, back.phase) == (meta.max_seqlen_q, meta.max_seqlen_k, meta.phase)


def test_a_module_with_linears_but_no_rule_is_refused() -> None:
    class Odd(Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = DenseLinear(torch.zeros(4, 4), None, 4, 4, key="odd.proj")

    with pytest.raises(TypeError, match="Odd holds linears \\(proj\\) but has no tensor-parallel rule"):
        RankSharder(0, 2).shard_module(Odd())


def test_a_model_with_its_own_forward_is_refused() -> None:
    with pytest.raises(TypeError, match="ToyModel runs its own forward_batch"):
        check_model(ToyModel(vocab_size=64, hidden=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8))  # type: ignore[arg-type]


def test_plugins_registered_as_objects_cannot_reach_the_workers() -> None:
    class Obj:
        __name__ = "an_object_plugin"

    with pytest.raises(ParallelError, match="an_object_plugin.*registered as a Obj object"):
        PluginRecipe.of(load_plugins(autoload=False, extra=[Obj()]))
    import exl3_core.bench.models as bench_module

    recipe = PluginRecipe.of(load_plugins(autoload=False, extra=[bench_module]))
    assert recipe.extra == ("exl3_core.bench.models",) and recipe.allow == ()


def test_cache_reshape_keeps_kinds_and_refuses_allocated_caches() -> None:
    geo = [LayerGeometry("kv", 4, 16, 16)] * 2
    cache = Cache(geo, 64, page_size=16)
    full = cache.bytes_for(torch.float32)
    cache.reshape([LayerGeometry("kv", 1, 16, 16)] * 2)
    assert cache.bytes_for(torch.float32) * 4 == full
    with pytest.raises(ValueError, match="layer kinds"):
        cache.reshape([LayerGeometry("mla", 1, 16, 16)] * 2)
    cache.allocate("cpu", torch.float32)
    with pytest.raises(ValueError, match="allocated"):
        cache.reshape(geo)


def test_one_rank_runs_the_sharded_path_in_this_process() -> None:
    shape = parse_shape("custom(128,256,2,4,2,300)")
    ref, _ = build_model(shape, device="cpu", dtype=torch.float32, seed=6)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    want = ref.forward(ids)
    model, _ = build_model(shape, device="cpu", dtype=torch.float32, seed=6)
    before = {p.pid for p in multiprocessing.active_children()}
    model.load(device="cpu", tensor_parallel_size=1, source=model.bench_source)
    assert model.parallel is None and {p.pid for p in multiprocessing.active_children()} == before
    assert model.layers[0].attn.shard is not None and model.head.vocab_range == (0, 300)
    torch.testing.assert_close(model.forward(ids), want, rtol=0, atol=1e-5)
