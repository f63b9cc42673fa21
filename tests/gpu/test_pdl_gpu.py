"""Programmatic dependent launch of the decode-size EXL3 linear (csrc/exl3/exl3_fused.cuh,
exl3_core/kernels/pdl.py).

With PDL on, the linear's blocks may start while the kernel before it (an RMSNorm, the gated
activation, the attention combine, which signal their dependents at their start) is still running;
they must not read x or the workspace before ``griddepcontrol.wait``. A read too early would see the
previous step's activations, so every check here feeds *fresh* inputs each call or graph replay and
compares with the same chain run with PDL off (bit-identical where the linear has one k chunk).
"""
from __future__ import annotations

import pytest
import torch

from exl3_core.kernels.fused import act_mul, rms_norm_residual
from exl3_core.kernels.pdl import HAS_GDC, early_launch
from exl3_core.quant.exl3 import CB_3INST, CB_MUL1

pytestmark = pytest.mark.cuda
DEV = "cuda"


@pytest.fixture
def pdl_ops(exl3_ops):
    if not hasattr(exl3_ops, "set_pdl"):
        pytest.fail("exl3_core._C predates exl3::set_pdl; rebuild it")
    before = exl3_ops.set_pdl(True)
    yield exl3_ops
    exl3_ops.set_pdl(before)


def problem(k: int, n: int, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random linear whose output stays O(1) for O(1) inputs (svh ~ 1/sqrt(k)): chained through the
    gated MLP, unit output scales would overflow fp16."""
    tr = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=torch.int16, device=DEV)
    su = ((torch.randint(0, 2, (k,), device=DEV) * 2 - 1) * (0.5 + torch.rand(k, device=DEV))).half()
    sv = ((torch.randint(0, 2, (n,), device=DEV) * 2 - 1) * (0.5 + torch.rand(n, device=DEV)) / k ** 0.5).half()
    return tr, su, sv


def chain(ops, x: torch.Tensor, res: torch.Tensor, w_norm: torch.Tensor, qkv: list, gu: list, down: tuple,
          kt: int) -> list[torch.Tensor]:
    """norm -> grouped linear (q/k/v) ; norm -> grouped gate/up -> act_mul -> down: the decode step's
    kernel order around every linear."""
    h, r = rms_norm_residual(x, res, w_norm, 1e-6)
    ys = ops.exl3_linear_group(h, [p[0] for p in qkv], [p[1] for p in qkv], [p[2] for p in qkv], CB_MUL1, kt)
    h2, _ = rms_norm_residual(ys[0][:, : x.shape[1]], r, w_norm, 1e-6)
    g, u = ops.exl3_linear_group(h2, [p[0] for p in gu], [p[1] for p in gu], [p[2] for p in gu], CB_MUL1, kt)
    a = act_mul("silu", g, u)
    y = ops.exl3_linear(a, *down, CB_MUL1, kt)
    return [*ys, g, u, y]


def test_set_pdl_returns_previous(pdl_ops) -> None:
    assert pdl_ops.set_pdl(False) is True
    assert pdl_ops.set_pdl(True) is False


def test_early_signal_is_on_for_this_device() -> None:
    x = torch.zeros(1, 8, device=DEV, dtype=torch.float16)
    if torch.cuda.get_device_capability()[0] >= 9 and HAS_GDC:
        assert early_launch(x)
    assert not early_launch(x.cpu())


@pytest.mark.parametrize("kt", [32, 0])  # at most two k chunks (deterministic) and the launcher's split
def test_pdl_chain_equals_plain(pdl_ops, kt: int) -> None:
    k, inter = 512, 1024
    qkv = [problem(k, 512, 4), problem(k, 128, 4), problem(k, 128, 4)]
    gu = [problem(k, inter, 4), problem(k, inter, 4)]
    down = problem(inter, k, 4)
    w = (1 + 0.1 * torch.randn(k, device=DEV)).half()
    for step in range(6):  # fresh inputs each call: a read before the wait would see the previous step's
        x = torch.randn(1, k, device=DEV).half()
        res = torch.randn(1, k, device=DEV).half()
        pdl_ops.set_pdl(True)
        on = chain(pdl_ops, x, res, w, qkv, gu, down, kt)
        pdl_ops.set_pdl(False)
        off = chain(pdl_ops, x, res, w, qkv, gu, down, kt)
        for i, (a, b) in enumerate(zip(on, off)):
            assert torch.isfinite(b).all(), f"step {step}, output {i}: the reference chain overflowed"
            if kt == 32:  # at most two k chunks per linear: fp32 0 + a + b is order-free, so bit-exact
                assert torch.equal(a, b), f"step {step}, output {i}: PDL changed the bits"
            rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
            assert rel < 1e-3, f"step {step}, output {i}: PDL on vs off differ by {rel:.2e}"


def test_pdl_graph_replay_sees_new_inputs(pdl_ops) -> None:
    """Captured with PDL (programmatic edges in the graph): every replay must use that replay's x."""
    k, inter = 1024, 2048
    qkv = [problem(k, 1024, 4), problem(k, 256, 4), problem(k, 256, 4)]
    gu = [problem(k, inter, 4), problem(k, inter, 4)]
    down = problem(inter, k, 4)
    w = (1 + 0.1 * torch.randn(k, device=DEV)).half()
    x = torch.randn(1, k, device=DEV).half()
    res = torch.randn(1, k, device=DEV).half()
    pdl_ops.set_pdl(True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(pdl_ops, x, res, w, qkv, gu, down, 0)  # warm-up (Triton compiles, workspace grows)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = chain(pdl_ops, x, res, w, qkv, gu, down, 0)
    for rep in range(8):
        x.copy_(torch.randn(1, k, device=DEV).half())
        res.copy_(torch.randn(1, k, device=DEV).half())
        g.replay()
        pdl_ops.set_pdl(False)
        want = chain(pdl_ops, x, res, w, qkv, gu, down, 0)
        pdl_ops.set_pdl(True)
        for i, (a, b) in enumerate(zip(outs, want)):
            rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
            assert rel < 1e-3, f"replay {rep}, output {i}: graph with PDL differs from eager by {rel:.2e}"


def test_pdl_other_codebook_and_k(pdl_ops) -> None:
    """A linear right after another linear (no Triton kernel between): the second must wait for the
    first's workspace clean-up before using the shared workspace."""
    tr1, su1, sv1 = problem(2048, 1024, 3)
    tr2, su2, sv2 = problem(1024, 2048, 5)
    for _ in range(5):
        x = torch.randn(1, 2048, device=DEV).half()
        pdl_ops.set_pdl(True)
        y1 = pdl_ops.exl3_linear(x, tr1, su1, sv1, CB_3INST, 0)
        y2 = pdl_ops.exl3_linear(y1, tr2, su2, sv2, CB_3INST, 0)
        pdl_ops.set_pdl(False)
        w1 = pdl_ops.exl3_linear(x, tr1, su1, sv1, CB_3INST, 0)
        w2 = pdl_ops.exl3_linear(w1, tr2, su2, sv2, CB_3INST, 0)
        for a, b in ((y1, w1), (y2, w2)):
            rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
            assert rel < 1e-3, f"back-to-back linears with PDL differ by {rel:.2e}"
