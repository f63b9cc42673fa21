"""Tensor and expert parallel on CPU (gloo): 2 and 4 ranks give the single-process fp32 logits within 1e-5,
for a GQA decoder (2 KV heads, so 4 ranks replicate them), a mixture of experts with q/k norms and a latent-
attention mixture of experts, each dense and EXL3: a whole-sequence forward, and a ragged two-sequence batch
through paged caches (chunked prefill, then decode steps) as the engine runs it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exl3_core.archkit import Config, Model
from exl3_core.archkit.batch import BatchMeta
from exl3_core.cache import Cache
from exl3_core.plan import ExecutionPlan

TOL = 1e-5
PAGE = 16
#: new tokens per sequence and step: two prefill chunks, then decode steps
SCHEDULE = [(20, 9), (17, 13), (1, 1), (1, 1), (1, 1)]
LENS = tuple(sum(s[b] for s in SCHEDULE) for b in range(2))

CASES = [
    ("llama", "dense", 2, False), ("llama", "dense", 4, False), ("llama", "exl3", 2, False),
    ("llama", "exl3", 4, False),
    *[(arch, fmt, world, ep) for arch in ("qwen3moe", "deepseekv3") for fmt in ("dense", "exl3") for world in (2, 4)
      for ep in (False, True)],
]


def _steps(model: Model, ids: list[list[int]]) -> list[torch.Tensor]:
    """Logits of every step of :data:`SCHEDULE` through the model's execution plan and a paged cache (pages
    interleaved between the sequences, so the page tables matter)."""
    plan = ExecutionPlan(model)
    cache = Cache(model, max_num_tokens=PAGE * 8, page_size=PAGE)
    order = torch.randperm(cache.num_pages, generator=torch.Generator().manual_seed(1))[:6]
    table = order.view(2, 3).to(torch.int32)
    done, out = [0, 0], []
    for step in SCHEDULE:
        new = [ids[b][done[b]:done[b] + step[b]] for b in range(2)]
        decode = step == (1, 1)
        rows = None if decode else torch.tensor([len(new[0]) - 1, len(new[0]) + len(new[1]) - 1])
        meta = BatchMeta.from_lists(new, done, page_table=table, page_size=PAGE, logits_indices=rows)
        out.append(plan.forward(meta, cache))
        done = [done[b] + step[b] for b in range(2)]
    return out


_refs: dict[tuple[str, str], tuple[torch.Tensor, list[torch.Tensor]]] = {}


def _inputs() -> tuple[torch.Tensor, list[list[int]]]:
    g = torch.Generator().manual_seed(7)
    full = torch.randint(0, 512, (2, 24), generator=g)
    ragged = [torch.randint(0, 512, (n,), generator=g).tolist() for n in LENS]
    return full, ragged


def _reference(arch: str, fmt: str, directory: Path) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The single-process fp32 logits (computed once per checkpoint)."""
    if (arch, fmt) not in _refs:
        model = Model.from_config(Config.from_directory(directory)).load(device="cpu")
        full, ragged = _inputs()
        _refs[(arch, fmt)] = (model.forward(full), _steps(model, ragged))
        model.unload()
    return _refs[(arch, fmt)]


@pytest.mark.parametrize("arch,fmt,world,expert_parallel", CASES,
                         ids=[f"{a}-{f}-{w}ranks{'-ep' if e else ''}" for a, f, w, e in CASES])
def test_ranks_give_the_single_process_logits(arch: str, fmt: str, world: int, expert_parallel: bool,
                                              checkpoints: dict, cpu_groups) -> None:
    directory = checkpoints[(arch, fmt)]
    want_full, want_steps = _reference(arch, fmt, directory)
    group = cpu_groups(world)
    model = Model.from_config(Config.from_directory(directory))
    model.load(parallel_group=group, expert_parallel=expert_parallel)
    try:
        assert model.parallel is not None and model.parallel.world == world
        layer = model.layers[0]
        if hasattr(layer.attn, "num_kv_heads") and layer.attn.num_kv_heads > 1:
            assert model.cache_geometry()[0].num_kv_heads == max(1, layer.attn.num_kv_heads // world)
        full, ragged = _inputs()
        got_full = model.forward(full)
        assert got_full.shape == want_full.shape
        assert float((got_full - want_full).abs().max()) <= TOL
        for got, want in zip(_steps(model, ragged), want_steps, strict=True):
            assert got.shape == want.shape
            assert float((got - want).abs().max()) <= TOL
        decline = ExecutionPlan(model).graph_decline(Cache(model, 4 * PAGE, page_size=PAGE), "decode", [])
        assert decline is not None and decline.startswith("tensor parallel")
        report = model.memory_report()
        assert len(report["ranks"]) == world
        assert all(r["allocated"]["weights"] > 0 for r in report["ranks"])
    finally:
        model.unload()
    assert not group.failure and not group.closed, "a model unloaded from a shared group leaves it running"
