"""linear.group_gemm (linears sharing an input rebuilt side by side, one GEMM) on the CPU fallback,
against each layer's own reference forward; and the wrapper's argument checks."""
from __future__ import annotations

import pytest
import torch

from exl3_core.quant.exl3 import CB_MCG, CB_MUL1
from exl3_core.quant.exl3.cuda_ops import reconstruct_full_into_cuda
from exl3_core.quant.exl3.linear import EXL3Linear, group_gemm


def _layer(g: torch.Generator, k: int, n: int, K: int, cb: int) -> EXL3Linear:
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=torch.int16, generator=g)
    suh = (torch.randn(k, generator=g).sign() * (0.5 + torch.rand(k, generator=g))).half()
    svh = (torch.randn(n, generator=g).sign() * (0.01 + 0.04 * torch.rand(n, generator=g))).half()
    return EXL3Linear(trellis, suh, svh, cb, k, n)


def test_group_gemm_matches_each_layer() -> None:
    g = torch.Generator().manual_seed(3)
    lins = [_layer(g, 256, 384, 4, CB_MUL1), _layer(g, 256, 128, 2, CB_MCG), _layer(g, 256, 256, 3, CB_MUL1)]
    x = torch.randn(70, 256, generator=g).half()
    outs = group_gemm(x, lins)
    assert [o.shape for o in outs] == [(70, 384), (70, 128), (70, 256)]
    for o, lay in zip(outs, lins, strict=True):
        want = lay(x.float())  # fp32 reference path
        err = ((o.double() - want.double()).norm() / want.double().norm()).item()
        assert err < 3e-3, err


def test_into_rejects_a_wrong_view() -> None:
    g = torch.Generator().manual_seed(4)
    lay = _layer(g, 128, 256, 2, CB_MUL1)
    with pytest.raises(ValueError, match=r"fp16 or bf16 \[128, 256\]"):
        reconstruct_full_into_cuda(lay.trellis, lay.suh, lay.svh, 2, CB_MUL1, torch.empty(128, 128).half())
    with pytest.raises(ValueError, match="fp16"):
        reconstruct_full_into_cuda(lay.trellis, lay.suh, lay.svh, 2, CB_MUL1, torch.empty(128, 256))
    out = torch.full((128, 512), float("nan")).half()
    reconstruct_full_into_cuda(lay.trellis, lay.suh, lay.svh, 2, CB_MUL1, out[:, 128:384])
    assert not out[:, 128:384].isnan().any() and out[:, :128].isnan().all() and out[:, 384:].isnan().all()
    # bf16 (the bf16 prefill's W): the fp16 W converted
    wb = torch.full((128, 256), float("nan"), dtype=torch.bfloat16)
    reconstruct_full_into_cuda(lay.trellis, lay.suh, lay.svh, 2, CB_MUL1, wb)
    assert torch.equal(wb, out[:, 128:384].to(torch.bfloat16))


def test_layers_with_hooks_are_never_grouped() -> None:
    """The converter's input capture hooks the linears: a grouped launch would bypass them."""
    from exl3_core.plan.linears import hooked

    g = torch.Generator().manual_seed(5)
    lays = (_layer(g, 128, 128, 2, CB_MUL1), _layer(g, 128, 256, 2, CB_MUL1))
    assert not hooked(lays)
    h = lays[1].register_forward_pre_hook(lambda mod, inp: None)
    assert hooked(lays)
    h.remove()
    h = lays[0].register_forward_hook(lambda mod, inp, out: None)
    assert hooked(lays)
    h.remove()
    assert not hooked(lays)
