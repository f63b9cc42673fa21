"""Layers whose widths are off a multiple of 128 (SmolLM2's 576): the one-launch EXL3 linears take the
input, and a residual producer its stream and output, at the layer's own width, reading the missing
columns as zeros, so the plan hands them the stream without a pad launch and keeps the deferred form.
Against the same launch on the zero-padded operands and pure-torch references, on fresh random problems;
then a decode model of such widths, deferred against separate kernels.

Two launches of the same arithmetic differ only in the order their fp32 split-k partial sums land (atomics),
which flips an fp16 rounding in a few elements: REL_SAME = 1e-4 relative L2 (tests/gpu/test_exl3_fused.py's
REL_ROUNDED, where dropping one rounding step measures 3.4e-4)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from exl3_core.kernels.launch import LaunchConfig
from exl3_core.ops import ACT_CODES
from exl3_core.quant.exl3 import CB_3INST, CB_MCG, CB_MUL1, cuda_ops
from exl3_core.reference import fused as ref
from exl3_core.testing.kernels import assert_workspace_clean as workspace_clean
from exl3_core.testing.kernels import random_exl3_problem
from exl3_core.testing.kernels import rel_error as rel
from exl3_core.tuning import FusionTuning, GraphTuning, Tuning

pytestmark = pytest.mark.cuda
DEV = "cuda"
NO_ROPE = (None, None, False, [], None, [])
# (unpadded width, padded width): SmolLM2's hidden, the narrowest, and one column block short of a wide one
WIDTHS = [(576, 640), (64, 128), (1984, 2048)]
REL_SAME = 1e-4


def problem(k: int, n: int, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return random_exl3_problem(k, n, K, DEV)


def padded(x: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(x, (0, width - x.shape[-1]))


@pytest.fixture(scope="module")
def ops_(exl3_ops):
    return exl3_ops


@pytest.mark.parametrize("K,cb", [(4, CB_MUL1), (2, CB_3INST), (6, CB_MCG)])
@pytest.mark.parametrize("cols,k", WIDTHS)
def test_unpadded_input_matches_padded(ops_, cols: int, k: int, K: int, cb: int) -> None:
    """``exl3_linear_group`` and ``exl3_gemm`` on x of the layer's width equal the same ops on x padded with
    zeros (up to the order of their sums) at every row count: the one launch, the x-once variant, the 4-kernel
    chain past the launch's rows, the rebuilt-W GEMM from 65 rows."""
    probs = [problem(k, n, K) for n in (384, 128, 256)]
    for m in (1, 3, 8, 16):
        x = torch.randn(m, cols, device=DEV).half()
        for count in (1, 3):
            args = ([p[0] for p in probs[:count]], [p[1] for p in probs[:count]], [p[2] for p in probs[:count]], cb)
            for launch in (LaunchConfig().ints(), LaunchConfig(xh_min_rows=1).ints()):
                got = ops_.exl3_linear_group(x, *args, 0, launch)
                want = ops_.exl3_linear_group(padded(x, k), *args, 0, launch)
                for i, (a, b) in enumerate(zip(got, want)):
                    assert a.shape == b.shape and not a.isnan().any()
                    assert rel(a, b) < REL_SAME, f"m={m} count={count} problem {i} launch={launch}: {rel(a, b):.2e}"
    p = probs[0]
    for m in (1, 5, 20, 70):
        x = torch.randn(m, cols, device=DEV).half()
        got, want = ops_.exl3_gemm(x, p[0], p[1], p[2], cb), ops_.exl3_gemm(padded(x, k), p[0], p[1], p[2], cb)
        assert got.shape == want.shape and rel(got, want) < REL_SAME, f"exl3_gemm m={m}: {rel(got, want):.2e}"
    workspace_clean(ops_)


@pytest.mark.parametrize("cols,k", WIDTHS)
def test_unpadded_norm_prologue(ops_, cols: int, k: int) -> None:
    """The deferred norm of an unpadded stream: ``rms_norm`` over the stream's own width (its sums / cols),
    weight of that width, then the linear of the normalised rows padded with zeros."""
    probs = [problem(k, n, 4) for n in (256, 128)]
    w = torch.rand(cols, device=DEV) + 0.5
    for m in (1, 4, 16):
        h = (torch.randn(m, cols, device=DEV) * 3).half()
        ss = h.float().pow(2).sum(-1)
        ys = ops_.exl3_linear_group_ex(h, [p[0] for p in probs], [p[1] for p in probs], [p[2] for p in probs],
                                       CB_MUL1, ss, w, 1e-5, 0.0, *NO_ROPE)
        xn = padded(ref.rms_norm(h, w, 1e-5), k)
        for i, (y, p) in enumerate(zip(ys, probs)):
            want = cuda_ops._fallback_linear(xn, p[0], p[1], p[2], CB_MUL1)
            assert y.shape == want.shape and rel(y, want) < 2e-3, f"m={m} problem {i}: {rel(y, want):.2e}"
    with pytest.raises(RuntimeError, match="norm_w must be"):
        ops_.exl3_linear_group_ex(h, [probs[0][0]], [probs[0][1]], [probs[0][2]], CB_MUL1, ss, padded(w, k),
                                  1e-5, 0.0, *NO_ROPE)
    workspace_clean(ops_)


@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("cols,n", WIDTHS)
def test_unpadded_residual(ops_, cols: int, n: int, act: str | None) -> None:
    """A residual producer whose output (o_proj, down) is off a multiple of 128: ``res + y`` at the stream's
    width, the same values as the padded launch's first columns, and the sums of squares of those columns
    alone; the input may be unpadded too (o_proj's)."""
    k_cols, k = WIDTHS[0]
    p = problem(k, n, 4)
    for m in (1, 5, 16):
        x = torch.randn(m, k_cols, device=DEV).half()
        gate = torch.randn(m, k_cols, device=DEV).half() if act else None
        res = (torch.randn(m, cols, device=DEV) * 4).half()
        base = torch.rand(m + 1, device=DEV)
        ss = base.clone()
        code = ACT_CODES[act] if act else 0
        y = ops_.exl3_linear_residual(x, gate, code, p[0], p[1], p[2], CB_MUL1, res, ss)
        assert y.shape == (m, cols) and y.is_contiguous() and not y.isnan().any()
        ss_pad = torch.zeros(m, device=DEV)
        y_pad = ops_.exl3_linear_residual(padded(x, k), None if gate is None else padded(gate, k), code, p[0], p[1],
                                          p[2], CB_MUL1, padded(res, n), ss_pad)
        assert rel(y, y_pad[:, :cols]) < REL_SAME, f"m={m}: the stream differs from the padded launch's columns"
        xin = x if act is None else ref.silu_mul(gate, x)
        want = res.double() + cuda_ops._fallback_linear(padded(xin, k), p[0], p[1], p[2], CB_MUL1)[:, :cols].double()
        assert rel(y, want) < 2e-3, f"m={m}: {rel(y, want):.2e}"
        want_ss = base[:m].double() + y.double().pow(2).sum(-1)
        assert torch.allclose(ss[:m].double(), want_ss, rtol=1e-4), f"m={m}: ss {ss[:m]} vs {want_ss}"
        assert ss[m] == base[m]
    with pytest.raises(RuntimeError, match="res must be"):
        ops_.exl3_linear_residual(x, None, 0, p[0], p[1], p[2], CB_MUL1, res[:, :cols - 2].contiguous(), ss)
    workspace_clean(ops_)


# ---------------------------------------------------------------- a decode model of SmolLM2's widths

SHAPE = "custom(576,1536,3,9,3,2000,64)"


@pytest.mark.parametrize("batch", [1, 3])
def test_off_128_decode_deferred_equals_separate_kernels(shape_model_cache, batch: int,
                                                          monkeypatch,
                                                          greedy_with_logits) -> None:
    """Greedy decode of a model of SmolLM2's widths: the plan defers its norms, every residual producer and
    norm consumer launched with the stream unpadded (no pad before them), q/k/v storing k and v (192 wide) from
    their launch's epilogue, and the logits equal those of the chain with separate kernels
    (``deferred_norm=False, qkv_epilogue=False``) within fp16 tolerance until a near-tie."""
    import exl3_core.plan.kernels as plan_kernels
    from exl3_core.plan import ExecutionPlan

    model, cache = shape_model_cache
    assert ExecutionPlan(model).executor.deferred_why == []
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 2000, (int(n),), generator=g).tolist() for n in torch.randint(10, 80, (batch,), generator=g)]
    widths: list[int] = []
    epilogues: list[int] = []
    real_ex, real_res = plan_kernels.launch_group_ex, plan_kernels.launch_residual

    def count_ex(h2, lins, norm=None, epilogue=None):
        widths.append(h2.shape[-1])
        if epilogue is not None:
            epilogues.append(epilogue.k_cache.shape[2:].numel())
        return real_ex(h2, lins, norm, epilogue)

    def count_res(layer, x, residual, ss, gate=None, act=None):
        widths.append(residual.shape[-1])
        return real_res(layer, x, residual, ss, gate=gate, act=act)

    monkeypatch.setattr(plan_kernels, "launch_group_ex", count_ex)
    monkeypatch.setattr(plan_kernels, "launch_residual", count_res)
    base = dataclasses.replace(Tuning.for_device(model.device), graphs=GraphTuning(enabled=False))
    deferred = greedy_with_logits(model, cache, prompts, 24,
                                  dataclasses.replace(base, fusion=FusionTuning(deferred_norm=True)))
    assert widths and set(widths) == {576}, f"launch widths {sorted(set(widths))}"
    assert epilogues and set(epilogues) == {192}, "q/k/v did not store their 192-wide k/v rows in the epilogue"
    off = FusionTuning(deferred_norm=False, qkv_epilogue=False)
    plain = greedy_with_logits(model, cache, prompts, 24, dataclasses.replace(base, fusion=off))
    for (ta, la), (tb, lb) in zip(deferred, plain):
        n = next((i for i in range(24) if ta[i] != tb[i]), 24)
        if n < 24:
            top = lb[n].float().topk(2).values
            assert top[0] - top[1] <= 1e-2 * lb[n].abs().max(), f"parted at step {n} with a clear margin"
        assert n > 0
        err = ((la[:n] - lb[:n]).abs().max() / lb[:n].abs().max()).item()
        assert err < 1e-2, f"logits differ by {err:.2e} (relative to the max)"
