"""On CUDA (the execution plan's fused residual chain, EXL3 kernels): the last block runs o_proj, its MLP, the
final norm and the head only on the rows whose logits are asked for; the logits match the full forward's rows
and every row's keys and values are the same (tests/core/test_last_rows.py has the CPU side)."""
from __future__ import annotations

import pytest
import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.bench.models import bench_plugins, build_model, parse_shape
from exl3_core.plan import ExecutionPlan

SHAPE = "custom(512,1024,3,8,2,2000)"
PAGE = 64
TOL = 1e-2  # fp16; a 1-2 row o_proj/MLP runs the EXL3 GEMV where the full forward runs the rebuilt-W GEMM


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("lens", [[300], [257, 130]])
def test_pruned_last_block_matches_full_forward(lens: list[int]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, cache = build_model(parse_shape(SHAPE), bpw=4.0, head_bits=6, device="cuda", cache_tokens=4096,
                               page_size=PAGE, plugins=bench_plugins())
    try:
        plan = ExecutionPlan(model)
        assert plan.executor is not None and not plan.executor.chain_why and not plan.executor.rows_why
        # the rows the last block's MLP sees (the plan runs it through its runner, not the module's forward)
        runner = plan.executor.blocks[-1].mlp_runner
        assert runner is not None
        seen: list[int] = []
        real = runner.forward
        runner.forward = lambda x, state: seen.append(x.shape[0]) or real(x, state)  # type: ignore[method-assign]
        g = torch.Generator().manual_seed(1)
        toks = [torch.randint(0, 2000, (n,), generator=g).tolist() for n in lens]
        pages = [cache.allocator.allocate(-(-n // PAGE)) for n in lens]
        width = max(len(p) for p in pages)
        table = torch.tensor([p + [p[-1]] * (width - len(p)) for p in pages], dtype=torch.int32)
        ends = torch.tensor(lens).cumsum(0) - 1

        def run(li: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
            meta = BatchMeta.from_lists(toks, [0] * len(lens), device="cuda", page_table=table, page_size=PAGE,
                                        logits_indices=li)
            out = plan.forward(meta, cache).clone()
            kv = [t.clone() for layer in cache.layers for t in layer.attn_tensors() if t is not None]
            return out, kv

        full, kv_full = run(None)
        assert seen[-1] == sum(lens)
        pruned, kv = run(ends.cuda())
        assert seen[-1] == len(lens), "the last MLP ran on the asked rows only"
        assert pruned.shape == (len(lens), 2000)
        for r, e in enumerate(ends.tolist()):
            assert _rel(pruned[r], full[e]) < TOL
        for a, b in zip(kv_full, kv):
            assert torch.equal(a, b)
    finally:
        model.unload()
        if cache is not None:
            cache.free()
