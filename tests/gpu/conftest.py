"""GPU kernel tests: skipped as a whole without CUDA; with CUDA the compiled ops must be present."""
from __future__ import annotations

import pytest
import torch


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
