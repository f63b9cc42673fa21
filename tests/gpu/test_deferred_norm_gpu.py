"""The fused linear's extras: the residual add and row sums of squares in one EXL3 linear's epilogue
(``exl3::exl3_linear_residual``), the norm in the next one's prologue and attention's RoPE + KV write in
q/k/v's epilogue (``exl3::exl3_linear_group_ex``), against pure-torch references on fresh random
inputs; the plan's rules for when it launches them; a decode model with all of them against the same
model with separate kernels (a tuning with the deferred norms and the q/k/v epilogue off)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from exl3_core.quant.exl3 import CB_3INST, CB_MCG, CB_MUL1, cuda_ops
from exl3_core.reference import fused as ref
from exl3_core.testing.kernels import assert_workspace_clean as workspace_clean
from exl3_core.testing.kernels import random_exl3_problem
from exl3_core.testing.kernels import rel_error as rel
from exl3_core.tuning import FusionTuning, GraphTuning, Tuning

DEV = "cuda"
NO_ROPE = (None, None, False, [], None, [])  # exl3_linear_group_ex's RoPE/cache arguments, unused


@pytest.fixture(scope="module")
def ops_(exl3_ops):
    if not hasattr(exl3_ops, "exl3_linear_group_ex"):
        pytest.fail("exl3_core._C predates exl3::exl3_linear_group_ex; rebuild it")
    return exl3_ops


def problem(k: int, n: int, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return random_exl3_problem(k, n, K, DEV)


def torch_linear(x: torch.Tensor, p: tuple[torch.Tensor, torch.Tensor, torch.Tensor], cb: int) -> torch.Tensor:
    return cuda_ops._fallback_linear(x, p[0], p[1], p[2], cb)  # fp32 spec 4.3 with torch ops only


@pytest.mark.parametrize("K,cb", [(4, CB_MUL1), (2, CB_3INST), (6, CB_MCG), (8, CB_MUL1)])
@pytest.mark.parametrize("weight", ["none", "w", "w+1"])
def test_group_norm_matches_reference(ops_, K: int, cb: int, weight: str) -> None:
    """``linear_group_ex(h, ss)`` = each linear of ``rms_norm(h)`` (fp32 torch), ss = Σ h² per row."""
    k = 1024
    probs = [problem(k, n, K) for n in (512, 256, 256)]
    w = None if weight == "none" else (torch.rand(k, device=DEV) + 0.5)
    offset = 1.0 if weight == "w+1" else 0.0
    for m in (1, 3, 16):
        for count in (1, 3):
            h = (torch.randn(m, k, device=DEV) * 3).half()
            ss = torch.zeros(m + 2, device=DEV)
            ss[:m] = h.float().pow(2).sum(-1)
            ys = ops_.exl3_linear_group_ex(h, [p[0] for p in probs[:count]], [p[1] for p in probs[:count]],
                                           [p[2] for p in probs[:count]], cb, ss, w, 1e-5, offset, *NO_ROPE)
            x = ref.rms_norm(h, w, 1e-5, offset)
            for i, (y, p) in enumerate(zip(ys, probs)):
                want = torch_linear(x, p, cb)
                assert y.shape == want.shape and not y.isnan().any()
                assert rel(y, want) < 2e-3, f"m={m} count={count} problem {i}: {rel(y, want):.2e}"
    workspace_clean(ops_)


@pytest.mark.parametrize("act", [None, "silu", "gelu_tanh"])
@pytest.mark.parametrize("K,cb", [(4, CB_MUL1), (3, CB_MCG)])
def test_linear_residual_matches_reference(ops_, K: int, cb: int, act: str | None) -> None:
    """``linear_residual`` = res + linear(x) (or of act(gate) * x), rounded once to fp16 after the
    add, and adds Σ y² per row into ss (on top of what is there)."""
    from exl3_core.ops import ACT_CODES

    k, n = 1536, 1024
    p = problem(k, n, K)
    for m in (1, 4, 16):
        x = torch.randn(m, k, device=DEV).half()
        gate = torch.randn(m, k, device=DEV).half() * 2 if act else None
        res = (torch.randn(m, n, device=DEV) * 4).half()
        base = torch.rand(m + 1, device=DEV)
        ss = base.clone()
        y = ops_.exl3_linear_residual(x, gate, ACT_CODES[act] if act else 0, p[0], p[1], p[2], cb, res, ss)
        xin = x if act is None else (ref.silu_mul if act == "silu" else ref.gelu_tanh_mul)(gate, x)
        want = res.double() + torch_linear(xin, p, cb).double()
        assert y.dtype == torch.float16 and y.shape == (m, n) and not y.isnan().any()
        assert rel(y, want) < 2e-3, f"m={m}: {rel(y, want):.2e}"
        want_ss = base[:m].double() + y.double().pow(2).sum(-1)
        assert torch.allclose(ss[:m].double(), want_ss, rtol=1e-4), f"m={m}: ss {ss[:m]} vs {want_ss}"
        assert ss[m] == base[m], "ss beyond the rows was written"
    workspace_clean(ops_)


def test_producer_consumer_chain(ops_) -> None:
    """Producer then consumer as a decoder runs them: h = res + down(x) with ss, then q/k/v of
    rms_norm(h) from ss alone, against the norm computed from h by the reference."""
    k, n = 1024, 2048
    down, q = problem(k, n, 4), problem(n, 512, 4)
    x, res = torch.randn(2, k, device=DEV).half(), torch.randn(2, n, device=DEV).half()
    w = torch.rand(n, device=DEV) + 0.5
    ss = torch.zeros(2, device=DEV)
    h = ops_.exl3_linear_residual(x, None, 0, down[0], down[1], down[2], CB_MUL1, res, ss)
    (y,) = ops_.exl3_linear_group_ex(h, [q[0]], [q[1]], [q[2]], CB_MUL1, ss, w, 1e-6, 0.0, *NO_ROPE)
    want = torch_linear(ref.rms_norm(h, w, 1e-6), q, CB_MUL1)
    assert rel(y, want) < 2e-3


def rope_case(m: int, hd: int, hkv: int, pages: int, page: int) -> tuple[torch.Tensor, ...]:
    """RoPE tables of m random positions, m distinct random cache slots, and k/v caches filled with 7.0 (so that
    what the epilogue did not store stays visible)."""
    pos = torch.randint(0, 4000, (m,), device=DEV).float()
    inv = 1.0 / (10000 ** (torch.arange(hd // 2, device=DEV).float() / (hd // 2)))
    cos, sin = (pos[:, None] * inv[None]).cos(), (pos[:, None] * inv[None]).sin()
    slots = torch.randperm(pages * page, device=DEV)[:m]
    kc = torch.full((pages, page, hkv, hd), 7.0, dtype=torch.float16, device=DEV)
    return cos, sin, slots, kc, kc.clone()


@pytest.mark.parametrize("hd,interleaved", [(128, False), (64, False), (64, True), (32, False)])
@pytest.mark.parametrize("deferred", [False, True])
def test_qkv_epilogue_matches_reference(ops_, hd: int, interleaved: bool, deferred: bool) -> None:
    """q/k/v with RoPE and the paged KV write in the epilogue = the linears (fp32 torch, rounded to
    fp16), then the RoPE and cache-write references; only the slots given are written."""
    k, pages, page = 512, 4, 16
    hq, hkv = (8, 4) if hd == 32 else (4, 2)  # k and v widths stay multiples of 128 (EXL3 pads to 128)
    probs = [problem(k, hq * hd, 4), problem(k, hkv * hd, 4), problem(k, hkv * hd, 4)]
    for m in (1, 3):
        h = torch.randn(m, k, device=DEV).half()
        w = torch.rand(k, device=DEV) + 0.5
        ss = h.float().pow(2).sum(-1) if deferred else None
        cos, sin, slots, kc, vc = rope_case(m, hd, hkv, pages, page)
        ys = ops_.exl3_linear_group_ex(h, [p[0] for p in probs], [p[1] for p in probs], [p[2] for p in probs],
                                       CB_MUL1, ss, w if deferred else None, 1e-6, 0.0, cos, sin, interleaved,
                                       [1, 1, 0], slots, [None, kc, vc])
        x = ref.rms_norm(h, w, 1e-6) if deferred else h
        q, kk, v = (torch_linear(x, p, CB_MUL1).half() for p in probs)
        q, kk, v = q.view(m, hq, hd), kk.view(m, hkv, hd), v.view(m, hkv, hd)
        kc_ref, vc_ref = torch.full_like(kc, 7.0), torch.full_like(vc, 7.0)
        ref.rope_kv_write(q, kk, v, kc_ref, vc_ref, slots, cos, sin, hd, interleaved)
        for got, want, what in ((ys[0], q, "q"), (ys[1], kk, "k"), (ys[2], v, "v")):
            assert rel(got.view(want.shape), want) < 2e-3, f"m={m} {what}: {rel(got.view(want.shape), want):.2e}"
        flat_k, flat_v = kc.view(-1, hkv, hd), vc.view(-1, hkv, hd)
        assert rel(flat_k[slots], kc_ref.view(-1, hkv, hd)[slots]) < 2e-3
        assert rel(flat_v[slots], vc_ref.view(-1, hkv, hd)[slots]) < 2e-3
        assert torch.equal(flat_k[slots], ys[1].view(m, hkv, hd)), "the cache holds other values than k"
        untouched = torch.ones(pages * page, dtype=torch.bool, device=DEV)
        untouched[slots] = False
        assert (flat_k[untouched] == 7.0).all() and (flat_v[untouched] == 7.0).all()
    workspace_clean(ops_)


def test_qkv_epilogue_stores_unpadded_widths(ops_) -> None:
    """q/k/v of SmolLM2's widths (9 and 3 heads of 64: 576 and 192 columns, padded to 640 and 256): the epilogue
    rotates them and stores k and v into cache slots of 192 values (``cache_widths``), their padding columns
    neither stored nor spilling into the next slot; a width the kernel cannot store is refused."""
    hd, hq, hkv, k, pages, page = 64, 9, 3, 512, 4, 16
    widths = [hq * hd, hkv * hd, hkv * hd]
    probs = [problem(k, 640, 4), problem(k, 256, 4), problem(k, 256, 4)]
    for m in (1, 3, 8):
        h = torch.randn(m, k, device=DEV).half()
        cos, sin, slots, kc, vc = rope_case(m, hd, hkv, pages, page)
        ys = ops_.exl3_linear_group_ex(h, [p[0] for p in probs], [p[1] for p in probs], [p[2] for p in probs],
                                       CB_MUL1, None, None, 1e-6, 0.0, cos, sin, False, [1, 1, 0], slots,
                                       [None, kc, vc], [], widths)
        q, kk, v = (torch_linear(h, p, CB_MUL1).half()[:, :w] for p, w in zip(probs, widths))
        q, kk, v = q.reshape(m, hq, hd), kk.reshape(m, hkv, hd), v.reshape(m, hkv, hd)
        kc_ref, vc_ref = torch.full_like(kc, 7.0), torch.full_like(vc, 7.0)
        ref.rope_kv_write(q, kk, v, kc_ref, vc_ref, slots, cos, sin, hd, False)
        for got, want, w, what in ((ys[0], q, widths[0], "q"), (ys[1], kk, widths[1], "k"), (ys[2], v, widths[2], "v")):
            err = rel(got[:, :w].reshape(want.shape), want)
            assert err < 2e-3, f"m={m} {what}: {err:.2e}"
        flat_k, flat_v = kc.view(-1, hkv, hd), vc.view(-1, hkv, hd)
        assert rel(flat_k[slots], kc_ref.view(-1, hkv, hd)[slots]) < 2e-3
        assert rel(flat_v[slots], vc_ref.view(-1, hkv, hd)[slots]) < 2e-3
        assert torch.equal(flat_k[slots], ys[1][:, :widths[1]].reshape(m, hkv, hd)), "the cache holds other than k"
        untouched = torch.ones(pages * page, dtype=torch.bool, device=DEV)
        untouched[slots] = False
        assert (flat_k[untouched] == 7.0).all() and (flat_v[untouched] == 7.0).all()
    with pytest.raises(RuntimeError, match="within 128"):
        ops_.exl3_linear_group_ex(h, [p[0] for p in probs], [p[1] for p in probs], [p[2] for p in probs], CB_MUL1,
                                  None, None, 1e-6, 0.0, cos, sin, False, [1, 1, 0], slots, [None, kc, vc], [],
                                  [576, 100, 192])
    workspace_clean(ops_)


def test_capture_time_fallbacks_match_references(ops_) -> None:
    """An op whose fused workspace would have to grow while a CUDA graph is being captured takes its
    ATen path instead (exl3_ops.cu, fused_workspace): for ``linear_residual`` the chain, the add and
    the sums; for ``linear_group_ex`` the norm, the chain, RoPE and ``index_copy_`` into the caches.
    Both, captured and replayed, equal the references, and the workspace did not grow."""
    k, hd, hkv = 256, 128, 8
    cap = ops_.exl3_linear_workspace(torch.empty(1, device=DEV))[1].numel() * 128  # columns it covers now
    n_res = max(1 << 18, cap + 1024)  # more columns than any call so far in this process
    n_q = n_res + 1024
    pr = problem(k, n_res, 2)
    probs = [problem(k, n_q, 2), problem(k, hkv * hd, 2), problem(k, hkv * hd, 2)]
    x, res = torch.randn(2, k, device=DEV).half(), torch.randn(2, n_res, device=DEV).half()
    h = (torch.randn(2, k, device=DEV) * 3).half()
    w = torch.rand(k, device=DEV) + 0.5
    ss_h = h.float().pow(2).sum(-1)
    ss = torch.zeros(2, device=DEV)
    pos = torch.tensor([5.0, 3000.0], device=DEV)
    inv = 1.0 / (10000 ** (torch.arange(hd // 2, device=DEV).float() / (hd // 2)))
    cos, sin = (pos[:, None] * inv[None]).cos(), (pos[:, None] * inv[None]).sin()
    slots = torch.tensor([17, 2], device=DEV)
    kc = torch.full((4, 16, hkv, hd), 7.0, dtype=torch.float16, device=DEV)
    vc = kc.clone()
    # the fallbacks' kernels run once eagerly first, as a CUDA-graph capture needs (the generator runs
    # every bucket eagerly before capturing it): the unfused chain at these m, K and codebook, and the
    # torch ops of the norm, the add and RoPE
    xh = ops_.had128(x, pr[1], None, True)
    ops_.had128(ops_.exl3_gemm_xh(xh, pr[0], 2, CB_MUL1), None, pr[2], True)
    (res[:, :128].float() + 1).half().float().pow(2).sum(-1)
    ref.rms_norm(h, w, 1e-6)
    ref.rope_kv_write(*(torch.zeros(2, hkv, hd, device=DEV).half() for _ in range(3)), torch.zeros_like(kc),
                      torch.zeros_like(vc), slots, cos, sin, hd, False)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = ops_.exl3_linear_residual(x, None, 0, pr[0], pr[1], pr[2], CB_MUL1, res, ss)
        ys = ops_.exl3_linear_group_ex(h, [p[0] for p in probs], [p[1] for p in probs], [p[2] for p in probs],
                                       CB_MUL1, ss_h, w, 1e-6, 0.0, cos, sin, False, [1, 1, 0], slots, [None, kc, vc])
    ss.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert ops_.exl3_linear_workspace(torch.empty(1, device=DEV))[1].numel() * 128 == cap, "grew during capture"
    want = res.double() + torch_linear(x, pr, CB_MUL1).double()
    assert rel(y, want) < 2e-3, f"residual: {rel(y, want):.2e}"
    assert torch.allclose(ss.double(), y.double().pow(2).sum(-1), rtol=1e-4)
    xn = ref.rms_norm(h, w, 1e-6)
    q, kk, v = (torch_linear(xn, p, CB_MUL1).half() for p in probs)
    q, kk, v = q.view(2, -1, hd), kk.view(2, hkv, hd), v.view(2, hkv, hd)
    kc_ref, vc_ref = torch.full_like(kc, 7.0), torch.full_like(vc, 7.0)
    ref.rope_kv_write(q, kk, v, kc_ref, vc_ref, slots, cos, sin, hd, False)
    for got, want_, what in ((ys[0], q, "q"), (ys[1], kk, "k"), (ys[2], v, "v")):
        assert rel(got.view(want_.shape), want_) < 2e-3, f"{what}: {rel(got.view(want_.shape), want_):.2e}"
    assert rel(kc.view(-1, hkv, hd)[slots], kc_ref.view(-1, hkv, hd)[slots]) < 2e-3
    assert rel(vc.view(-1, hkv, hd)[slots], vc_ref.view(-1, hkv, hd)[slots]) < 2e-3
    untouched = torch.ones(64, dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert (kc.view(-1, hkv, hd)[untouched] == 7.0).all()


def test_plan_launches_only_what_the_ops_can_take(counting_kernels) -> None:
    """The plan checks before it calls the ops (a TORCH_CHECK thrown inside exl3_core._C crashes the process on
    the device image; tests/gpu/test_exl3_kernels.py): a residual producer (:class:`ResidualOut`) or a deferred
    norm's consumer (:class:`Projection`) launches only on inputs its kernel takes and falls back otherwise,
    with the same result either way."""
    from exl3_core.nn.norm import RMSNorm
    from exl3_core.plan.linears import DeferredNorm, Projection, ResidualOut, add_residual_ss
    from exl3_core.quant.exl3.linear import EXL3Linear, launch_residual

    dev = torch.device("cuda", torch.cuda.current_device())
    tuning = Tuning.h200()
    max_rows = tuning.kernels.fused_linear_max_rows
    t, su, sv = problem(256, 256, 4)
    lin = EXL3Linear(t, su, sv, CB_MUL1, 256, 256)
    kernels = counting_kernels()
    out = ResidualOut("down", lin, tuning, dev, kernels, act="silu")
    assert out.why == [] and out.gate_ok

    def residual_launched(x: torch.Tensor, res: torch.Tensor, gate: torch.Tensor | None = None) -> bool:
        """Whether ``out.run`` took the launch; either way its result is the reference's."""
        before = sum(kernels.calls.values())
        ss = torch.zeros(x.shape[0], device=DEV)
        inp = x if gate is None else ref.silu_mul(gate, x)
        y = out.run(x, res, ss, lambda: lin(inp).to(res.dtype)[..., : res.shape[-1]], gate=gate,
                    act_mul=ref.silu_mul)
        want = add_residual_ss(res, lin(inp).to(res.dtype)[..., : res.shape[-1]], torch.zeros_like(ss))
        assert rel(y, want) < 2e-3 and torch.allclose(ss.double(), y.double().pow(2).sum(-1), rtol=1e-3)
        return sum(kernels.calls.values()) > before

    x, res = torch.randn(1, 256, device=DEV).half(), torch.randn(1, 256, device=DEV).half()
    assert residual_launched(x, res)
    assert not residual_launched(x, res.float())  # fp32 stream
    assert not residual_launched(x, res[:, :128].contiguous())  # residual narrower than the output
    big = torch.randn(max_rows, 256, device=DEV).half()
    assert residual_launched(big, torch.randn(max_rows, 256, device=DEV).half())
    big = torch.randn(max_rows + 1, 256, device=DEV).half()  # past the one-launch linear's rows
    assert not residual_launched(big, torch.randn(max_rows + 1, 256, device=DEV).half())
    assert residual_launched(x, res, gate=torch.randn(1, 256, device=DEV).half())
    assert kernels.calls.get("residual_gated") == 1
    before = dict(kernels.calls)  # a gate not shaped like x: the plain path, whatever plain() computes
    y = out.run(x, res, torch.zeros(1, device=DEV), lambda: torch.zeros_like(res),
                gate=torch.randn(1, 128, device=DEV).half(), act_mul=ref.silu_mul)
    assert kernels.calls == before and torch.equal(y, res)
    with pytest.raises(ValueError, match="needs act in"):
        launch_residual(lin, x, res, torch.zeros(1, device=DEV), gate=x, act=None)

    norm = RMSNorm("n", 256, 1e-6)
    norm.weight = torch.rand(256, device=DEV) + 0.5
    proj = Projection("q", (lin,), tuning, dev, kernels)
    assert proj.launch_why == []

    def prologue_launched(d: DeferredNorm) -> bool:
        before = kernels.calls.get("norm_prologue", 0)
        (y,) = proj.run(d)
        assert rel(y, lin(norm(d.h))) < 2e-3
        return kernels.calls.get("norm_prologue", 0) > before

    ss = x.float().pow(2).sum(-1)
    assert prologue_launched(DeferredNorm(x, norm, ss))
    assert not prologue_launched(DeferredNorm(x, norm, ss.half()))  # fp16 sums
    norm.weight = norm.weight.half()
    assert not prologue_launched(DeferredNorm(x, norm, ss))  # the kernel reads an fp32 weight


# ---------------------------------------------------------------- a decode model, deferred vs norm kernels

SHAPE = "custom(512,1024,3,8,2,2000)"


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_decode_with_fused_extras_equals_separate_kernels(ops_, shape_model_cache, batch: int,
                                                          monkeypatch,
                                                          greedy_with_logits) -> None:
    """Greedy decode (32 steps) with the norms deferred into the linears and RoPE + KV write in q/k/v's
    epilogue equals the chain with separate kernels (``FusionTuning(deferred_norm=False,
    qkv_epilogue=False)``): logits within fp16 tolerance until a near-tie, and the fused paths actually ran
    with the first tuning and not with the second."""
    import exl3_core.ops as eops
    import exl3_core.plan.kernels as plan_kernels

    model, cache = shape_model_cache
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 2000, (int(n),), generator=g).tolist() for n in torch.randint(10, 80, (batch,), generator=g)]

    calls = {"norm": 0, "res": 0, "qkv": 0, "embed": 0}
    real_ex, real_res = plan_kernels.launch_group_ex, plan_kernels.launch_residual
    real_embed, real_start = eops.embed_ss, eops.step_start

    def count_ex(h2, lins, norm=None, epilogue=None):
        calls["norm"] += norm is not None
        calls["qkv"] += epilogue is not None
        return real_ex(h2, lins, norm, epilogue)

    def count_res(*a, **kw):
        calls["res"] += 1
        return real_res(*a, **kw)

    def count_embed(*a, **kw):  # the lookup that also hands the first norm its sums
        calls["embed"] += 1
        return real_embed(*a, **kw)

    def count_start(*a, **kw):  # the same, with the step's RoPE tables in the launch
        calls["embed"] += 1
        return real_start(*a, **kw)

    # the compiled kernels' entry points as the plan calls them (exl3_core.plan.kernels.CompiledKernels)
    monkeypatch.setattr(plan_kernels, "launch_group_ex", count_ex)
    monkeypatch.setattr(plan_kernels, "launch_residual", count_res)
    monkeypatch.setattr(eops, "embed_ss", count_embed)
    monkeypatch.setattr(eops, "step_start", count_start)
    base = Tuning.for_device(model.device)
    # eager steps: no capture needed for the comparison
    base = dataclasses.replace(base, graphs=GraphTuning(enabled=False))
    fused = dataclasses.replace(base, fusion=FusionTuning(deferred_norm=True, qkv_epilogue=True))
    deferred = greedy_with_logits(model, cache, prompts, 32, fused)
    assert calls["norm"] > 0 and calls["res"] > 0 and calls["qkv"] > 0 and calls["embed"] > 0, calls
    separate = dataclasses.replace(base, fusion=FusionTuning(deferred_norm=False, qkv_epilogue=False))
    before = dict(calls)
    plain = greedy_with_logits(model, cache, prompts, 32, separate)
    assert calls == before, "a tuning with deferred_norm=False, qkv_epilogue=False still took the fused paths"
    for (ta, la), (tb, lb) in zip(deferred, plain):
        n = next((i for i in range(32) if ta[i] != tb[i]), 32)
        if n < 32:  # a parting is allowed only at a near-tie of the top two logits
            top = lb[n].float().topk(2).values
            assert top[0] - top[1] <= 1e-2 * lb[n].abs().max(), f"parted at step {n} with a clear margin"
        assert n > 0
        err = ((la[:n] - lb[:n]).abs().max() / lb[:n].abs().max()).item()
        assert err < 1e-2, f"logits differ by {err:.2e} (relative to the max)"
