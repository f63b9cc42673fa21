"""o_proj merging the split-KV decode attention's partials in its prologue
(``exl3::exl3_linear_residual_attn``, the ATT variant of csrc/exl3/exl3_fused.cuh): against the torch
merge (``SplitPartials.materialize``) followed by the torch linear, on fresh random partials with empty
splits; its capture-time ATen fallback; and a decode model with the deferred merge against the same model
with the merge in the attention kernel."""
from __future__ import annotations

import pytest
import torch

from exl3_core.attention.spec import SplitPartials
from exl3_core.quant.exl3 import CB_3INST, CB_MCG, CB_MUL1, cuda_ops

DEV = "cuda"


@pytest.fixture(scope="module")
def ops_(exl3_ops):
    if not hasattr(exl3_ops, "exl3_linear_residual_attn"):
        pytest.fail("exl3_core._C predates exl3::exl3_linear_residual_attn; rebuild it")
    return exl3_ops


def problem(k: int, n: int, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=torch.int16, device=DEV)
    sign = torch.randint(0, 2, (k + n,), device=DEV) * 2 - 1
    s = (sign * (0.5 + 1.5 * torch.rand(k + n, device=DEV))).half()
    return t, s[:k] * 0.05, s[k:]


def partials(m: int, heads: int, splits: int, dv: int) -> SplitPartials:
    """Random softmax states: maxima over a wide range (the merge's weights span e^-20..1), sums >= 1 as
    a real split's, value sums of the sum's scale; trailing splits of row 0 empty, and with two rows or
    more every split of row 1's first head (its output is 0)."""
    pm = torch.randn(m, heads, splits, device=DEV) * 5
    pl = torch.rand(m, heads, splits, device=DEV) * 30 + 1
    acc = torch.randn(m, heads, splits, dv, device=DEV) * pl[..., None]
    empty = torch.zeros(m, heads, splits, dtype=torch.bool, device=DEV)
    empty[0, :, splits // 2 + 1:] = True
    if m > 1:
        empty[1, 0] = True
    pm[empty] = float("-inf")
    pl[empty] = 0
    acc[empty] = 0
    return SplitPartials(pm, pl, acc, torch.float16)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def check(ops_, part: SplitPartials, p: tuple[torch.Tensor, ...], cb: int, what: str) -> None:
    m, n = part.acc.shape[0], p[0].shape[1] * 16
    res = (torch.randn(m, n, device=DEV) * 4).half()
    base = torch.rand(m + 1, device=DEV)
    ss = base.clone()
    y = ops_.exl3_linear_residual_attn(part.m, part.l, part.acc, p[0], p[1], p[2], cb, res, ss)
    x = part.materialize().reshape(m, -1)
    want = res.double() + cuda_ops._fallback_linear(x, p[0], p[1], p[2], cb).double()
    assert y.dtype == torch.float16 and y.shape == (m, n) and not y.isnan().any(), what
    assert rel(y, want) < 2e-3, f"{what}: {rel(y, want):.2e} against the torch merge + linear"
    # the same kernel on the torch-merged x: only the merge's fp32 order and exp differ (an fp16 rounding of x
    # flips now and then)
    ss2 = base.clone()
    y2 = ops_.exl3_linear_residual(x, None, 0, p[0], p[1], p[2], cb, res, ss2)
    assert rel(y, y2) < 5e-4, f"{what}: {rel(y, y2):.2e} against exl3_linear_residual on the merged x"
    want_ss = base[:m].double() + y.double().pow(2).sum(-1)
    assert torch.allclose(ss[:m].double(), want_ss, rtol=1e-4), f"{what}: ss"
    assert ss[m] == base[m], f"{what}: ss beyond the rows was written"


@pytest.mark.parametrize("mode", [2, 0], ids=["predecode", "plain"])
@pytest.mark.parametrize("K,cb", [(4, CB_MUL1), (2, CB_3INST), (6, CB_MCG)])
@pytest.mark.parametrize("dv,heads", [(64, 32), (128, 12)])
def test_merge_in_prologue_matches_torch(ops_, mode: int, K: int, cb: int, dv: int, heads: int) -> None:
    """Rows 1, 3 and 8; 1 to 32 splits (32 = 8 per warp: the unrolled loop and its remainder); the
    pre-decoding variant and the plain transposed one (``set_predecode``)."""
    k = heads * dv
    p = problem(k, 1024, K)
    prev = ops_.set_predecode(mode)
    try:
        for m, splits in ((1, 16), (1, 1), (3, 5), (8, 32), (2, 7)):
            check(ops_, partials(m, heads, splits, dv), p, cb, f"m={m} splits={splits}")
    finally:
        ops_.set_predecode(prev)
    z, counters = ops_.exl3_linear_workspace(torch.empty(1, device=DEV))
    assert z.count_nonzero().item() == 0 and counters.count_nonzero().item() == 0, "fused workspace left dirty"


def test_capture_fallback_matches_torch(ops_) -> None:
    """Captured while its fused workspace would have to grow, the op takes its ATen path (the merge with
    ATen, the chain, the add and the sums); replayed, it equals the torch reference."""
    heads, dv, splits = 8, 64, 6
    cap = ops_.exl3_linear_workspace(torch.empty(1, device=DEV))[1].numel() * 128
    n = max(1 << 18, cap + 1024)  # more columns than any call so far in this process
    p = problem(heads * dv, n, 2)
    part = partials(2, heads, splits, dv)
    res = torch.randn(2, n, device=DEV).half()
    ss = torch.zeros(2, device=DEV)
    x = part.materialize().reshape(2, -1)
    # what the fallback runs, once eagerly before the capture (as the generator warms every bucket)
    ops_.had128(ops_.exl3_gemm_xh(ops_.had128(x, p[1], None, True), p[0], 2, CB_MUL1), None, p[2], True)
    (res[:, :128].float() + 1).half().float().pow(2).sum(-1)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = ops_.exl3_linear_residual_attn(part.m, part.l, part.acc, p[0], p[1], p[2], CB_MUL1, res, ss)
    ss.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert ops_.exl3_linear_workspace(torch.empty(1, device=DEV))[1].numel() * 128 == cap, "grew during capture"
    want = res.double() + cuda_ops._fallback_linear(x, p[0], p[1], p[2], CB_MUL1).double()
    assert rel(y, want) < 2e-3, f"{rel(y, want):.2e}"
    assert torch.allclose(ss.double(), y.double().pow(2).sum(-1), rtol=1e-4)


def test_python_side_refuses_what_the_op_cannot_take() -> None:
    """Checked before the call (a TORCH_CHECK thrown inside exl3_core._C crashes the process on the
    device image): more than 8 rows, an fp32 stream, a width that is not o_proj's input, a gate."""
    from exl3_core.quant.exl3.linear import EXL3Linear, linear_residual, partials_fusable

    t, su, sv = problem(256, 256, 4)
    lin = EXL3Linear(t, su, sv, CB_MUL1, 256, 256)
    res = torch.randn(1, 256, device=DEV).half()
    assert partials_fusable(lin, 1, 256, res)
    assert partials_fusable(lin, 8, 256, torch.randn(8, 256, device=DEV).half())
    assert not partials_fusable(lin, 9, 256, torch.randn(9, 256, device=DEV).half())
    assert not partials_fusable(lin, 1, 256, res.float())
    assert not partials_fusable(lin, 1, 128, res)
    part = partials(1, 4, 3, 64)
    with pytest.raises(ValueError, match="without a gate"):
        linear_residual(lin, part, res, torch.zeros(1, device=DEV), gate=res, act="silu")


# ---------------------------------------------------------------- a decode model, merge deferred vs not

@pytest.fixture(scope="module")
def model_cache():
    from exl3_core.bench.models import bench_plugins, build_model, parse_shape

    model, cache = build_model(parse_shape("custom(512,1024,3,8,2,2000)"), bpw=4.0, head_bits=6, device="cuda",
                               cache_tokens=2048, page_size=64, plugins=bench_plugins())
    yield model, cache
    model.unload()


def _greedy(model, cache, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    from exl3_core.generator import Generator, Job

    gen = Generator(model, cache, None, max_batch_size=1, max_seq_len=512)
    gen.graphs = None  # eager: each setting's path is taken by the forward itself
    gen.enqueue([Job(prompt, max_new_tokens=n, stop_at_eos=False, identifier=0, return_logits=True)])
    ids: list[int] = []
    lg: list[torch.Tensor] = []
    while gen.num_remaining():
        for r in gen.iterate():
            ids += r["token_ids"]
            if len(r.get("logits", [])):
                lg.append(r["logits"])
    return ids, torch.cat(lg)


def test_decode_with_merge_in_o_proj_equals_merge_in_attention(ops_, model_cache, monkeypatch) -> None:
    """b=1 greedy decode (32 steps) with o_proj merging the partials equals the split kernel's own merge:
    logits within fp16 tolerance until a near-tie; the deferred path ran on every decode step of every
    layer, and with PARTIALS_MAX_ROWS = 0 never."""
    import exl3_core.nn.attention as att

    model, cache = model_cache
    prompt = torch.randint(0, 2000, (57,), generator=torch.Generator().manual_seed(3)).tolist()
    taken = {"partials": 0}
    real = att.linear_residual

    def count(layer, x, *a, **kw):
        taken["partials"] += isinstance(x, SplitPartials)
        return real(layer, x, *a, **kw)

    monkeypatch.setattr(att, "linear_residual", count)
    monkeypatch.setattr(att, "PARTIALS_MAX_ROWS", 1)
    deferred = _greedy(model, cache, prompt, 32)
    assert taken["partials"] >= 31 * 3, taken  # 3 layers, every step after the prefill
    monkeypatch.setattr(att, "PARTIALS_MAX_ROWS", 0)
    taken["partials"] = 0
    merged = _greedy(model, cache, prompt, 32)
    assert taken["partials"] == 0
    (ta, la), (tb, lb) = deferred, merged
    n = next((i for i in range(32) if ta[i] != tb[i]), 32)
    if n < 32:  # a parting is allowed only at a near-tie of the top two logits
        top = lb[n].float().topk(2).values
        assert top[0] - top[1] <= 1e-2 * lb[n].abs().max(), f"parted at step {n} with a clear margin"
    assert n > 0
    err = ((la[:n] - lb[:n]).abs().max() / lb[:n].abs().max()).item()
    assert err < 1e-2, f"logits differ by {err:.2e} (relative to the max)"
