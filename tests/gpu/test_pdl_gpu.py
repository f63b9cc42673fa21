"""Programmatic dependent launch of the decode-size EXL3 linear (csrc/exl3/exl3_fused.cuh,
exl3_core/kernels/pdl.py).

With PDL on, the linear's blocks may start while the kernel before it (an RMSNorm, the gated
activation, the attention combine, which signal their dependents at their start) is still running;
they must not read x or the workspace before ``griddepcontrol.wait``. A read too early would see the
previous step's activations, so every check here feeds *fresh* inputs each call or graph replay and
compares with the same chain run with PDL off (bit-identical where the linear has one k chunk).

PDL is a per-call option: the compiled ops take it in their ``launch`` argument
(``LaunchConfig.ints()``), the Triton kernels read it from the running :func:`launch_config`.
"""
from __future__ import annotations

import pytest
import torch

from exl3_core.kernels.fused import act_mul, rms_norm_residual
from exl3_core.kernels.launch import LaunchConfig, launch_config
from exl3_core.kernels.pdl import HAS_GDC, early_launch
from exl3_core.quant.exl3 import CB_3INST, CB_MUL1

pytestmark = pytest.mark.cuda
DEV = "cuda"
ON = LaunchConfig(pdl=True)
OFF = LaunchConfig(pdl=False)


@pytest.fixture
def pdl_ops(exl3_ops):
    if not any(a.name == "launch" for a in exl3_ops.exl3_linear.default._schema.arguments):
        pytest.fail("exl3_core._C predates the fused ops' launch argument; rebuild it")
    return exl3_ops


def problem(k: int, n: int, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random linear whose output stays O(1) for O(1) inputs (svh ~ 1/sqrt(k)): chained through the
    gated MLP, unit output scales would overflow fp16."""
    tr = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=torch.int16, device=DEV)
    su = ((torch.randint(0, 2, (k,), device=DEV) * 2 - 1) * (0.5 + torch.rand(k, device=DEV))).half()
    sv = ((torch.randint(0, 2, (n,), device=DEV) * 2 - 1) * (0.5 + torch.rand(n, device=DEV)) / k ** 0.5).half()
    return tr, su, sv


def chain(ops, x: torch.Tensor, res: torch.Tensor, w_norm: torch.Tensor, qkv: list, gu: list, down: tuple,
          kt: int, cfg: LaunchConfig) -> list[torch.Tensor]:
    """norm -> grouped linear (q/k/v) ; norm -> grouped gate/up -> act_mul -> down: the decode step's
    kernel order around every linear, every kernel launched with ``cfg``'s PDL setting."""
    launch = cfg.ints()
    with launch_config(cfg):  # the Triton kernels' PDL
        h, r = rms_norm_residual(x, res, w_norm, 1e-6)
        ys = ops.exl3_linear_group(h, [p[0] for p in qkv], [p[1] for p in qkv], [p[2] for p in qkv], CB_MUL1, kt,
                                   launch)
        h2, _ = rms_norm_residual(ys[0][:, : x.shape[1]], r, w_norm, 1e-6)
        g, u = ops.exl3_linear_group(h2, [p[0] for p in gu], [p[1] for p in gu], [p[2] for p in gu], CB_MUL1, kt,
                                     launch)
        a = act_mul("silu", g, u)
        y = ops.exl3_linear(a, *down, CB_MUL1, kt, launch)
    return [*ys, g, u, y]


#: the compiled ops' refusals of a malformed ``launch`` list: the call and the message it must raise. Run in a
#: subprocess: an extension built by a compiler that breaks C++ exceptions across libraries (the device image's
#: /opt/gcc wrapper, bench/device_env.sh) would crash the test process instead of raising
#: (tests/gpu/test_exl3_kernels.py::test_op_error_is_a_python_exception).
_LAUNCH_REFUSALS = """
import re, torch
from exl3_core import ext
ext.load()
ops = torch.ops.exl3
tr = torch.randint(-32768, 32768, (16, 16, 64), dtype=torch.int16, device="cuda")
su = torch.ones(256, dtype=torch.float16, device="cuda")
sv = torch.ones(256, dtype=torch.float16, device="cuda")
x = torch.randn(1, 256, device="cuda").half()
cases = [
    (lambda: ops.exl3_linear(x, tr, su, sv, 2, 32, [1, 2, 0]), r"exl3::exl3_linear: launch must be \\[\\]"),
    (lambda: ops.exl3_linear_group(x, [tr], [su], [sv], 2, 32, [2, 2, 0, 8]),
     r"exl3::exl3_linear_group: launch\\[0\\] \\(pdl\\)"),
    (lambda: ops.exl3_gemm(x, tr, su, sv, 2, [1, 3, 0, 8]), r"exl3::exl3_gemm: launch\\[1\\] \\(predecode\\)"),
    (lambda: ops.exl3_gemm(x, tr, su, sv, 2, [1, 2, -1, 8]),
     r"exl3::exl3_gemm: launch\\[2\\] \\(predecode_max_kt\\)"),
    (lambda: ops.exl3_linear_act(x, x, tr, su, sv, 2, 0, [1, 2, 0, 17]),
     r"exl3::exl3_linear_act: launch\\[3\\] \\(xh_min_rows\\)"),
]
for i, (call, want) in enumerate(cases):
    try:
        call()
        print("case", i, "did not raise")
    except RuntimeError as e:
        print("case", i, "ok" if re.search(want, str(e)) else "wrong message: " + str(e)[:300])
"""


def test_launch_argument_is_checked(pdl_ops) -> None:
    """The ops reject a malformed ``launch`` list with the op and the field in the message (the Python
    wrappers before the op, with the LaunchConfig field); [] means the defaults (PDL on, full pre-decoding),
    so it gives the bits of the explicit default list."""
    import subprocess
    import sys

    from exl3_core.quant.exl3.cuda_ops import exl3_linear_cuda

    r = subprocess.run([sys.executable, "-c", _LAUNCH_REFUSALS], check=False, capture_output=True, text=True,
                       timeout=180)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("case ")]
    assert r.returncode == 0 and len(lines) == 5, (r.returncode, r.stdout[-1000:], r.stderr[-1000:])
    assert all(ln.endswith(" ok") for ln in lines), lines
    tr, su, sv = problem(256, 256, 4)
    x = torch.randn(1, 256, device=DEV).half()
    for launch, field in (([1, 3, 0, 8], "predecode"), ([1, 2, -1, 8], "predecode_max_kt"),
                          ([1, 2, 0, 17], "xh_min_rows")):
        with pytest.raises(ValueError, match=rf"exl3_linear_cuda: LaunchConfig.{field}="):
            exl3_linear_cuda(x, tr, su, sv, CB_MUL1, launch=LaunchConfig(*launch))
    assert torch.equal(pdl_ops.exl3_linear(x, tr, su, sv, CB_MUL1, 32, []),
                       pdl_ops.exl3_linear(x, tr, su, sv, CB_MUL1, 32, LaunchConfig().ints()))


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
        on = chain(pdl_ops, x, res, w, qkv, gu, down, kt, ON)
        off = chain(pdl_ops, x, res, w, qkv, gu, down, kt, OFF)
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
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(pdl_ops, x, res, w, qkv, gu, down, 0, ON)  # warm-up (Triton compiles, workspace grows)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = chain(pdl_ops, x, res, w, qkv, gu, down, 0, ON)
    for rep in range(8):
        x.copy_(torch.randn(1, k, device=DEV).half())
        res.copy_(torch.randn(1, k, device=DEV).half())
        g.replay()
        want = chain(pdl_ops, x, res, w, qkv, gu, down, 0, OFF)
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
        y1 = pdl_ops.exl3_linear(x, tr1, su1, sv1, CB_3INST, 0, ON.ints())
        y2 = pdl_ops.exl3_linear(y1, tr2, su2, sv2, CB_3INST, 0, ON.ints())
        w1 = pdl_ops.exl3_linear(x, tr1, su1, sv1, CB_3INST, 0, OFF.ints())
        w2 = pdl_ops.exl3_linear(w1, tr2, su2, sv2, CB_3INST, 0, OFF.ints())
        for a, b in ((y1, w1), (y2, w2)):
            rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
            assert rel < 1e-3, f"back-to-back linears with PDL differ by {rel:.2e}"
