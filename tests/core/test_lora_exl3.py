"""LoRA on EXL3-quantized bases and in the engine's fused forms:

* the Triton kernels (run by Triton's interpreter here) against the torch form: mixed ranks in one stack,
  several active adapters, rows mapped, slots a linear lacks, in place and into another output;
* an EXL3 base with an adapter equals the same base dequantized into dense linears with the adapter;
* decode steps in the fused forms (deferred norms, grouped q/k/v, residual epilogues, EXL3 launches emulated,
  LoRA kernels in the interpreter) with every sequence on its own adapters equal the reference forward;
* merging refuses EXL3 linears, naming them and ``exl3 convert --lora``; dense linears merge exactly.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from exl3_core import ops
from exl3_core.archkit.batch import BatchMeta
from exl3_core.bench.models import build_model, parse_shape
from exl3_core.cache import Cache
from exl3_core.kernels.counters import arrival_counters
from exl3_core.lora import LoraError, lora_set
from exl3_core.lora.linear import LoraLinear
from exl3_core.lora.selection import Selection
from exl3_core.lora.stack import LoraStack, StackEntry
from exl3_core.nn.adapters import PendingInput, row_map
from exl3_core.nn.linear import DenseLinear
from exl3_core.plan import ExecutionPlan
from exl3_core.quant.exl3.linear import EXL3Linear
from exl3_core.testing.arch import rel_err
from exl3_core.testing.kernels import EmulatedKernels
from exl3_core.testing.lora import random_adapter

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: the tests that launch the LoRA kernels on CPU tensors, which only Triton's interpreter runs (on a CUDA machine
#: without it, tests/gpu/test_lora_gpu.py runs the kernels)
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the LoRA kernels on CPU tensors need Triton's interpreter")

SHAPE = "custom(256,384,2,4,2,300)"
PAGE = 16


def _linears(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    return {m.key: (m.in_features, m.out_features) for m in model.modules()
            if isinstance(m, (EXL3Linear, DenseLinear)) and ".layers." in m.key}


# -- the kernels -----------------------------------------------------------------------------------------------
#: per dtype, two of the four (shrink slice budget, its id, expand form) pairings: every row count meets all four
KERNEL_PAIRINGS = {torch.float32: [(1, "one_slice", "per_entry"), (8192, "slices", "wide")],
                   torch.float16: [(8192, "slices", "per_entry"), (1, "one_slice", "wide")]}
KERNEL_PARAMS = [pytest.param(dtype, rows, values, expand, id=f"{rows}-{str(dtype)[6:]}-{name}-{expand}")
                 for rows in (1, 5, 37) for dtype, pairs in KERNEL_PAIRINGS.items() for values, name, expand in pairs]


@interpreted
@pytest.mark.parametrize("dtype,rows,slice_values,expand", KERNEL_PARAMS)
def test_kernels_equal_torch_form(dtype: torch.dtype, rows: int, slice_values: int, expand: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``slice_values`` 8192: at decode sizes the 600 input features in five shrink slices of one input block,
    summed by the last of them to finish (1: one slice); ``expand``: one dependent round per active entry, or every entry
    in one product (8 slots x rank 64 here)."""
    from exl3_core.lora import kernels
    from exl3_core.lora.kernels import lora_add

    monkeypatch.setattr(kernels, "MAX_SLICE_VALUES", slice_values)
    monkeypatch.setattr(kernels, "WIDE_MAX_VALUES", 8 * 64 if expand == "wide" else 0)

    g = torch.Generator().manual_seed(rows)
    n_in, n_out, cap = 600, 80, 8
    entries = [StackEntry(s, torch.randn(r, n_in, generator=g) / 20, torch.randn(r, n_out, generator=g) / 4, sc)
               for s, r, sc in ((0, 1, 2.0), (2, 8, 0.5), (5, 64, 0.125))]
    stack = LoraStack.build(entries, cap, torch.device("cpu"), dtype)
    sel = Selection(torch.device("cpu"), cap, rows=4)
    half = rows // 2
    # slot 3 is active in the step but not on this linear; slot 5 only on the second half
    sel.fill([({0: 1.0, 2: -0.75, 3: 2.0}, half), ({5: 1.5, 0: 0.25}, rows - half)])
    lin = LoraLinear("x", n_in, n_out, stack, sel)
    x = torch.randn(rows, n_in, generator=g).to(dtype)
    y = torch.randn(rows, n_out, generator=g).to(dtype)
    ref = (y.float() + lin.delta(x)).to(dtype)
    out = torch.empty_like(y)
    lora_add(x, y, out, stack, sel, None)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert rel_err(out, ref) < tol
    # the shrink's slices were summed by their last program, which left its arrival counters at zero
    assert arrival_counters("lora_shrink", x.device, 1).count_nonzero() == 0
    y2 = y.clone()
    lora_add(x, y2, y2, stack, sel, None)  # in place
    assert torch.equal(y2, out)
    # the rows of a subset: step rows `idx` through a row map, as the last block and the experts run them
    idx = torch.tensor([rows - 1, 0] if rows > 1 else [0])
    with row_map(idx):
        sub = lin.delta(x[idx])
        outs = torch.empty_like(y[idx])
        lora_add(x[idx], y[idx], outs, stack, sel, idx)
    assert rel_err(sub, lin.delta(x)[idx]) < 1e-6
    assert rel_err(outs, ref[idx]) < tol
    # nothing active: y unchanged
    sel.clear()
    out3 = torch.empty_like(y)
    lora_add(x, y, out3, stack, sel, None)
    assert torch.equal(out3, y)


@interpreted
@pytest.mark.parametrize("rows", [1, 7])
def test_expand_moves_row_sums_of_squares(rows: int) -> None:
    """Into a residual stream a launch has added to, the expand adds the delta in place and each row's change of
    the sum of squares to the launch's sums: they end as the new rows' (fp32 rounding apart)."""
    from exl3_core.lora.kernels import ShrinkInput, lora_expand, lora_shrink

    g = torch.Generator().manual_seed(rows)
    n_in, n_out, cap = 600, 200, 4
    entries = [StackEntry(s, torch.randn(r, n_in, generator=g) / 20, torch.randn(r, n_out, generator=g) / 4, 1.0)
               for s, r in ((0, 8), (3, 16))]
    stack = LoraStack.build(entries, cap, torch.device("cpu"), torch.float16)
    sel = Selection(torch.device("cpu"), cap, rows=rows)
    sel.fill([({0: 1.0, 3: -0.5}, rows)])
    lin = LoraLinear("x", n_in, n_out, stack, sel)
    x = torch.randn(rows, n_in, generator=g).half()
    h = torch.randn(rows, n_out, generator=g).half()
    ss = torch.cat([h.float().pow(2).sum(-1), torch.full((3,), 7.0)])  # rows past the step keep theirs
    want = (h.float() + lin.delta(x)).half()
    lora_expand(lora_shrink(ShrinkInput(x), [stack], sel, None), [h], [h], ss=ss)
    assert rel_err(h, want) < 2e-3
    torch.testing.assert_close(ss[:rows], h.float().pow(2).sum(-1), rtol=1e-5, atol=1e-3)
    assert torch.equal(ss[rows:], torch.full((3,), 7.0))
    with pytest.raises(ValueError, match="ss must be fp32"):
        lora_expand(lora_shrink(ShrinkInput(x), [stack], sel, None), [h], [h], ss=ss.half())


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_group_kernels_equal_one_by_one(dtype: torch.dtype) -> None:
    """q/k/v-like linears (one input, three widths, each with its own adapters and ranks) in one launch pair."""
    from exl3_core.lora.kernels import lora_add_group

    g = torch.Generator().manual_seed(7)
    n_in, cap, rows = 64, 4, 9
    sel = Selection(torch.device("cpu"), cap, rows=rows)
    sel.fill([({0: 1.0, 1: 0.5}, 4), ({2: -1.0}, rows - 4)])
    lins = []
    for n_out, spec in ((96, ((0, 8), (2, 1))), (32, ((1, 16),)), (48, ((0, 4), (1, 2), (2, 32)))):
        entries = [StackEntry(s, torch.randn(r, n_in, generator=g) / 8, torch.randn(r, n_out, generator=g) / 4, 0.5 + s)
                   for s, r in spec]
        lins.append(LoraLinear(f"l{n_out}", n_in, n_out, LoraStack.build(entries, cap, torch.device("cpu"), dtype), sel))
    x = torch.randn(rows, n_in, generator=g).to(dtype)
    ys = [torch.randn(rows, m.out_features, generator=g).to(dtype) for m in lins]
    refs = [(y.float() + m.delta(x)).to(dtype) for y, m in zip(ys, lins)]
    outs = [y.clone() for y in ys]
    lora_add_group(x, outs, outs, [m.stack for m in lins], sel, None)
    for o, r in zip(outs, refs):
        assert rel_err(o, r) < (1e-5 if dtype == torch.float32 else 2e-3)
    assert lins[0].begin_group(lins, x) is None, "the group form ran without the fused path"


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_shrink_forms_normed_and_gated_inputs(dtype: torch.dtype) -> None:
    """The shrink normalises (deferred RMSNorm) or gates (act(gate) * up) its input as it loads it: the same deltas
    as from the input formed by the plain modules, so no norm or activation launch runs for the adapters."""
    from exl3_core.kernels.fused import act_mul, rms_norm_residual
    from exl3_core.lora.kernels import FORM_GATED, FORM_NORM, ShrinkInput, lora_add_group
    from exl3_core.nn.adapters import GatedInput, NormedInput

    g = torch.Generator().manual_seed(11)
    n_in, cap, rows = 96, 3, 5
    sel = Selection(torch.device("cpu"), cap, rows=rows)
    sel.fill([({0: 1.0}, 2), ({1: 0.5, 2: -1.0}, rows - 2)])
    entries = [StackEntry(s, torch.randn(r, n_in, generator=g) / 8, torch.randn(r, 40, generator=g) / 4, 0.5 + s)
               for s, r in ((0, 8), (1, 4), (2, 16))]
    lin = LoraLinear("l", n_in, 40, LoraStack.build(entries, cap, torch.device("cpu"), dtype), sel)
    h = (3 * torch.randn(rows, n_in, generator=g)).to(dtype)
    w = torch.rand(n_in, generator=g) + 0.5
    normed = NormedInput(h, h.float().pow(2).sum(-1), w, 1e-5, 0.25,
                         lambda: rms_norm_residual(h, None, w, 1e-5, 0.25)[0])
    gate, up = torch.randn(rows, n_in, generator=g).to(dtype), torch.randn(rows, n_in, generator=g).to(dtype)
    gated = [GatedInput(gate, up, act, lambda act=act: act_mul(act, gate, up)) for act in ("silu", "gelu_tanh")]
    y = torch.randn(rows, 40, generator=g).to(dtype)
    for inp, form in [(normed, FORM_NORM)] + [(gi, FORM_GATED) for gi in gated]:
        si = ShrinkInput.of(inp, n_in)
        assert si is not None and si.form == form
        x = inp.formed()
        want = torch.empty_like(y)
        lora_add_group(x, [y], [want], [lin.stack], sel, None)
        got = torch.empty_like(y)
        lora_add_group(si, [y], [got], [lin.stack], sel, None)
        assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 2e-3)
        assert rel_err(got, (y.float() + lin.delta(x)).to(dtype)) < (1e-5 if dtype == torch.float32 else 2e-3)
        assert rel_err(got, y) > 1e-2, "the deltas are too small for the test to see a wrongly formed input"
    # a norm weight of another width cannot be formed in the kernel: the plain path takes it
    bad = NormedInput(h, h.float().pow(2).sum(-1), w[:-1], 1e-5, 0.0, lambda: h)
    assert ShrinkInput.of(bad, n_in) is None


# -- EXL3 bases ------------------------------------------------------------------------------------------------
def _dequantized_twin(model: torch.nn.Module) -> None:
    """Replace every EXL3 linear of ``model`` by a dense linear holding its dequantized weight (fp32)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, EXL3Linear):
                w = child.dequantize().t().contiguous().float()
                b = None if child.bias is None else child.bias[: child.out_features].float()
                setattr(parent, name, DenseLinear(w, b, child.in_features, child.out_features, key=child.key))


def test_exl3_base_equals_dequantized_base(tmp_path: Path) -> None:
    model, _ = build_model(parse_shape(SHAPE), device="cpu", dtype=torch.float32, seed=4)
    twin, _ = build_model(parse_shape(SHAPE), device="cpu", dtype=torch.float32, seed=4)
    _dequantized_twin(twin)
    assert not any(isinstance(m, EXL3Linear) and ".layers." in m.key for m in twin.modules())
    random_adapter(tmp_path / "a", _linears(model), r=8, seed=1)
    random_adapter(tmp_path / "b", _linears(model), r=16, rslora=True, seed=2)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    for m in (model, twin):
        m.load_lora(tmp_path / "a", name="a")
        m.load_lora(tmp_path / "b", name="b")
    choices = [{"a": 1.0}, {"a": 0.5, "b": 1.0}]
    out, ref = model.forward(ids, loras=choices), twin.forward(ids, loras=choices)
    assert rel_err(out, ref) < 1e-4
    assert rel_err(out, model.forward(ids)) > 0.05, "the adapters barely change the logits: the test would be vacuous"
    with pytest.raises(LoraError, match=r"EXL3-quantized.*exl3 convert .*--lora"):
        model.merge_lora("a")
    assert model.lora_names() == ["a", "b"], "a refused merge changed the loaded adapters"
    # dense linears merge: the merged base without adapters equals the unmerged one with "a"
    with_a = twin.forward(ids, loras={"a": 1.0})
    twin.merge_lora("a")
    assert twin.lora_names() == ["b"]
    assert rel_err(twin.forward(ids), with_a) < 1e-5


def _decode_steps(plan_or_ref, model, cache, prompts, choices, steps: int) -> list[torch.Tensor]:
    """A prefill of ``prompts`` (one chunk, last rows' logits) then ``steps`` one-token steps, each sequence on its
    own adapters; the logits of every step."""
    s = lora_set(model)
    groups = [s.slots_of(c or {}) for c in choices]
    pages = [cache.allocator.allocate(4) for _ in prompts]
    table = torch.tensor(pages, dtype=torch.int32)
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    meta = BatchMeta.from_lists(prompts, [0] * len(prompts), page_table=table, page_size=PAGE, logits_indices=ends)
    s.select([(g, len(p)) for g, p in zip(groups, prompts)])
    out = [plan_or_ref(meta, cache)]
    past = [len(p) for p in prompts]
    for step in range(steps):
        toks = [[(5 * step + 13 * b) % 300] for b in range(len(prompts))]
        s.select([(g, 1) for g in groups])
        out.append(plan_or_ref(BatchMeta.from_lists(toks, past, page_table=table, page_size=PAGE), cache))
        past = [p + 1 for p in past]
    return out


@interpreted
def test_fused_decode_steps_mix_adapters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from exl3_core.lora import kernels as lora_kernels

    model, _ = build_model(parse_shape("custom(256,256,1,4,2,300)"), device="cpu", dtype=torch.float16, seed=6)
    for name, r in (("a", 4), ("b", 16)):
        random_adapter(tmp_path / name, _linears(model), r=r, seed=r, dtype=torch.float16)
        model.load_lora(tmp_path / name, name=name)
    prompts = [list(range(3, 12)), list(range(40, 45)), list(range(60, 63))]
    choices = [{"a": 1.0}, None, {"b": 1.0, "a": -0.5}]

    def reference(meta: BatchMeta, cache: Cache) -> torch.Tensor:
        with monkeypatch.context() as m:
            m.setattr(ops, "fused_enabled", lambda t: False)
            return model.forward_batch(meta, cache)

    ref = _decode_steps(reference, model, Cache(model, 16 * PAGE, page_size=PAGE), prompts, choices, 2)
    calls: dict[int, int] = {}
    events: list[tuple[str, int]] = []  # the launches in order: ("shrink", linears) and ("group_ex", linears)
    real = lora_kernels.lora_shrink

    def counted(inp: object, stacks: list, *a: object) -> object:
        calls[len(stacks)] = calls.get(len(stacks), 0) + 1
        events.append(("shrink", len(stacks)))
        return real(inp, stacks, *a)  # type: ignore[arg-type]

    formed: list[str] = []
    real_formed = PendingInput.formed

    def formed_counted(self: PendingInput) -> torch.Tensor:
        formed.append(type(self).__name__)
        return real_formed(self)

    monkeypatch.setattr(lora_kernels, "lora_shrink", counted)
    monkeypatch.setattr(PendingInput, "formed", formed_counted)
    monkeypatch.setattr(ops, "fused_enabled", lambda t: True)
    kernels = EmulatedKernels()
    real_group_ex, real_residual = kernels.group_ex, kernels.residual
    real_expand = lora_kernels.lora_expand

    def group_ex(h2: torch.Tensor, lins: list, *a: object) -> list:
        events.append(("group_ex", len(lins)))
        return real_group_ex(h2, lins, *a)  # type: ignore[arg-type]

    def residual(*a: object) -> torch.Tensor:
        events.append(("residual", 1))
        return real_residual(*a)  # type: ignore[arg-type]

    def expand(sh: object, ys: list, outs: list, ss: torch.Tensor | None = None) -> None:
        events.append(("expand_ss" if ss is not None else "expand", len(ys)))
        real_expand(sh, ys, outs, ss)  # type: ignore[arg-type]

    kernels.group_ex = group_ex  # type: ignore[method-assign]
    kernels.residual = residual  # type: ignore[method-assign]
    monkeypatch.setattr(lora_kernels, "lora_expand", expand)
    plan = ExecutionPlan(model, kernels=kernels)
    got = _decode_steps(plan.forward, model, Cache(model, 16 * PAGE, page_size=PAGE), prompts, choices, 2)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    # per decode step of the one layer: q/k/v in one launch pair, gate/up in one, o and down one each
    assert calls.get(3, 0) >= 2 and calls.get(2, 0) >= 2 and calls.get(1, 0) >= 2 * 2, calls
    assert not formed, f"the adapters formed their input with launches of its own: {formed}"
    # at decode sizes q/k/v's and gate/up's shrinks follow their base launch, which follows the kernel before it
    launches = [i for i, e in enumerate(events) if e[0] == "group_ex" and e[1] > 1]
    assert len(launches) >= 2 * 2 and all(events[i + 1] == ("shrink", events[i][1]) for i in launches), str(events)
    assert kernels.calls.get("residual_gated", 0) >= 2, "down lost its fused launch (one per decode step)"
    # o's and down's: the residual launch first (after the kernel before), then the shrink, then the expand that adds
    # into the stream and moves the deferred norm's sums
    res = [i for i, e in enumerate(events) if e[0] == "residual"]
    assert len(res) >= 2 * 2 and all(events[i + 1:i + 3] == [("shrink", 1), ("expand_ss", 1)] for i in res), str(events)
    monkeypatch.setattr(ops, "fused_enabled", lambda t: False)
    bare = _decode_steps(reference, model, Cache(model, 16 * PAGE, page_size=PAGE), prompts, [None] * 3, 2)
    assert not torch.allclose(bare[-1][0], ref[-1][0], atol=5e-2), "adapter a has no visible effect"
    assert torch.allclose(bare[-1][1], ref[-1][1], atol=1e-3), "the base sequence picked up an adapter"


def test_bench_lora_command(tmp_path: Path) -> None:
    """``exl3 bench --lora`` end to end on a tiny shape (the figures mean something on a GPU only)."""
    import json

    from exl3_core.cli import main

    out = tmp_path / "lora.json"
    rc = main(["bench", "--lora", "--shape", "custom(256,256,1,4,2,300)", "--device", "cpu", "--lora-rank", "4",
               "--lora-adapters", "2", "--lora-batch", "3", "--contexts", "16", "--new-tokens", "3",
               "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["rank"] == 4 and r["adapters"] == 2 and r["batch"] == 3
    for key in ("b1", "batch_figures"):
        assert r[key]["none"]["tok_s"] > 0 and r[key]["lora"]["tok_s"] > 0
        assert r[key]["ratio"] == pytest.approx(r[key]["lora"]["tok_s"] / r[key]["none"]["tok_s"])
