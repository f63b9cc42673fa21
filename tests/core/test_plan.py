"""The execution plan on CPU: every form it picks computes the reference forward, it declines what it does
not know (with reasons), and its per-step choices (deferred norms, last-row pruning, bf16 prefill, carried
ids) follow their rules. The fused CUDA kernels themselves are tested in tests/gpu."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from exl3_core import ops
from exl3_core.archkit.batch import BatchMeta
from exl3_core.archkit.decoder import DecoderBlock
from exl3_core.bench.models import build_model, parse_shape
from exl3_core.nn.attention import Attention
from exl3_core.nn.module import ForwardState
from exl3_core.plan import ExecutionPlan
from exl3_core.plan.linears import DeferredNorm, add_residual_ss
from exl3_core.testing.kernels import EmulatedKernels
from exl3_core.tuning import FusionTuning, Tuning

PAGE = 16


def _model(dtype: torch.dtype = torch.float16, cache_tokens: int = 0, layers: int = 2, seed: int = 3):
    return build_model(parse_shape(f"custom(128,256,{layers},4,2,300)"), device="cpu", dtype=dtype, seed=seed,
                       cache_tokens=cache_tokens, page_size=PAGE)


def _paged_meta(lens: list[int], past: list[int], pages: list[list[int]], idx: list[int] | None,
                seed: int = 0) -> BatchMeta:
    g = torch.Generator().manual_seed(seed)
    toks = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lens]
    width = max(len(p) for p in pages)
    table = torch.tensor([p + [p[-1]] * (width - len(p)) for p in pages], dtype=torch.int32)
    li = None if idx is None else torch.tensor(idx, dtype=torch.int64)
    return BatchMeta.from_lists(toks, past, device="cpu", page_table=table, page_size=PAGE, logits_indices=li)


def _kv(cache) -> list[torch.Tensor]:
    return [t.clone() for layer in cache.layers for t in layer.attn_tensors() if t is not None]


def _rows_seen(model) -> list[list[int]]:
    """Per block, the row counts its MLP saw (a pre-hook each: the plan calls the MLP's parts)."""
    seen: list[list[int]] = [[] for _ in model.layers]
    for i, block in enumerate(model.layers):
        block.mlp.gate.register_forward_pre_hook(lambda m, a, i=i: seen[i].append(a[0].shape[0]))
    return seen


# -- the plan equals the reference ------------------------------------------------------------------------
def test_plan_equals_reference_on_cpu() -> None:
    model, _ = _model(torch.float32)
    plan = ExecutionPlan(model)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    meta = BatchMeta.full(ids)
    assert torch.equal(plan.forward(meta), model.forward_batch(meta))
    assert not plan.fused and plan.executor is not None
    assert "model on cpu" in " ".join(plan.executor.chain_why)


def test_deferred_chain_equals_plain_forward() -> None:
    """The decode-size form (norms deferred into the linears) with its fallbacks (norm computed from the
    stream, residual add with torch) gives the reference exactly."""
    model, _ = _model()
    plan = ExecutionPlan(model)
    assert plan.executor is not None
    ids = torch.randint(0, 300, (3,))
    meta = BatchMeta.full(ids.view(1, -1))
    ref = model.forward_batch(meta)
    state = ForwardState(meta, None, model.allowed_backends, model.plugins)
    out = plan.executor._deferred(model.embed(meta.input_ids), meta, state).float()
    assert out.shape == ref.shape == (3, 300)
    assert torch.equal(out, ref)
    # with the first norm's sums from the lookup (ops.embed_ss) the first norm is deferred too
    h, ss = ops.embed_ss(meta.input_ids, model.embed.weight, model.embed.scale, 2 * len(model.layers) + 1,
                         impl="torch")
    torch.testing.assert_close(ss[0], h.float().pow(2).sum(-1))
    state = ForwardState(meta, None, model.allowed_backends, model.plugins)
    assert torch.equal(plan.executor._deferred(h, meta, state, ss).float(), ref)
    assert (ss[1:] > 0).all(), "every residual producer adds its rows' sums into its own slot"


def test_block_hands_on_the_streams_sums_of_squares() -> None:
    model, _ = _model()
    plan = ExecutionPlan(model)
    assert plan.executor is not None
    meta = BatchMeta.full(torch.tensor([[4, 9]]))
    state = ForwardState(meta, None, model.allowed_backends, model.plugins)
    h = model.embed(meta.input_ids)
    ss = torch.zeros(2, 2)
    out = plan.executor.blocks[0].deferred(h, None, state, ss[0], ss[1])
    torch.testing.assert_close(ss[1], out.float().pow(2).sum(-1))
    assert (ss[0] > 0).all() and not torch.equal(ss[0], ss[1])
    d = DeferredNorm(out, model.layers[1].attn_norm, ss[1])
    assert torch.equal(d.materialize(), model.layers[1].attn_norm(out))


def test_add_residual_ss_accumulates() -> None:
    r, y = torch.randn(2, 8).half(), torch.randn(2, 8).half()
    ss = torch.tensor([1.0, 2.0, 7.0])
    h = add_residual_ss(r, y, ss)
    assert torch.equal(h, (r.float() + y.float()).half())
    torch.testing.assert_close(ss[:2], torch.tensor([1.0, 2.0]) + h.float().pow(2).sum(-1))
    assert ss[2] == 7.0


def _prefill_then_decode(plan: ExecutionPlan, model, cache, ref_cache, pages: list[list[int]], n: int,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill of ``n`` tokens, then one decode step, through ``plan`` on ``cache`` and through the reference
    forward (the fused ops off) on ``ref_cache``: logits within fp16 rounding of each other."""
    for meta_args in (([n], [0], pages, [n - 1]), ([1], [n], pages, None)):
        got = plan.forward(_paged_meta(*meta_args), cache)
        with monkeypatch.context() as m:
            m.setattr(ops, "fused_enabled", lambda t: False)
            ref = model.forward_batch(_paged_meta(*meta_args), ref_cache)
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def test_fused_forms_with_triton_on_cpu_match_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the Triton kernels run by the interpreter, the plan takes its chain and deferred forms (what CUDA
    would take); a prefill chunk and a decode step stay within fp16 rounding of the reference."""
    pytest.importorskip("triton")
    from exl3_core.cache import Cache

    model, cache = _model(cache_tokens=8 * PAGE)
    ref_cache = Cache(model, 8 * PAGE, page_size=PAGE)
    monkeypatch.setattr(ops, "fused_enabled", lambda t: True)
    plan = ExecutionPlan(model)
    assert plan.fused and plan.executor is not None and not plan.executor.chain_why
    assert not plan.executor.deferred_why
    decode_calls: list[int] = []
    real = plan.executor._deferred
    monkeypatch.setattr(plan.executor, "_deferred", lambda *a, **k: decode_calls.append(1) or real(*a, **k))
    pages = [cache.allocator.allocate(2)]
    assert ref_cache.allocator.allocate(2) == pages[0]
    _prefill_then_decode(plan, model, cache, ref_cache, pages, 20, monkeypatch)
    assert decode_calls == [1], "the one-row decode step took the deferred form"


class _WidthKernels(EmulatedKernels):
    """The emulated launches, recording the input width each one was handed."""

    def __init__(self) -> None:
        super().__init__()
        self.widths: set[int] = set()

    def group(self, x2, lins):  # type: ignore[no-untyped-def]
        self.widths.add(x2.shape[-1])
        return super().group(x2, lins)

    def group_ex(self, h2, lins, norm, epilogue):  # type: ignore[no-untyped-def]
        self.widths.add(h2.shape[-1])
        return super().group_ex(h2, lins, norm, epilogue)

    def residual(self, layer, x, residual, ss, gate, act):  # type: ignore[no-untyped-def]
        self.widths.add(x.shape[-1])
        return super().residual(layer, x, residual, ss, gate, act)

    def rebuild_gemm(self, x2, lins):  # type: ignore[no-untyped-def]
        self.widths.add(x2.shape[-1])
        return super().rebuild_gemm(x2, lins)


@pytest.mark.parametrize("bias_o", [False, True])
def test_widths_off_128_reach_the_launches_unpadded(monkeypatch: pytest.MonkeyPatch, bias_o: bool) -> None:
    """A hidden width off a multiple of 128 (SmolLM2's 576) takes the deferred form, every launch handed the
    stream unpadded (the kernels read the missing columns as zeros); an o_proj with a bias leaves its residual
    launch out, so the decode step takes the chain form instead (its eager add would cost more than the
    chain's fused norm) and the report says why. Both stay within fp16 rounding of the reference, through a
    prefill long enough to rebuild W."""
    pytest.importorskip("triton")
    from exl3_core.cache import Cache

    monkeypatch.setattr(ops, "fused_enabled", lambda t: True)
    hidden = 128 * int(torch.randint(1, 4, ())) + 64
    model, cache = build_model(parse_shape(f"custom({hidden},384,1,{hidden // 64},1,300,64)"), device="cpu",
                               dtype=torch.float16, seed=int(torch.randint(0, 1000, ())), cache_tokens=6 * PAGE,
                               page_size=PAGE)
    if bias_o:
        o = model.layers[0].attn.o_proj
        o.bias = 0.1 * torch.randn(o.padded_out_features, dtype=torch.float16)
    ref_cache = Cache(model, 6 * PAGE, page_size=PAGE)
    kernels = _WidthKernels()
    fp16 = dataclasses.replace(Tuning(), fusion=FusionTuning(prefill_bf16=False))  # the reference's precision
    plan = ExecutionPlan(model, tuning=fp16, kernels=kernels)
    assert plan.executor is not None and not plan.executor.chain_why
    forms: list[str] = []
    for name in ("_deferred", "_chain"):
        real = getattr(plan.executor, name)
        monkeypatch.setattr(plan.executor, name, lambda *a, _r=real, _n=name, **k: forms.append(_n) or _r(*a, **k))
    assert plan.executor.deferred_why == (["layer 0: o_proj's residual launch declines: has a bias"] if bias_o else [])
    pages = [cache.allocator.allocate(5)]
    assert ref_cache.allocator.allocate(5) == pages[0]
    _prefill_then_decode(plan, model, cache, ref_cache, pages, 70, monkeypatch)
    assert forms == ["_chain", "_chain" if bias_o else "_deferred"]
    assert hidden in kernels.widths and kernels.widths <= {hidden, 384}, "a launch was handed a padded input"
    if not bias_o:
        assert kernels.calls.get("residual", 0) + kernels.calls.get("residual_gated", 0) == 2
    # q/k/v of widths off 128 (k and v: one 64-wide head) rotate and store their rows in the launch's epilogue,
    # each cache slot as wide as the layer's own output
    assert kernels.calls.get("group_ex_epilogue", 0) == 1


def test_forced_bf16_forward_close_to_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 prefill's dtype flow, forced on CPU: bf16 activations, keys and values stored in the
    cache's fp16, a fresh sequence attending to its own rows, a later chunk attending through the cache in
    its dtype, the head in the model's dtype; logits within bf16 rounding (8 significant bits to fp16's 11;
    a wrong path, a missed cast or keys read in the wrong place, is off by O(1))."""
    model, cache = _model(cache_tokens=16 * PAGE, layers=3, seed=5)
    plan = ExecutionPlan(model)
    assert plan.executor is not None
    pages = [cache.allocator.allocate(8)]
    from exl3_core.builtins.attn_torch_impl import TorchAttention

    seen: list[tuple[torch.dtype, bool]] = []  # what reaches the attention backend: q's dtype, through the cache
    own = TorchAttention.forward

    def spy(self, args):
        seen.append((args.q.dtype, args.spec.cache is not None))
        return own(self, args)

    monkeypatch.setattr(TorchAttention, "forward", spy)
    ref = plan.forward(_paged_meta([80], [0], pages, [79]), cache)
    kv_ref = _kv(cache)
    assert seen == [(torch.float16, False)] * 3
    seen.clear()
    x_dtypes: list[torch.dtype] = []
    model.layers[0].mlp.gate.register_forward_pre_hook(lambda m, a: x_dtypes.append(a[0].dtype))
    monkeypatch.setattr(plan.executor, "_bf16", lambda x, meta: True)
    got = plan.forward(_paged_meta([80], [0], pages, [79]), cache)
    assert x_dtypes == [torch.bfloat16]
    assert seen == [(torch.bfloat16, False)] * 3  # a fresh sequence attends to its own rows, not the cache
    assert got.dtype == ref.dtype == torch.float32 and got.shape == (1, 300)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 3e-2, rel
    for a, b in zip(_kv(cache), kv_ref):
        assert a.dtype == torch.float16 and ((a.float() - b.float()).norm() / b.float().norm()).item() < 3e-2
    seen.clear()
    later = plan.forward(_paged_meta([30], [80], pages, [29], seed=1), cache)  # bf16 forced after a prefix
    assert seen == [(torch.float16, True)] * 3, "attention after a prefix runs in the cache's dtype"
    monkeypatch.undo()
    plan.forward(_paged_meta([80], [0], pages, [79]), cache)  # the same prefix, in fp16
    later_ref = plan.forward(_paged_meta([30], [80], pages, [29], seed=1), cache)
    assert ((later - later_ref).norm() / later_ref.norm()).item() < 3e-2


# -- declared rules and reasons ----------------------------------------------------------------------------
def test_unknown_modules_keep_their_forward_and_the_plan_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """A subclass may compute something else: the plan runs its own forward (results equal the model's)
    and reports why it did not fuse it. No method-identity checks: the type is not one the plan knows."""
    class Quirky(Attention):
        def forward(self, x, state):  # type: ignore[override]
            return super().forward(x, state) * 2

    monkeypatch.setattr(ops, "fused_enabled", lambda t: True)
    model, _ = _model()
    model.layers[0].attn.__class__ = Quirky
    plan = ExecutionPlan(model)
    assert plan.executor is not None
    b0 = plan.executor.blocks[0]
    assert b0.attn_runner is None and any("Quirky, not Attention" in w for w in b0.deferred_why)
    assert plan.executor.deferred_why and not plan.executor.blocks[1].deferred_why
    text = "\n".join(line for part in plan.report() for line in part.lines())
    assert "Quirky, not Attention" in text
    meta = BatchMeta.full(torch.randint(0, 300, (1, 5)))
    monkeypatch.setattr(ops, "fused_enabled", lambda t: False)
    ref = model.forward_batch(meta)
    monkeypatch.setattr(ops, "fused_enabled", lambda t: True)
    torch.testing.assert_close(plan.forward(meta), ref, rtol=2e-2, atol=2e-2)


def test_tuning_turns_each_fusion_off() -> None:
    model, _ = _model()
    off = dataclasses.replace(Tuning.generic(), fusion=FusionTuning(
        residual_norm=False, grouped_projections=False, deferred_norm=False, qkv_epilogue=False,
        rope_cache_write=False, step_start=False, act_in_down=False, last_rows=False, prefill_bf16=False))
    plan = ExecutionPlan(model, off)
    assert plan.executor is not None
    text = "\n".join(line for part in plan.report() for line in part.lines())
    assert text.count("off in the tuning") >= 8
    assert plan.executor.rows_why == ["off in the tuning"]
    assert "fusion.deferred_norm = False (h200: True)" in Tuning.describe(off)


# -- last rows ---------------------------------------------------------------------------------------------
def test_last_block_keeps_only_the_asked_rows() -> None:
    model, cache = _model(torch.float32, 8 * PAGE, layers=3)
    plan = ExecutionPlan(model)
    seen = _rows_seen(model)
    lens = [37, 21]
    pages = [cache.allocator.allocate(3), cache.allocator.allocate(3)]
    full = plan.forward(_paged_meta(lens, [0, 0], pages, None), cache)
    kv_full = _kv(cache)
    assert [s[-1] for s in seen] == [58, 58, 58]
    last = [36, 57]
    pruned = plan.forward(_paged_meta(lens, [0, 0], pages, last), cache)
    assert [s[-1] for s in seen] == [58, 58, 2], "the last block's MLP ran on the two asked rows only"
    assert pruned.shape == (2, 300)
    torch.testing.assert_close(pruned, full[last], rtol=1e-5, atol=1e-5)
    for a, b in zip(kv_full, _kv(cache)):  # every row's keys and values, the last layer's too
        assert torch.equal(a, b)
    # no asked row (a prompt's middle chunk): the last block runs on one row, none comes back
    out = plan.forward(_paged_meta([20], [0], [pages[0]], []), cache)
    assert out.shape == (0, 300) and seen[-1][-1] == 1


def test_a_replaced_block_is_left_alone() -> None:
    """A block type the plan does not know runs its own forward on every row; rows are picked after it."""
    model, cache = _model(torch.float32, 8 * PAGE, layers=3)

    class Plain(DecoderBlock):
        def forward(self, x, state):  # type: ignore[override]
            x = x + self.attn(self.attn_norm(x), state)
            return x + self.mlp(self.mlp_norm(x), state)

    model.layers[-1].__class__ = Plain
    plan = ExecutionPlan(model)
    assert plan.executor is not None and "Plain is not a DecoderBlock" in plan.executor.rows_why[0]
    seen = _rows_seen(model)
    pages = [cache.allocator.allocate(2)]
    out = plan.forward(_paged_meta([19], [0], pages, [18]), cache)
    assert out.shape == (1, 300) and seen[-1][-1] == 19


# -- carried ids (the one-step-ahead loop) -----------------------------------------------------------------
def test_forward_applies_the_carried_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """``carry``: row i's id is ``src[carry[i]]`` where that index is valid, written into ``meta.input_ids``
    as ``ops.carry_ids`` does; the logits equal those of a batch built with those ids. A model with its own
    forward gets the same through ``ops.carry_ids`` before it."""
    model, _ = _model()
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 300, (4,), generator=g)
    src = torch.randint(0, 300, (6,), generator=g).double()
    carry = torch.tensor([3, -1, 0, 9], dtype=torch.int32)  # row 3's index is past src: kept
    want = ids.clone()
    want[0], want[2] = int(src[3]), int(src[0])
    ref = model.forward_batch(BatchMeta.full(want.view(-1, 1)))
    for standard in (True, False):
        monkeypatch.setattr(type(model), "standard_forward", standard)
        plan = ExecutionPlan(model)
        assert (plan.executor is not None) == standard
        meta = BatchMeta.full(ids.clone().view(-1, 1))
        out = plan.forward(meta, carry=(carry, src))
        assert torch.equal(meta.input_ids, want)
        assert torch.equal(out, ref)


def test_plan_refuses_after_a_reload() -> None:
    model, _ = _model(torch.float32)
    plan = ExecutionPlan(model)
    meta = BatchMeta.full(torch.tensor([[1, 2]]))
    plan.forward(meta)
    model.load(device="cpu", dtype=torch.float32, source=model.bench_source)
    with pytest.raises(RuntimeError, match="build a new one"):
        plan.forward(meta)
    assert ExecutionPlan(model).forward(meta).shape == (2, 300)


# -- bf16 prefill --------------------------------------------------------------------------------------------
def test_which_forwards_take_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    model, cache = _model(cache_tokens=16 * PAGE, layers=3)
    pages = cache.allocator.allocate(6)

    def bf16(plan: ExecutionPlan, lens: list[int], past: list[int], x_dtype: torch.dtype = torch.float16) -> bool:
        meta = _paged_meta(lens, past, [pages] * len(lens), None)
        assert plan.executor is not None
        return plan.executor._bf16(torch.zeros(sum(lens), 128, dtype=x_dtype), meta)

    assert not bf16(ExecutionPlan(model), [80], [0])  # CPU: no fused path
    monkeypatch.setattr(ops, "fused_enabled", lambda t: True)  # what CUDA would say
    plan = ExecutionPlan(model)
    assert bf16(plan, [80], [0]) and bf16(plan, [65], [0])
    assert not bf16(plan, [64], [0])  # below REBUILD_MIN_ROWS the linears decode on the fly
    assert not bf16(plan, [80], [16])  # after cached tokens: the keys are in the fp16 cache
    assert not bf16(plan, [40, 40], [0, 0])  # two sequences
    assert not bf16(plan, [80], [0], torch.float32)  # only an fp16 model
    off = dataclasses.replace(Tuning.generic(), fusion=FusionTuning(prefill_bf16=False))
    assert not bf16(ExecutionPlan(model, off), [80], [0])
    model.layers[1].attn.__class__ = type("OwnAttention", (Attention,), {})
    assert not bf16(ExecutionPlan(model), [80], [0])  # a block whose attention the plan does not know
