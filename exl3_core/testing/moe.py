"""Mixture-of-experts additions to the architecture conformance suite.

A bf16 comparison of a MoE model against transformers is dominated by routing ties: when two
experts' scores are closer than bf16 rounding noise (routinely so among ~100 tokens), *any*
two implementations may pick differently, and that token's output then differs by a whole
expert. So the bf16 check here pins exl3's expert choice to the one transformers made (weights
still come from exl3's own router), counts how many tokens needed pinning and requires each of
them to be a near-tie in fp32. The fp32 check pins nothing: fp32 noise is far below the ties.

Extra coverage over :mod:`exl3_core.testing.arch`: selection-bias buffers (which transformers
keeps as buffers, not parameters) are randomised too, and the test asserts that routing
actually varies between tokens.

Usage in a plugin's tests::

    from exl3_core.testing.moe import moe_arch_suite
    test_foo_moe = moe_arch_suite("FooMoeForCausalLM")
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from exl3_core.testing.arch import (
    BF16_RTOL,
    FP32_RTOL,
    SEQ_LEN,
    _cache_roundtrip,
    build_checkpoint,
    check_load_errors,
    rel_err,
    tiny_variants,
)

#: a token whose two competing experts' fp32 scores are closer than this may flip in bf16
TIE_MARGIN = 2e-2
#: at most this fraction of (token, layer) choices may need pinning
MAX_PINNED_FRACTION = 0.1


def _router_modules(hf_model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """transformers routers: modules named ``*.mlp.gate`` that return ``(logits, weights, ids)``."""
    return {n: m for n, m in hf_model.named_modules() if n.endswith(".mlp.gate")}


def hf_routing(hf_model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits of a transformers model plus each router's chosen expert ids ``[T, k]`` (by module name)."""
    choices: dict[str, torch.Tensor] = {}
    handles = []
    for name, mod in _router_modules(hf_model).items():
        def hook(_m: Any, _inp: Any, out: Any, name: str = name) -> None:
            if not (isinstance(out, tuple) and len(out) == 3 and not out[2].is_floating_point()):
                raise TypeError(f"{name}: expected a router returning (logits, weights, ids), got {type(out)}")
            choices[name] = out[2].detach().reshape(-1, out[2].shape[-1]).to(torch.int64)
        handles.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = hf_model(ids).logits.float()
    finally:
        for h in handles:
            h.remove()
    return logits, choices


def _moe_blocks(model: Any) -> dict[str, Any]:
    from exl3_core.nn.moe import MoE

    return {m.router_key: m for m in model.modules() if isinstance(m, MoE)}


def exl3_routing(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor],
                                                          dict[str, torch.Tensor]]:
    """exl3 logits plus, per MoE block (by router key), the experts its router would choose and
    its selection scores. Pinned blocks (:func:`~exl3_core.nn.moe.pin_routing`) still *run*
    the pinned experts; what is recorded is their own, unpinned choice."""
    from exl3_core.nn.moe import MoE, route

    choices: dict[str, torch.Tensor] = {}
    scores: dict[str, torch.Tensor] = {}
    patched = []
    for key, moe in _moe_blocks(model).items():
        def select(x: torch.Tensor, moe: MoE = moe, key: str = key) -> tuple[torch.Tensor, torch.Tensor]:
            assert moe.router is not None
            logits = moe.router(x if moe.router_dtype is None else x.to(moe.router_dtype)).float()
            s = torch.softmax(logits, -1) if moe.routing.scoring == "softmax" else torch.sigmoid(logits)
            scores[key] = s if moe.correction_bias is None else s + moe.correction_bias
            choices[key] = route(logits, moe.routing, moe.correction_bias)[1]
            return MoE.select(moe, x)
        patched.append(moe)
        moe.select = select  # instance attribute shadows the method for this run only
    try:
        with torch.no_grad():
            logits = model(ids)
    finally:
        for moe in patched:
            del moe.select
    return logits, choices, scores


def choice_gap(scores: torch.Tensor, a: torch.Tensor, b: torch.Tensor, routing: Any) -> float:
    """How far apart two expert choices for one token are in selection score (0 = an exact tie):
    the smaller of the expert-level gap and, for grouped routing, the gap between the groups
    the two choices draw from (a near-tie between groups swaps whole groups of experts)."""
    gap = float((scores[a].sum() - scores[b].sum()).abs())
    if routing.grouped:
        size = routing.num_experts // routing.num_groups
        per = scores.view(routing.num_groups, size)
        rank = per.amax(-1) if routing.group_score == "max" else per.topk(2, -1).values.sum(-1)
        ga, gb = set((a // size).tolist()), set((b // size).tolist())
        if ga != gb:
            only_a, only_b = sorted(ga - gb), sorted(gb - ga)
            gap = min(gap, float((rank[only_a].sum() - rank[only_b].sum()).abs()) if only_a and only_b
                      else gap)
    return gap


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


def _randomize_buffers(hf_model: torch.nn.Module, seed: int) -> None:
    """Selection-bias buffers are not parameters; give them values so ignoring them shows."""
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, b in hf_model.named_buffers():
            if name.endswith("correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def check_moe_variant(hf_arch: str, cfg: Any, workdir: Path, *, plugins: Any = None, seed: int = 0) -> dict[str, float]:
    """fp32 logits, paged-cache round trip, routing-pinned bf16, load errors; returns the errors."""
    from transformers import AutoModelForCausalLM

    from exl3_core.archkit import Config, Model
    from exl3_core.nn.moe import pin_routing

    directory = workdir / "ckpt"
    hf_model = build_checkpoint(hf_arch, cfg, directory, seed=seed)
    _randomize_buffers(hf_model, seed)
    hf_model.save_pretrained(directory)  # type: ignore[operator]
    ids = torch.randint(0, cfg.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed + 1))
    ref, hf_choice = hf_routing(hf_model, ids)
    assert hf_choice, f"{hf_arch}: no '*.mlp.gate' router modules found in the transformers model"

    def make(d: Path) -> Any:
        return Model.from_config(Config.from_directory(d, plugins=plugins))

    model = make(directory)
    results: dict[str, float] = {}
    with torch.no_grad():
        model.load(device="cpu", dtype=torch.float32)
        blocks = _moe_blocks(model)
        assert set(blocks) == set(hf_choice), f"MoE layers differ: exl3 {sorted(blocks)} vs transformers {sorted(hf_choice)}"
        out, ours, _ = exl3_routing(model, ids)
        results["fp32"] = rel_err(out, ref)
        assert results["fp32"] <= FP32_RTOL, f"{hf_arch}: fp32 logits differ from transformers by {results['fp32']:.3g}"
        for key, choice in hf_choice.items():
            assert bool(_same_sets(ours[key], choice).all()), f"{key}: fp32 expert choice differs from transformers"
            distinct = len({tuple(r) for r in choice.sort(-1).values.tolist()})
            assert distinct >= 4, f"{key}: only {distinct} distinct expert sets; the test config routes too uniformly"
        results["cache"] = _cache_roundtrip(model, ids, ref)
        assert results["cache"] <= FP32_RTOL, f"{hf_arch}: paged-cache logits differ by {results['cache']:.3g}"
        model.unload()

        # transformers' own bf16 load (keeps fp32 routers where the family asks for it)
        hf16 = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, attn_implementation="eager").eval()
        ref16, hf16_choice = hf_routing(hf16, ids)
        model.load(device="cpu", dtype=torch.bfloat16)
        blocks = _moe_blocks(model)
        # run pinned to transformers' choice, so every layer sees (nearly) the inputs transformers
        # saw, and record what exl3's routers would have chosen on their own
        with pin_routing({blocks[k]: v for k, v in hf16_choice.items()}):
            out16, own16, scores16 = exl3_routing(model, ids)
        pinned = total = 0
        for key, choice in hf16_choice.items():
            differ = ~_same_sets(own16[key], choice)
            pinned += int(differ.sum())
            total += differ.numel()
            for t in differ.nonzero().flatten().tolist():
                # the two choices must be (nearly) equally good: a numerical tie, not a bug
                gap = choice_gap(scores16[key][t], own16[key][t], choice[t], blocks[key].routing)
                assert gap <= TIE_MARGIN, f"{key} token {t}: bf16 picks {own16[key][t].tolist()} vs transformers " \
                                          f"{choice[t].tolist()}; score gap {gap:.3g} is no tie"
        assert pinned <= MAX_PINNED_FRACTION * total, f"{hf_arch}: {pinned}/{total} bf16 choices differ from transformers"
        results["bf16"] = rel_err(out16, ref16)
        results["bf16_pinned_tokens"] = float(pinned)
        assert results["bf16"] <= BF16_RTOL, f"{hf_arch}: bf16 logits differ from transformers by {results['bf16']:.3g}"
        model.unload()

    check_load_errors(make, directory, workdir)
    return results


def moe_arch_suite(hf_arch: str, *, plugins: Any = None) -> Callable[..., None]:
    """A pytest test parametrized over the architecture's tiny variants (see the module docstring)."""
    import pytest

    variants = tiny_variants(hf_arch, plugins)
    if not variants:
        raise ValueError(f"{hf_arch}: its ArchSpec has no test_config; add one (module:fn returning tiny configs)")

    @pytest.mark.parametrize("variant", sorted(variants))
    def test_moe_arch_conformance(variant: str, tmp_path: Path) -> None:
        pytest.importorskip("transformers")
        cfg = tiny_variants(hf_arch, plugins)[variant]
        results = check_moe_variant(hf_arch, cfg, tmp_path, plugins=plugins)
        print(f"{hf_arch}[{variant}]: " + ", ".join(f"{k} {v:.3g}" for k, v in results.items()))

    test_moe_arch_conformance.__name__ = f"test_{hf_arch}"
    return test_moe_arch_conformance
