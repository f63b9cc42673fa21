"""exl3::reconstruct_full (W in the original basis, csrc/exl3/exl3_recon_full.cuh) and the big-m
exl3_gemm route that multiplies by it, against the fp32 oracle ``dequantize_padded`` (spec 4.2).

Fresh random trellis words and random non-unit fp16 scales every test; outputs are poisoned with
NaN before the kernels write them.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from exl3_core.plan.kernels import LinearKernels
from exl3_core.plan.linears import Projection
from exl3_core.quant.exl3 import CB_3INST, CB_MCG, CB_MUL1, cuda_ops
from exl3_core.quant.exl3.quantize import dequantize_padded
from exl3_core.quant.exl3.trellis import decode_inner
from exl3_core.tuning import Tuning

pytestmark = pytest.mark.cuda
CBS = (CB_3INST, CB_MCG, CB_MUL1)
DEV = "cuda"
FP16_HALF_ULP = 2.0**-11  # relative rounding bound of fp16 (normal range)
FP16_SUB_HALF_ULP = 2.0**-25  # absolute rounding bound in fp16's subnormal range
# K <= RF_HALF_MAX_K runs the half2 kernel (the launcher's compile-time choice; read from the header so
# the two cannot drift apart), larger K the fp32 kernel.
RF_HALF_MAX_K = int(re.search(r"constexpr int RF_HALF_MAX_K = (\d+);",
                              (Path(__file__).parents[2] / "csrc/exl3/tuning.cuh").read_text()).group(1))
# The half2 kernel rounds to fp16 after each of its 14 butterfly stages and after
# *suh and *svh. The last stage and the two scalings round the element itself: at most 3 half-ulps of
# |W_ij| (3 * FP16_HALF_ULP * |ref|). For the 13 earlier stages: the values of stage s have RMS
# w_rms * 2^(s/2) / 128 (w_rms: the decoded weights' RMS; the exact 2^-7 is applied first) and the
# 14 - s stages after it sum 2^(14-s) of its independent rounding errors with signs, so each adds
# variance (u_rms * w_rms * |suh_i svh_j|)^2 to an element, u_rms <= 2^-11 / sqrt(3) (round to nearest:
# relative error up to 2^-11, about uniform). Their std <= sqrt(13 / 3) * 2^-11 * w_rms * |suh svh|
# ~ 2.1 * 2^-11 * w_rms * |suh svh| (the CPU model in csrc/exl3/recon_full_emu.py: 1.8, max 9.6 over
# 2M elements); 16 * 2^-11 is ~7.5 std, yet 1/8 of the ~2^7 * 2^-11 error that a wrong kernel (a
# missing stage, a wrong sign or index) makes on nearly every element. Its rel-L2 error is ~8.9e-4.
HALF_VARIANT_ERR = 16 * FP16_HALF_ULP


def rand_trellis(k: int, n: int, K: int) -> torch.Tensor:
    return torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=torch.int16)


def rand_scales(k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    # signs plus magnitudes spread over ~2 octaves (suh) and ~1 decade (svh), like real layers
    suh = (torch.randn(k).sign() * (0.5 + 1.5 * torch.rand(k))).to(torch.float16)
    svh = (torch.randn(n).sign() * (0.005 + 0.045 * torch.rand(n))).to(torch.float16)
    return suh, svh


def poison(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Fill and free a block of the op's output size: the caching allocator hands it back next."""
    t = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    del t


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.to("cpu", torch.float64), b.to("cpu", torch.float64)  # callers mix device outputs and CPU oracles
    return ((a64 - b64).norm() / b64.norm()).item()


def check_against_oracle(out: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, K: int,
                         cb: int, what: str) -> None:
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    ref = dequantize_padded(trellis, suh, svh, K, cb).double()  # CPU fp32 oracle
    assert out.dtype == torch.float16 and tuple(out.shape) == (k, n), what
    out = out.cpu().double()
    assert not out.isnan().any(), f"{what}: elements left unwritten"
    assert rel_err(out, ref) < 1e-3, what
    # per element: one fp16 rounding of a value within fp32 arithmetic error of the oracle; that error
    # scales with the element's |suh_i * svh_j| and the decoded weights' size (not with |ref|)
    w_rms = decode_inner(trellis, K, cb).double().pow(2).mean().sqrt()
    fp32_err = 1e-5 * w_rms * suh.double().abs()[:, None] * svh.double().abs()[None, :]
    bound = FP16_HALF_ULP * (ref.abs() + fp32_err) + fp32_err + FP16_SUB_HALF_ULP
    excess = (out - ref).abs() - bound
    if K > RF_HALF_MAX_K:
        assert (excess <= 0).all(), (f"{what}: {(excess > 0).sum().item()} elements beyond fp16 rounding, "
                                     f"worst by {excess.max():.3g}")
        return
    # the half2 kernel: its bound (HALF_VARIANT_ERR)
    half_err = (HALF_VARIANT_ERR * w_rms * suh.double().abs()[:, None] * svh.double().abs()[None, :]
                + 3 * FP16_HALF_ULP * ref.abs())
    excess = (out - ref).abs() - (bound + half_err)
    assert (excess <= 0).all(), (
        f"{what}: {(excess > 0).sum().item()} elements beyond the half2 kernel's bound, worst by {excess.max():.3g}")


@pytest.mark.parametrize("cb", CBS)
@pytest.mark.parametrize("K", range(1, 9))
def test_matches_oracle(exl3_ops, K: int, cb: int) -> None:
    k, n = 256, 384  # 2 x 3 blocks of 128: both grid dims, k != n
    trellis = rand_trellis(k, n, K)
    suh, svh = rand_scales(k, n)
    poison((k, n), torch.float16)
    out = exl3_ops.reconstruct_full(trellis.to(DEV), suh.to(DEV), svh.to(DEV), K, cb)
    check_against_oracle(out, trellis, suh, svh, K, cb, f"K={K} cb={cb}")


@pytest.mark.parametrize("cb", CBS)
def test_large_and_wrapper(exl3_ops, cb: int) -> None:
    k, n, K = 1024, 2048, 4  # 8 x 16 blocks
    trellis = rand_trellis(k, n, K)
    suh, svh = rand_scales(k, n)
    poison((k, n), torch.float16)
    out = cuda_ops.reconstruct_full_cuda(trellis.to(DEV), suh.to(DEV), svh.to(DEV), K, cb)
    check_against_oracle(out, trellis, suh, svh, K, cb, f"{k}x{n} cb={cb}")


def test_misaligned_and_fp32_scales(exl3_ops) -> None:
    # svh as a view 2 bytes into its storage (the kernel's 16-byte loads need an aligned copy) and
    # fp32 scale vectors (the op reads them as fp16, their storage type)
    k, n, K, cb = 128, 256, 3, CB_MUL1
    trellis = rand_trellis(k, n, K)
    suh, svh = rand_scales(k, n)
    backing = torch.empty(n + 1, dtype=torch.float16, device=DEV)
    backing[1:] = svh.to(DEV)
    sv_view = backing[1:]
    assert sv_view.data_ptr() % 16 != 0
    out = exl3_ops.reconstruct_full(trellis.to(DEV), suh.float().to(DEV), sv_view, K, cb)
    check_against_oracle(out, trellis, suh, svh, K, cb, "misaligned svh, fp32 suh")


@pytest.mark.parametrize("cb", CBS)
@pytest.mark.parametrize("m", [256, 2048])
def test_exl3_gemm_big_m(exl3_ops, m: int, cb: int) -> None:
    k, n, K = 1024, 768, 4
    trellis = rand_trellis(k, n, K)
    suh, svh = rand_scales(k, n)
    x = torch.randn(m, k).to(torch.float16)
    ref = x.double() @ dequantize_padded(trellis, suh, svh, K, cb).double()
    poison((m, n), torch.float16)
    y = exl3_ops.exl3_gemm(x.to(DEV), trellis.to(DEV), suh.to(DEV), svh.to(DEV), cb)
    assert y.dtype == torch.float16 and tuple(y.shape) == (m, n)
    assert not y.isnan().any()
    # fp16 rounding of W and of y, fp32 accumulation: ~4e-4 expected
    assert rel_err(y, ref) < 2e-3, f"m={m} cb={cb}"


def test_exl3_gemm_big_m_in_cuda_graph(exl3_ops) -> None:
    k, n, K, cb, m = 512, 384, 2, CB_MCG, 128
    trellis, (suh, svh) = rand_trellis(k, n, K).to(DEV), rand_scales(k, n)
    suh, svh = suh.to(DEV), svh.to(DEV)
    x = torch.randn(m, k, device=DEV).to(torch.float16)
    eager = exl3_ops.exl3_gemm(x, trellis, suh, svh, cb)  # also sets the kernel's smem attribute first
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = exl3_ops.exl3_gemm(x, trellis, suh, svh, cb)
    x2 = torch.randn(m, k, device=DEV).to(torch.float16)
    x.copy_(x2)
    g.replay()
    torch.cuda.synchronize()
    ref = exl3_ops.exl3_gemm(x2, trellis, suh, svh, cb)
    assert rel_err(y, ref) < 1e-3 and rel_err(eager, ref) > 1e-1  # replay saw the new x


def test_wrapper_rejects_bad_arguments(exl3_ops) -> None:
    trellis = rand_trellis(128, 256, 3).to(DEV)
    suh, svh = (s.to(DEV) for s in rand_scales(128, 256))
    f = cuda_ops.reconstruct_full_cuda
    with pytest.raises(ValueError, match="K=3"):
        f(trellis, suh, svh, 4, CB_MUL1)
    with pytest.raises(ValueError, match="codebook"):
        f(trellis, suh, svh, 3, 7)
    with pytest.raises(ValueError, match="svh must be"):
        f(trellis, suh, svh[:128], 3, CB_MUL1)
    with pytest.raises(ValueError, match="multiples of 128"):
        f(trellis[:, :4].contiguous(), suh, svh[:64], 3, CB_MUL1)
    with pytest.raises(ValueError, match="suh is on cpu"):
        f(trellis, suh.cpu(), svh, 3, CB_MUL1)
    with pytest.raises(ValueError, match="int16"):
        f(trellis.to(torch.int32), suh, svh, 3, CB_MUL1)


@pytest.mark.parametrize("cb", CBS)
@pytest.mark.parametrize("K", [2, 4, 6])
def test_into_a_column_block_is_bit_identical(exl3_ops, K: int, cb: int) -> None:
    """reconstruct_full_into writes exactly reconstruct_full's W into a strided column block and
    nothing outside it."""
    k, n, left, right = 512, 384, 256, 128
    trellis, (suh, svh) = rand_trellis(k, n, K).to(DEV), rand_scales(k, n)
    suh, svh = suh.to(DEV), svh.to(DEV)
    want = exl3_ops.reconstruct_full(trellis, suh, svh, K, cb)
    wide = torch.full((k, left + n + right), float("nan"), dtype=torch.float16, device=DEV)
    cuda_ops.reconstruct_full_into_cuda(trellis, suh, svh, K, cb, wide[:, left:left + n])
    assert torch.equal(wide[:, left:left + n], want)
    assert wide[:, :left].isnan().all() and wide[:, left + n:].isnan().all()
    with pytest.raises(ValueError, match="row stride"):
        cuda_ops.reconstruct_full_into_cuda(trellis, suh, svh, K, cb, wide[:, 4:4 + n])  # misaligned start
    with pytest.raises(ValueError, match="fp16"):
        cuda_ops.reconstruct_full_into_cuda(trellis, suh, svh, K, cb, wide[:, :n - 128])


def _projection(layers: tuple[torch.nn.Module, ...], kernels: LinearKernels) -> Projection:
    """The plan's form of linears sharing an input (q/k/v, gate/up), through ``kernels``."""
    return Projection("test", layers, Tuning.h200(), torch.device("cuda", torch.cuda.current_device()), kernels)


def test_projection_big_m_is_one_gemm_and_matches_the_layers(exl3_ops, counting_kernels) -> None:
    """From 65 rows, linears sharing x (q/k/v, gate/up; K and codebook may differ) are rebuilt side
    by side and multiplied by one GEMM (the plan's :class:`Projection`); outputs equal each layer's own
    exl3_gemm forward."""
    from exl3_core.quant.exl3.linear import REBUILD_MIN_ROWS, EXL3Linear

    def layer(k_true: int, n_true: int, K: int, cb: int, bias: bool) -> EXL3Linear:
        k, n = -(-k_true // 128) * 128, -(-n_true // 128) * 128
        suh, svh = rand_scales(k, n)
        b = torch.randn(n_true, device=DEV).half() if bias else None
        return EXL3Linear(rand_trellis(k, n, K).to(DEV), suh.to(DEV), svh.to(DEV), cb, k_true, n_true, bias=b)

    qkv = (layer(576, 576, 4, CB_MUL1, True), layer(576, 192, 3, CB_MCG, False), layer(576, 192, 4, CB_MUL1, True))
    kernels = counting_kernels()
    proj = _projection(qkv, kernels)
    assert proj.rebuild_why == [], proj.rebuild_why
    for m in (REBUILD_MIN_ROWS, 300):
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.randn(m, 576, device=DEV).to(dtype)
            before = kernels.calls.get("rebuild_gemm", 0)
            got = proj.run(x)
            assert kernels.calls.get("rebuild_gemm", 0) == before + 1, "not one rebuilt-W GEMM for the group"
            assert kernels.rebuild_dtypes[-1] == dtype
            for i, (g, lay) in enumerate(zip(got, qkv)):
                want = lay(x)
                assert g.dtype == dtype and g.shape == want.shape == (m, lay.out_features)
                # bf16: the same W and x, GEMMs of other widths accumulate in another order, so an
                # output may round one bf16 ulp (2^-8 relative) apart; fp16 ulps are 8x finer
                assert rel_err(g, want) < (2e-3 if dtype == torch.float16 else 8e-3), f"m={m} {dtype} output {i}"


def test_projection_calls_hooked_layers_one_by_one(exl3_ops, counting_kernels) -> None:
    """Forward hooks (the converter's input capture) must see every layer's input: with a hook on
    any layer, the plan's Projection calls each layer instead of one grouped launch, at any row count."""
    from exl3_core.quant.exl3.linear import EXL3Linear

    lays = []
    for n in (256, 128):
        suh, svh = rand_scales(256, n)
        lays.append(EXL3Linear(rand_trellis(256, n, 4).to(DEV), suh.to(DEV), svh.to(DEV), CB_MUL1, 256, n))
    kernels = counting_kernels()
    proj = _projection(tuple(lays), kernels)
    assert proj.group_why == [] and proj.rebuild_why == []
    seen: list[int] = []
    h = lays[1].register_forward_pre_hook(lambda mod, inp: seen.append(inp[0].shape[0]))
    try:
        for m in (1, 300):
            x = torch.randn(m, 256, device=DEV).half()
            seen.clear()
            got = proj.run(x)
            assert seen == [m]  # the hooked layer's own forward ran, once
            assert all(rel_err(g, lay(x)) < 2e-3 for g, lay in zip(got, lays))
        assert kernels.calls == {}, f"a grouped launch ran despite the hook: {kernels.calls}"
    finally:
        h.remove()


@pytest.mark.parametrize("cb", CBS)
@pytest.mark.parametrize("K", range(1, 9))
def test_bf16_out(exl3_ops, K: int, cb: int) -> None:
    """A bf16 ``out`` (the bf16 prefill's W): the half2 kernel (K <= RF_HALF_MAX_K) writes exactly its
    fp16 W converted to bf16; the fp32 kernel rounds its fp32 result once, to bf16, so it is at most one
    bf16 ulp from the converted fp16 W (that one rounds twice)."""
    k, n = 256, 384
    trellis, (suh, svh) = rand_trellis(k, n, K), rand_scales(k, n)
    t, su, sv = trellis.to(DEV), suh.to(DEV), svh.to(DEV)
    conv = exl3_ops.reconstruct_full(t, su, sv, K, cb).to(torch.bfloat16)
    wb = torch.full((k, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    cuda_ops.reconstruct_full_into_cuda(t, su, sv, K, cb, wb)
    if K <= RF_HALF_MAX_K:
        assert torch.equal(wb, conv)
        return
    assert not wb.isnan().any()
    c = conv.double()
    ulp = torch.exp2(torch.floor(torch.log2(c.abs().clamp_min(2.0**-126))) - 7)  # bf16: 8 significant bits
    assert ((wb.double() - c).abs() <= ulp + FP16_SUB_HALF_ULP).all()  # (fp16 subnormals round coarser)
    assert rel_err(wb, dequantize_padded(trellis, suh, svh, K, cb)) < 3e-3  # bf16 rounding: ~1.1e-3 rms


@pytest.mark.parametrize("cb", CBS)
def test_bf16_linear_big_m(exl3_ops, cb: int) -> None:
    """A bf16 ``x`` from 65 rows (the bf16 prefill's o_proj and down): W rebuilt in bf16, a bf16 GEMM,
    a bf16 result close to the fp64 product."""
    from exl3_core.quant.exl3.linear import EXL3Linear

    k, n, K, m = 1024, 768, 4, 256
    trellis, (suh, svh) = rand_trellis(k, n, K), rand_scales(k, n)
    lin = EXL3Linear(trellis.to(DEV), suh.to(DEV), svh.to(DEV), cb, k, n)
    x = torch.randn(m, k).to(torch.bfloat16)
    ref = x.double() @ dequantize_padded(trellis, suh, svh, K, cb).double()
    y = lin(x.to(DEV))
    assert y.dtype == torch.bfloat16 and tuple(y.shape) == (m, n)
    # W and y each rounded to bf16 (2^-9 relative at most, ~1.1e-3 rms each), fp32 accumulation
    assert rel_err(y, ref) < 6e-3, f"cb={cb}"
    # below 65 rows a bf16 x takes the fp16 decode path and gets its result back in bf16
    y8 = lin(x[:8].to(DEV))
    assert y8.dtype == torch.bfloat16 and rel_err(y8, ref[:8]) < 6e-3
