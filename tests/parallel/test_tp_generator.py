"""The generator runs unchanged on rank 0: 8 batched greedy jobs (some sharing prefix pages) give exactly the
single-process tokens, and cache page copies on rank 0 reach every rank's share of the page."""
from __future__ import annotations

import pytest
import torch

from exl3_core.archkit import Config, Model
from exl3_core.archkit.batch import BatchMeta
from exl3_core.cache import Cache
from exl3_core.generator import Generator, Job
from exl3_core.plan import ExecutionPlan

PAGE = 16
NEW_TOKENS = 8


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(0, 512, (2 * PAGE,), generator=g).tolist()  # two whole pages, reused from the cache
    out = []
    for i in range(8):
        own = torch.randint(0, 512, (3 + 5 * i,), generator=g).tolist()
        out.append(shared + own if i % 2 else own)
    return out


def _generate(model: Model) -> dict[int, list[int]]:
    cache = Cache(model, max_num_tokens=48 * PAGE, page_size=PAGE)
    gen = Generator(model, cache, max_batch_size=8)
    gen.enqueue([Job(p, max_new_tokens=NEW_TOKENS, stop_at_eos=False, identifier=i) for i, p in enumerate(_prompts())])
    out: dict[int, list[int]] = {}
    while gen.num_remaining():
        for r in gen.iterate():
            assert r.get("error") is None, r.get("error")
            out.setdefault(r["identifier"], []).extend(r["token_ids"])
    return out


@pytest.mark.parametrize("arch,fmt,world", [("llama", "dense", 4), ("deepseekv3", "exl3", 2)])
def test_batched_greedy_jobs_equal_single_process(arch: str, fmt: str, world: int, checkpoints: dict,
                                                  cpu_groups) -> None:
    directory = checkpoints[(arch, fmt)]
    single = Model.from_config(Config.from_directory(directory)).load(device="cpu")
    want = _generate(single)
    single.unload()
    model = Model.from_config(Config.from_directory(directory))
    model.load(parallel_group=cpu_groups(world))
    try:
        got = _generate(model)
    finally:
        model.unload()
    assert sorted(got) == list(range(8)) and all(len(t) == NEW_TOKENS for t in got.values())
    assert got == want


def test_page_copies_reach_every_rank(checkpoints: dict, cpu_groups) -> None:
    """Copy a sequence's pages on rank 0, then decode through the copies: the other ranks read their share of
    the keys and values from their copies (a rank that missed the copy reads zeros and changes the logits)."""
    model = Model.from_config(Config.from_directory(checkpoints[("llama", "dense")]))
    model.load(parallel_group=cpu_groups(2))
    try:
        plan = ExecutionPlan(model)
        cache = Cache(model, max_num_tokens=8 * PAGE, page_size=PAGE)
        ids = torch.randint(0, 512, (2 * PAGE + 3,), generator=torch.Generator().manual_seed(5)).tolist()
        first = torch.tensor([[0, 1, 2]], dtype=torch.int32)
        copies = torch.tensor([[4, 5, 6]], dtype=torch.int32)
        plan.forward(BatchMeta.from_lists([ids[:-1]], [0], page_table=first, page_size=PAGE), cache)
        for src, dst in zip(first[0].tolist(), copies[0].tolist()):
            cache.copy_page(src, dst)
        steps = [plan.forward(BatchMeta.from_lists([ids[-1:]], [len(ids) - 1], page_table=t, page_size=PAGE), cache)
                 for t in (first, copies)]
        torch.testing.assert_close(steps[1], steps[0], rtol=0, atol=0)
    finally:
        model.unload()


def test_a_cache_planned_for_the_whole_model_is_refused(checkpoints: dict, cpu_groups) -> None:
    """A cache built before the load (for every KV head) and not handed to it cannot serve rank 0's share."""
    model = Model.from_config(Config.from_directory(checkpoints[("llama", "dense")]))
    early = Cache(model, max_num_tokens=4 * PAGE, page_size=PAGE)
    model.load(parallel_group=cpu_groups(2))
    try:
        early.allocate(model.device, model.dtype)
        meta = BatchMeta.from_lists([[1, 2, 3]], [0], page_table=torch.tensor([[0]], dtype=torch.int32),
                                    page_size=PAGE)
        with pytest.raises(ValueError, match="built before the tensor-parallel load"):
            ExecutionPlan(model).forward(meta, early)
        assert model.parallel is not None and model.parallel.group.failure is None  # type: ignore[attr-defined]
        assert model.forward(torch.tensor([[1, 2, 3]])).shape == (1, 3, 512)
    finally:
        model.unload()
