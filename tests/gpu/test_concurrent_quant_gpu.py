"""Quantizing several linears side by side on CUDA streams (exl3_core/convert/concurrent.py) gives
exactly the tensors of quantizing them one by one, and an error in one job reaches the caller."""
from __future__ import annotations

import pytest
import torch

from exl3_core.convert.concurrent import run_on_streams
from exl3_core.quant.exl3.hessian import HessianAccumulator
from exl3_core.quant.exl3.quantize import quantize_linear
from exl3_core.quant.exl3.viterbi import has_cuda


def test_streams_give_bit_identical_quantization() -> None:
    if not has_cuda():
        pytest.skip("needs the compiled CUDA Viterbi encoder")
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(11)
    k = 512
    x = torch.randn(4096, k, generator=g) @ (torch.eye(k) + 0.3 * torch.randn(k, k, generator=g) / k**0.5)
    acc = HessianAccumulator(k)
    acc.add(x.to(dev))
    h = acc.finalize(seed=5)
    shapes = [(512, 4), (128, 4), (128, 4), (1024, 3), (384, 2)]  # (out features, K): narrow and wide
    ws = [(torch.randn(n, k, generator=g) * 0.02).to(dev) for n, _ in shapes]
    torch.backends.cuda.matmul.allow_tf32 = True  # as while converting
    try:
        def job(i: int):  # noqa: ANN202
            return lambda: quantize_linear(ws[i], h, K=shapes[i][1], seed=100 + i, name=f"lin{i}")

        serial = [job(i)() for i in range(len(shapes))]
        side = run_on_streams([job(i) for i in range(len(shapes))], dev)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    for a, b in zip(serial, side, strict=True):
        assert torch.equal(a.trellis, b.trellis)
        assert torch.equal(a.suh, b.suh) and torch.equal(a.svh, b.svh)
        assert a.proxy_err == b.proxy_err


def test_an_error_in_one_stream_job_is_raised_after_the_others_finish() -> None:
    dev = torch.device("cuda")
    done = []

    def ok(i: int):  # noqa: ANN202
        def run() -> int:
            torch.ones(1 << 20, device=dev).sum()
            done.append(i)
            return i
        return run

    def bad() -> int:
        raise ValueError("job 1 failed")

    with pytest.raises(ValueError, match="job 1 failed"):
        run_on_streams([ok(0), bad, ok(2)], dev)
    assert sorted(done) == [0, 2]
    assert run_on_streams([ok(5), ok(6)], dev) == [5, 6]
