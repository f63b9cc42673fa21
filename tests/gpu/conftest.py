"""GPU kernel tests: skipped as a whole without CUDA; with CUDA the compiled ops must be present."""
from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from exl3_core.plan.kernels import CompiledKernels
from exl3_core.quant.exl3.linear import EXL3Linear, NormPrologue, RopeCacheEpilogue
from exl3_core.testing.generation import run_to_end
from exl3_core.tuning import Tuning


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="tests/gpu needs a CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def exl3_ops():
    """``torch.ops.exl3`` with the CUDA kernels; a missing build fails loudly on a CUDA machine."""
    from exl3_core import ext

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not ext.has_op("exl3_gemm_xh"):
        pytest.fail(
            "exl3_core._C has no CUDA EXL3 ops; build it with nvcc first "
            f"(TORCH_CUDA_ARCH_LIST=9.0 python setup.py build_ext --inplace). load errors: {ext.load_error}"
        )
    return torch.ops.exl3


class CountingKernels(CompiledKernels):
    """The compiled EXL3 linear kernels, counting each method's calls by the names
    :class:`exl3_core.testing.kernels.EmulatedKernels` uses, so that a test can tell which fused forms an
    :class:`~exl3_core.plan.ExecutionPlan` built with it took; ``rebuild_dtypes`` lists the operand dtype of
    every rebuilt-W GEMM."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.rebuild_dtypes: list[torch.dtype] = []

    def _count(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1

    def group(self, x2: torch.Tensor, lins: Sequence[EXL3Linear]) -> list[torch.Tensor]:
        self._count("group")
        return super().group(x2, lins)

    def group_ex(self, h2: torch.Tensor, lins: Sequence[EXL3Linear], norm: NormPrologue | None,
                 epilogue: RopeCacheEpilogue | None) -> list[torch.Tensor]:
        self._count("group_ex" if epilogue is None else "group_ex_epilogue")
        if norm is not None:
            self._count("norm_prologue")
        return super().group_ex(h2, lins, norm, epilogue)

    def act(self, layer: EXL3Linear, gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
        self._count("act")
        return super().act(layer, gate, up, act)

    def residual(self, layer: EXL3Linear, x: torch.Tensor, residual: torch.Tensor, ss: torch.Tensor,
                 gate: torch.Tensor | None, act: str | None) -> torch.Tensor:
        self._count("residual" if gate is None else "residual_gated")
        return super().residual(layer, x, residual, ss, gate, act)

    def rebuild_gemm(self, x2: torch.Tensor, lins: Sequence[EXL3Linear]) -> list[torch.Tensor]:
        self._count("rebuild_gemm")
        self.rebuild_dtypes.append(x2.dtype)
        return super().rebuild_gemm(x2, lins)


@pytest.fixture
def counting_kernels() -> type[CountingKernels]:
    """:class:`CountingKernels`, to build as many as a test needs."""
    return CountingKernels


def _greedy_with_logits(model, cache, prompts: list[list[int]], n: int,
                        tuning: Tuning) -> list[tuple[list[int], torch.Tensor]]:
    from exl3_core.generator import Generator

    gen = Generator(model, cache, None, max_batch_size=4, max_seq_len=512, tuning=tuning)
    assert gen.graphs is None, "eager steps: each tuning's path is taken by the forward itself"
    out = run_to_end(gen, prompts, n, logits=True)
    assert all(lg is not None for _, lg in out)
    return out  # type: ignore[return-value]


@pytest.fixture
def greedy_with_logits():
    """``f(model, cache, prompts, n, tuning)``: each prompt's ``n`` greedy tokens and their logits, decoded eagerly
    (``tuning`` must turn graphs off) by a generator of 4 sequences, as ``[(tokens, logits [n, vocab])]``."""
    return _greedy_with_logits


@pytest.fixture(scope="module")
def shape_model_cache(request: pytest.FixtureRequest):
    """``(model, cache)``: a random-weight EXL3 model (4.0 bpw, 6-bit head) of the test module's ``SHAPE`` on the GPU
    with a 2048-token cache of 64-token pages, freed after the module."""
    from exl3_core.bench.models import bench_plugins, build_model, parse_shape

    model, cache = build_model(parse_shape(request.module.SHAPE), bpw=4.0, head_bits=6, device="cuda",
                               cache_tokens=2048, page_size=64, plugins=bench_plugins())
    yield model, cache
    model.unload()
    cache.free()
