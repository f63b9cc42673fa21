"""Fused ops (exl3_core.ops): each Triton kernel vs its pure-torch reference on fresh random
inputs (run by Triton's CPU interpreter here, on CUDA in tests/gpu), the references vs the
unfused model expressions, and the model taking the fused path when it is enabled."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from exl3_core import ops
from exl3_core.nn.norm import rms_norm as model_rms_norm
from exl3_core.nn.rope import apply_rotary
from exl3_core.reference import fused as ref

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
DTYPES = [torch.float32, torch.float16]


def close(out: torch.Tensor, expect: torch.Tensor) -> None:
    assert out.dtype == expect.dtype and out.shape == expect.shape
    atol, rtol = TOL[out.dtype]
    torch.testing.assert_close(out.float(), expect.float(), atol=atol * max(1.0, expect.abs().max().item()), rtol=rtol)


# -- RMSNorm (+ residual) ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (5, 320), (3, 1000), (2, 64)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_residual(rows: int, hidden: int, dtype: torch.dtype, offset: float) -> None:
    x = (torch.randn(rows, hidden) * 3).to(dtype).to(DEVICE)
    res = torch.randn(rows, hidden).to(dtype).to(DEVICE)
    w = (1 + 0.3 * torch.randn(hidden)).to(DEVICE)  # fp32, as RMSNorm loads it
    normed, new_res = ops.rms_norm_residual(x, res, w, 1e-6, offset, impl="triton")
    r_normed, r_res = ref.rms_norm_residual(x, res, w, 1e-6, offset)
    torch.testing.assert_close(new_res, r_res, atol=0, rtol=0)  # one rounding of the exact sum, both
    close(normed, r_normed)
    # the reference is the unfused model code: x = x + h; norm(x)
    torch.testing.assert_close(r_res, res + x, atol=0, rtol=0)
    torch.testing.assert_close(r_normed, model_rms_norm(res + x, w, 1e-6, offset), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 576), (3, 8, 64), (1, 320)])  # [T, H, D]: per-head q/k norm
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm(shape: tuple[int, ...], dtype: torch.dtype, with_weight: bool) -> None:
    x = torch.randn(*shape).to(dtype).to(DEVICE)
    w = (1 + 0.3 * torch.randn(shape[-1])).to(DEVICE) if with_weight else None
    out = ops.rms_norm(x, w, 1e-5, impl="triton")
    close(out, ref.rms_norm(x, w, 1e-5))
    close(out, model_rms_norm(x, w, 1e-5))


def test_rms_norm_strided_rows() -> None:
    # a row-strided view (slice of a wider buffer) is read in place, not copied wrongly
    buf = torch.randn(6, 700).to(DEVICE)
    x = buf[:, :576]
    w = torch.rand(576).to(DEVICE) + 0.5
    close(ops.rms_norm(x, w, 1e-6, impl="triton"), ref.rms_norm(x, w, 1e-6))


# -- gated activations ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (4, 320), (3, 2500)])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_mul(rows: int, inter: int, dtype: torch.dtype, act: str) -> None:
    gate_up = (torch.randn(rows, 2 * inter) * 2).to(dtype).to(DEVICE)
    g, u = gate_up[:, :inter], gate_up[:, inter:]
    fn = ops.silu_mul if act == "silu" else ops.gelu_tanh_mul
    ref_fn = ref.silu_mul if act == "silu" else ref.gelu_tanh_mul
    expect = ref_fn((g, u))
    close(fn(gate_up, impl="triton"), expect)  # packed [.., 2I]
    close(fn((g.contiguous(), u.contiguous()), impl="triton"), expect)  # separate tensors
    # the reference is the model's activation, computed in fp32
    torch_act = F.silu if act == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
    close(expect, (torch_act(g.float()) * u.float()).to(dtype))


# -- RoPE -------------------------------------------------------------------------------------------

def _cos_sin(T: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.randint(0, 5000, (T,)).float()
    inv = 1.0 / (10000 ** (torch.arange(half).float() / half))
    f = pos[:, None] * inv[None, :]
    return f.cos().to(DEVICE), f.sin().to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("T,hq,hk,d,rot", [(1, 32, 8, 128, 128), (5, 6, 2, 64, 32), (3, 9, 3, 80, 80)])
def test_rope_apply(T: int, hq: int, hk: int, d: int, rot: int, interleaved: bool, dtype: torch.dtype) -> None:
    # q and k as views into one projection buffer (row stride wider than the heads)
    buf = torch.randn(T, (hq + 2 * hk) * d).to(dtype).to(DEVICE)
    q = buf[:, : hq * d].view(T, hq, d)
    k = buf[:, hq * d:(hq + hk) * d].view(T, hk, d)
    v_before = buf[:, (hq + hk) * d:].clone()
    cos, sin = _cos_sin(T, rot // 2)
    q_ref, k_ref = q.clone(), k.clone()
    ref.rope_apply(q_ref, k_ref, cos, sin, rot, interleaved)
    q_model = apply_rotary(q.clone(), cos, sin, rot, interleaved)  # the unfused model code
    ops.rope_apply(q, k, cos, sin, rot, interleaved, impl="triton")
    close(q, q_ref)
    close(k, k_ref)
    close(q_ref, q_model)
    assert torch.equal(buf[:, (hq + hk) * d:], v_before), "rope_apply wrote outside q and k"
    if rot < d:
        assert torch.equal(q[..., rot:], q_ref[..., rot:])  # pass-through channels untouched


# -- paged KV-cache write ---------------------------------------------------------------------------

@pytest.mark.parametrize("cache_dtype,in_dtype", [(torch.float16, torch.float16), (torch.float32, torch.float32),
                                                  (torch.float16, torch.float32)])
@pytest.mark.parametrize("T,hk,d,dv", [(1, 8, 128, 128), (7, 2, 64, 32), (3, 3, 80, 80)])
def test_kv_write(T: int, hk: int, d: int, dv: int, cache_dtype: torch.dtype, in_dtype: torch.dtype) -> None:
    pages, page = 5, 16
    # k and v as column views into one q|k|v projection row (row stride wider than the heads)
    hq = 2 * hk
    buf = torch.randn(T, hq * d + hk * d + hk * dv).to(in_dtype).to(DEVICE)
    k = buf[:, hq * d:(hq + hk) * d].view(T, hk, d)
    v = buf[:, (hq + hk) * d:].view(T, hk, dv)
    slots = torch.randperm(pages * page)[:T]
    slots[0] = pages * page - 1  # the very last slot: a write past the cache would show
    slots = slots.to(DEVICE)
    kc = torch.full((pages, page, hk, d), 7.0, dtype=cache_dtype, device=DEVICE)
    vc = torch.full((pages, page, hk, dv), 7.0, dtype=cache_dtype, device=DEVICE)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref.kv_write(kc_ref, vc_ref, k, v, slots)
    ops.kv_write(kc, vc, k, v, slots, impl="triton")
    torch.testing.assert_close(kc, kc_ref, atol=0, rtol=0)  # a copy with one cast: exact
    torch.testing.assert_close(vc, vc_ref, atol=0, rtol=0)
    flat = kc.view(-1, hk, d)
    torch.testing.assert_close(flat[slots[0]], k[0].to(cache_dtype), atol=0, rtol=0)
    untouched = torch.ones(pages * page, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert (flat[untouched] == 7.0).all() and (vc.view(-1, hk, dv)[untouched] == 7.0).all()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("T,hq,hk,d,rot", [(1, 32, 8, 128, 128), (4, 6, 2, 64, 32), (3, 9, 3, 80, 80)])
def test_rope_kv_write(T: int, hq: int, hk: int, d: int, rot: int, interleaved: bool) -> None:
    """RoPE and the cache write in one launch = rope_apply then kv_write (the reference), q/k/v as
    views into one projection row, the last cache slot among the targets."""
    pages, page = 4, 16
    buf = torch.randn(T, (hq + 2 * hk) * d).half().to(DEVICE)
    q = buf[:, : hq * d].view(T, hq, d)
    k = buf[:, hq * d:(hq + hk) * d].view(T, hk, d)
    v = buf[:, (hq + hk) * d:].view(T, hk, d)
    slots = torch.randperm(pages * page)[:T]
    slots[0] = pages * page - 1
    slots = slots.to(DEVICE)
    cos, sin = _cos_sin(T, rot // 2)
    kc = torch.full((pages, page, hk, d), 7.0, dtype=torch.float16, device=DEVICE)
    vc = kc.clone()
    buf_ref, kc_ref, vc_ref = buf.clone(), kc.clone(), vc.clone()
    q_r = buf_ref[:, : hq * d].view(T, hq, d)
    k_r = buf_ref[:, hq * d:(hq + hk) * d].view(T, hk, d)
    v_r = buf_ref[:, (hq + hk) * d:].view(T, hk, d)
    ref.rope_kv_write(q_r, k_r, v_r, kc_ref, vc_ref, slots, cos, sin, rot, interleaved)
    ops.rope_kv_write(q, k, v, kc, vc, slots, cos, sin, rot, interleaved, impl="triton")
    close(buf, buf_ref)  # q, k rotated in place; v untouched
    assert torch.equal(v, v_r)
    close(kc, kc_ref)
    assert torch.equal(vc, vc_ref)
    untouched = torch.ones(pages * page, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert (kc.view(-1, hk, d)[untouched] == 7.0).all()
    with pytest.raises(ValueError, match="do not fit"):
        ops.rope_kv_write(q, k, v, kc[:, :, :1].contiguous(), vc, slots, cos, sin, rot, interleaved, impl="triton")


def test_kv_write_rejects_mismatched_shapes() -> None:
    kc = torch.zeros(2, 16, 2, 64, device=DEVICE)
    k = torch.zeros(3, 4, 64, device=DEVICE)  # 4 heads for a 2-head cache
    with pytest.raises(ValueError, match="do not fit the caches"):
        ops.kv_write(kc, kc.clone(), k, k.clone(), torch.zeros(3, dtype=torch.long, device=DEVICE), impl="triton")


def test_triton_refused_on_plain_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "_interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        ops.silu_mul(torch.randn(2, 8), impl="triton")


def test_auto_is_torch_on_cpu() -> None:
    # CPU tensors never take the kernels unasked: CPU results stay those of the torch code
    assert not ops.fused_enabled(torch.randn(3))


# -- the model takes the fused path where it is enabled -----------------------------------------------

@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Enable the fused path for CPU tensors (the interpreter runs the kernels) and count kernel calls."""
    if DEVICE == "cpu":
        monkeypatch.setattr(ops, "fused_enabled", lambda t: True)
    k = ops.kernels()
    assert k is not None
    calls: dict[str, int] = {}
    for name in ("rms_norm_residual", "act_mul", "rope_apply", "rope_kv_write"):
        real = getattr(k, name)

        def wrap(*a: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*a, **kw)
        monkeypatch.setattr(k, name, wrap)
    return calls


@pytest.mark.parametrize("hf_arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])  # plain; q/k norm
def test_model_takes_fused_path(hf_arch: str, tmp_path: Path, counted: dict[str, int],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    from exl3_core.archkit import BatchMeta, Config, Model
    from exl3_core.archkit.decoder import StandardDecoder
    from exl3_core.plan import ExecutionPlan
    from exl3_core.testing.arch import build_checkpoint, rel_err, tiny_variants

    variants = tiny_variants(hf_arch)
    cfg = next(iter(variants.values()))
    hf = build_checkpoint(hf_arch, cfg, tmp_path / "ckpt", seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expect = hf(ids).logits.float()
        model = Model.from_config(Config.from_directory(tmp_path / "ckpt")).load(device=DEVICE, dtype=torch.float32)
        plan = ExecutionPlan(model)
        assert isinstance(model, StandardDecoder) and plan.executor is not None and not plan.executor.chain_why
        out = plan.forward(BatchMeta.full(ids.to(DEVICE))).view(*ids.shape, -1).cpu()
        n_layers = len(model.layers)
        # every residual add fused into a norm (2 per layer), the final norm, q/k norms, one RoPE
        # launch and one activation kernel per layer
        assert counted.get("rope_apply") == n_layers and counted.get("act_mul") == n_layers
        assert counted.get("rms_norm_residual", 0) >= 2 * n_layers
        assert rel_err(out, expect) < 1e-4
        # the rows-for-logits path of the chained forward
        rows = torch.tensor([3, 20], device=DEVICE)
        meta = BatchMeta.full(ids.to(DEVICE))
        meta.logits_indices = rows
        sel = plan.forward(meta).cpu()
        assert rel_err(sel, expect.reshape(-1, expect.shape[-1])[rows.cpu()]) < 1e-4
        with_fused = counted.get("rms_norm_residual", 0)
        ops.set_enabled(False)
        try:
            if DEVICE == "cpu":  # the fixture's patch ignores the switch; the plan must honour it
                monkeypatch.setattr(ops, "fused_enabled", lambda t: False)
            ExecutionPlan(model).forward(BatchMeta.full(ids.to(DEVICE)))
        finally:
            ops.set_enabled(True)
        assert counted.get("rms_norm_residual", 0) == with_fused, "fused kernels ran with fused ops off"
        # with a paged cache, RoPE and the cache write are one kernel per layer (prefill and decode)
        from exl3_core.testing.arch import SEQ_LEN, _cache_roundtrip

        if DEVICE == "cpu":
            monkeypatch.setattr(ops, "fused_enabled", lambda t: True)
        ids2 = torch.randint(0, cfg.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(4))
        expect2 = hf(ids2).logits.float()
        assert _cache_roundtrip(model, ids2.to(DEVICE), expect2.to(DEVICE)) < 1e-4
        assert counted.get("rope_kv_write") == 6 * n_layers  # 6 forwards (2 prefill chunks, 4 decode steps)


# -- the decode step's first kernels: embedding lookup with row sums, RoPE tables --------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab,hidden,slots", [(1, 50, 576, 61), (3, 37, 320, 1), (4, 64, 1000, 9)])
@pytest.mark.parametrize("scale", [None, 24.0])
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_embed_ss(rows: int, vocab: int, hidden: int, slots: int, dtype: torch.dtype, scale: float | None,
                  layout: str) -> None:
    """Also over a column-major table (a transposed head's rows), read in place."""
    w = (torch.randn(vocab, hidden) * 0.7).to(dtype).to(DEVICE)
    if layout == "columns":
        w = w.t().contiguous().t()
        assert w.stride() == (1, vocab)
    ids = torch.randint(0, vocab, (rows,)).to(DEVICE)
    garbage = torch.full((slots, rows), float("nan"), device=DEVICE)  # freed memory the op's buffer may reuse
    del garbage
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    h, ss = ops.embed_ss(ids, w, scale, slots, impl="triton")
    if DEVICE == "cuda":  # no copy of the table, whatever its layout
        assert torch.cuda.max_memory_allocated() - before < w.numel() * w.element_size()
    h_ref, ss_ref = ref.embed_ss(ids, w, scale, slots)
    assert h.dtype == dtype and ss.dtype == torch.float32 and ss.shape == (slots, rows)
    assert torch.equal(h, h_ref)  # a lookup and one rounding of the scaled row
    expect = F.embedding(ids, w) if scale is None else F.embedding(ids, w) * scale  # the model's expression
    assert torch.equal(h, expect)
    torch.testing.assert_close(ss[0], ss_ref[0], rtol=1e-5, atol=0)
    assert torch.equal(ss[1:], torch.zeros_like(ss[1:])), "the linears' sums were not zeroed"


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("rows", [1, 5])
def test_embed_ss_carries_ids(impl: str, rows: int) -> None:
    """With ``carry`` the lookup first takes each row's id as ``carry_ids`` does (in place) and embeds that."""
    g = torch.Generator().manual_seed(10 + rows)
    w = (torch.randn(300, 96, generator=g) * 0.7).to(torch.float16).to(DEVICE)
    ids = torch.randint(0, 300, (rows,), generator=g)
    src = torch.randint(0, 300, (rows + 2,), generator=g).double()
    carry = torch.randint(-1, rows + 2, (rows,), generator=g).to(torch.int32)
    carry[0] = rows + 7  # out of range: kept
    want = ids.clone()
    ref.carry_ids(want, carry, src)
    got = ids.to(DEVICE)
    h, ss = ops.embed_ss(got, w, 2.0, 3, carry=(carry.to(DEVICE), src.to(DEVICE)), impl=impl)
    assert torch.equal(got.cpu(), want)
    h_ref, ss_ref = ref.embed_ss(want.to(DEVICE), w, 2.0, 3)
    assert torch.equal(h, h_ref)
    torch.testing.assert_close(ss, ss_ref, rtol=1e-5, atol=0)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("rows,half,factor", [(1, 64, 1.0), (3, 40, 1.2)])
def test_step_start(impl: str, rows: int, half: int, factor: float) -> None:
    """The decode step's first launch: the carried lookup with its sums (``embed_ss``) and the RoPE tables
    (``rope_tables``), each equal to its own op."""
    from exl3_core.nn.rope import _base_inv_freq

    g = torch.Generator().manual_seed(20 + rows)
    w = (torch.randn(300, 96, generator=g) * 0.7).to(torch.float16).to(DEVICE)
    ids = torch.randint(0, 300, (rows,), generator=g)
    src = torch.randint(0, 300, (rows + 1,), generator=g).double()
    carry = torch.randint(-1, rows + 1, (rows,), generator=g).to(torch.int32)
    pos = torch.cat([torch.randint(0, 200_000, (rows - 1,), generator=g), torch.tensor([131_071])]).to(DEVICE)
    inv = _base_inv_freq(500000.0, 2 * half).to(DEVICE)
    want = ids.clone()
    ref.carry_ids(want, carry, src)
    got = ids.to(DEVICE)
    h, ss, cos, sin = ops.step_start(got, w, None, 5, pos, inv, factor, carry=(carry.to(DEVICE), src.to(DEVICE)),
                                     impl=impl)
    assert torch.equal(got.cpu(), want)
    h_ref, ss_ref = ops.embed_ss(want.to(DEVICE), w, None, 5, impl=impl)
    c_ref, s_ref = ops.rope_tables(pos, inv, factor, impl=impl)
    assert torch.equal(h, h_ref) and torch.equal(ss, ss_ref)
    assert torch.equal(cos, c_ref) and torch.equal(sin, s_ref)  # the same operations as rope_tables' kernel
    with pytest.raises(ValueError, match="step_start: want positions"):
        ops.step_start(got, w, None, 5, pos[:0], inv, factor, impl=impl)


def test_embed_ss_rejects_bad_carry() -> None:
    ids = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    w = torch.zeros(4, 8, device=DEVICE)
    src = torch.arange(4, dtype=torch.float64, device=DEVICE)
    for carry in ((torch.zeros(3, dtype=torch.int64, device=DEVICE), src), (torch.zeros(2, dtype=torch.int32,
                                                                                        device=DEVICE), src)):
        with pytest.raises(ValueError, match="embed_ss: want"):
            ops.embed_ss(ids, w, None, 2, carry=carry, impl="triton")
        assert torch.equal(ids, torch.zeros_like(ids))


def test_embed_ss_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="embed_ss"):
        ops.embed_ss(torch.zeros(2, 3, dtype=torch.int64, device=DEVICE), torch.zeros(4, 8, device=DEVICE), None, 3,
                     impl="triton")


@pytest.mark.parametrize("T,half", [(1, 64), (5, 32), (3, 40)])
@pytest.mark.parametrize("factor", [1.0, 1.2])
def test_rope_tables(T: int, half: int, factor: float) -> None:
    from exl3_core.nn.rope import _base_inv_freq

    pos = torch.cat([torch.randint(0, 300_000, (T - 1,)), torch.tensor([131_071])]).to(DEVICE)  # long contexts too
    inv = _base_inv_freq(500000.0, 2 * half).to(DEVICE)
    cos, sin = ops.rope_tables(pos, inv, factor, impl="triton")
    c_ref, s_ref = ref.rope_tables(pos, inv, factor)
    assert cos.shape == sin.shape == (T, half) and cos.dtype == torch.float32
    # precise cos/sin of the same fp32 arguments (1e5 rad and more): within a few fp32 ulps
    torch.testing.assert_close(cos, c_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, s_ref, atol=1e-6, rtol=0)


# -- greedy pick (argmax + numeric-fault flags) ------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 5000), (3, 4096), (2, 9000), (4, 37)])
def test_greedy_pack(rows: int, vocab: int, dtype: torch.dtype) -> None:
    x = torch.randn(rows, vocab).to(dtype)
    if vocab > 4096 + 7:  # ties across the kernel's blocks: the first maximum must win
        x[0, 4096 + 7] = x[0, 3] = x[0].max() + 1
    if rows > 2:
        x[1] = float("-inf")  # no finite logit: flagged
        x[1, vocab // 2] = float("inf")
        x[2, vocab - 1] = float("nan")  # NaN: flagged
    if rows > 3:
        x[3, vocab // 3] = float("inf")  # +inf among finite logits (an fp16 overflow): flagged
    x = x.to(DEVICE)
    for _ in range(2):  # the arrival counters must be clean after a call
        got = ops.greedy_pack(x, impl="triton")
        exp = ref.greedy_pack(x)
        assert got.dtype == torch.float64 and got.shape == (2, rows)
        torch.testing.assert_close(got[1], exp[1], atol=0, rtol=0)
        good = exp[1] == 1
        torch.testing.assert_close(got[0][good], exp[0][good], atol=0, rtol=0)
        assert exp[1, 1:4].tolist() == [0.0] * min(3, rows - 1) if rows > 2 else bool(good.all())
    if vocab > 4096 + 7:
        assert got[0, 0].item() == 3


def test_greedy_pack_rejects_bad_shape() -> None:
    with pytest.raises(ValueError, match="logits must be"):
        ops.greedy_pack(torch.zeros(2, 3, 4, device=DEVICE), impl="triton")


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_greedy_pack_into_out(impl: str) -> None:
    """``out=``: the result lands in the given buffer (a decode graph's static output), equal to a
    fresh call's; a buffer of the wrong shape, dtype or layout is refused and left untouched."""
    x = torch.randn(3, 5000).to(DEVICE)
    out = torch.full((2, 3), -7.0, dtype=torch.float64, device=DEVICE)
    got = ops.greedy_pack(x, out=out, impl=impl)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, ref.greedy_pack(x), atol=0, rtol=0)
    for bad in (torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.float32),
                torch.zeros(3, 2, dtype=torch.float64).t()):
        bad = bad.to(DEVICE)
        before = bad.clone()
        with pytest.raises(ValueError, match="out must be a contiguous float64"):
            ops.greedy_pack(x, out=bad, impl=impl)
        assert torch.equal(bad, before)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_carry_ids(impl: str, rows: int) -> None:
    """Rows with a carry index take the previous step's greedy id at that index (any order, repeats
    allowed), rows with -1 or an index past the source keep their id; against a plain loop."""
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, 50000, (rows,), generator=g)
    src = torch.randint(0, 128256, (rows + 3,), generator=g).double()
    carry = torch.randint(-1, rows + 3, (rows,), generator=g).to(torch.int32)
    carry[0] = rows + 3 + 5  # out of range: kept
    exp = ids.clone()
    for i in range(rows):
        if 0 <= int(carry[i]) < src.shape[0]:
            exp[i] = int(src[int(carry[i])])
    got = ids.to(DEVICE)
    ops.carry_ids(got, carry.to(DEVICE), src.to(DEVICE), impl=impl)
    assert torch.equal(got.cpu(), exp)


def test_carry_ids_rejects_bad_operands() -> None:
    ids = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    carry = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    src = torch.arange(4, dtype=torch.float64, device=DEVICE)
    for args in ((ids.int(), carry, src), (ids, carry.long(), src), (ids, carry, src.float()), (ids, carry[:3], src)):
        before = args[0].clone()
        with pytest.raises(ValueError, match="carry_ids: want"):
            ops.carry_ids(*args, impl="triton")
        assert torch.equal(args[0], before)
