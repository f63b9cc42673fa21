"""MoE block: routing against a per-token loop oracle, expert execution against a per-token sum,
fused-expert checkpoint layout, and that routing really varies between tokens."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from exl3_core.nn.module import LoadContext
from exl3_core.nn.moe import MoE, RoutingConfig, grouped_gemm_works, pin_routing, route
from dict_source import DictSource


def route_oracle(logits: torch.Tensor, cfg: RoutingConfig,
                 bias: torch.Tensor | None) -> list[dict[int, float]]:
    """Straight per-token transcription of the routing rules: {expert: weight} per token."""
    out = []
    E, G = cfg.num_experts, cfg.num_groups
    for row in logits.double():
        scores = torch.softmax(row, -1) if cfg.scoring == "softmax" else torch.sigmoid(row)
        choice = [float(s) + (float(bias[e]) if bias is not None else 0.0) for e, s in enumerate(scores)]
        allowed = set(range(E))
        if cfg.grouped:
            size = E // G
            ranks = []
            for g in range(G):
                members = sorted(choice[g * size:(g + 1) * size], reverse=True)
                ranks.append((members[0] if cfg.group_score == "max" else members[0] + members[1], g))
            kept = [g for _, g in sorted(ranks, reverse=True)[: cfg.topk_groups]]
            allowed = {e for g in kept for e in range(g * size, (g + 1) * size)}
        chosen = sorted(allowed, key=lambda e: -choice[e])[: cfg.top_k]
        w = {e: float(scores[e]) for e in chosen}
        if cfg.renormalize:
            total = sum(w.values())
            w = {e: v / total for e, v in w.items()}
        out.append({e: v * cfg.scaling_factor for e, v in w.items()})
    return out


CONFIGS = {
    "softmax_greedy": RoutingConfig(num_experts=8, top_k=2),
    "softmax_renorm": RoutingConfig(num_experts=8, top_k=3, renormalize=True),
    "group_limited_max": RoutingConfig(num_experts=8, top_k=2, num_groups=4, topk_groups=2, group_score="max",
                                       scaling_factor=1.5),
    "sigmoid_grouped_top2": RoutingConfig(num_experts=16, top_k=4, scoring="sigmoid", num_groups=4, topk_groups=2,
                                          group_score="top2_sum", renormalize=True, scaling_factor=2.5),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("with_bias", [False, True])
def test_route_matches_per_token_oracle(name: str, with_bias: bool) -> None:
    cfg = CONFIGS[name]
    logits = torch.randn(64, cfg.num_experts) * 2
    bias = torch.randn(cfg.num_experts) * 0.3 if with_bias else None
    weights, ids = route(logits, cfg, bias)
    assert weights.dtype == torch.float32 and ids.shape == (64, cfg.top_k)
    oracle = route_oracle(logits, cfg, bias)
    for t, ref in enumerate(oracle):
        got = {int(e): float(w) for e, w in zip(ids[t], weights[t])}
        assert set(got) == set(ref), f"token {t}: experts {sorted(got)} != oracle {sorted(ref)}"
        for e in ref:
            assert math.isclose(got[e], ref[e], rel_tol=1e-5, abs_tol=1e-7)
    # routing must genuinely depend on the token (otherwise the comparison proves little)
    assert len({tuple(sorted(r)) for r in oracle}) > 4


def test_correction_bias_changes_selection_not_weights() -> None:
    cfg = CONFIGS["sigmoid_grouped_top2"]
    logits = torch.randn(128, cfg.num_experts)
    bias = torch.zeros(cfg.num_experts)
    bias[3] = 10.0  # forces expert 3 (and its group) into every token's choice
    _w0, i0 = route(logits, cfg, None)
    w1, i1 = route(logits, cfg, bias)
    assert bool((i1 == 3).any(dim=-1).all())
    assert not bool((i0 == 3).any(dim=-1).all())
    # weights are the unbiased sigmoid scores of the chosen experts, renormalised and scaled
    s = torch.sigmoid(logits).gather(1, i1)
    torch.testing.assert_close(w1, s / s.sum(-1, keepdim=True) * cfg.scaling_factor)


def test_grouped_selection_stays_inside_kept_groups() -> None:
    cfg = CONFIGS["group_limited_max"]
    _, ids = route(torch.randn(256, cfg.num_experts), cfg)
    groups = ids // (cfg.num_experts // cfg.num_groups)
    assert all(len(set(row.tolist())) <= cfg.topk_groups for row in groups)


def test_routing_config_rejects_impossible_settings() -> None:
    with pytest.raises(ValueError, match="divisible"):
        RoutingConfig(num_experts=10, top_k=2, num_groups=4, topk_groups=1)
    with pytest.raises(ValueError, match="topk_groups"):
        RoutingConfig(num_experts=8, top_k=5, num_groups=4, topk_groups=2)


def _moe_tensors(prefix: str, E: int, H: int, I: int, shared: int | None, fused: bool,
                 bias: bool, shared_gate: bool) -> dict[str, torch.Tensor]:
    t: dict[str, torch.Tensor] = {f"{prefix}.gate.weight": torch.randn(E, H)}
    if bias:
        t[f"{prefix}.gate.e_score_correction_bias"] = torch.randn(E) * 0.1
    gu = torch.randn(E, 2 * I, H) / math.sqrt(H)
    dn = torch.randn(E, H, I) / math.sqrt(I)
    if fused:
        t[f"{prefix}.experts.gate_up_proj"], t[f"{prefix}.experts.down_proj"] = gu, dn
    else:
        for e in range(E):
            t[f"{prefix}.experts.{e}.gate_proj.weight"] = gu[e, :I].clone()
            t[f"{prefix}.experts.{e}.up_proj.weight"] = gu[e, I:].clone()
            t[f"{prefix}.experts.{e}.down_proj.weight"] = dn[e].clone()
    if shared:
        t[f"{prefix}.shared_experts.gate_proj.weight"] = torch.randn(shared, H) / math.sqrt(H)
        t[f"{prefix}.shared_experts.up_proj.weight"] = torch.randn(shared, H) / math.sqrt(H)
        t[f"{prefix}.shared_experts.down_proj.weight"] = torch.randn(H, shared) / math.sqrt(shared)
    if shared_gate:
        t[f"{prefix}.shared_expert_gate.weight"] = torch.randn(1, H)
    return t


def _build(t: dict[str, torch.Tensor], cfg: RoutingConfig, H: int, I: int, shared: int | None, bias: bool,
           shared_gate: bool, dtype: torch.dtype = torch.float32, grouped: bool = True) -> MoE:
    moe = MoE(prefix="m", hidden_size=H, intermediate_size=I, routing=cfg, router_dtype=torch.float32,
              correction_bias_key="gate.e_score_correction_bias" if bias else None,
              shared_intermediate_size=shared, shared_gate_key="shared_expert_gate" if shared_gate else None)
    moe.grouped_gemm = grouped
    ctx = LoadContext(DictSource(t), torch.device("cpu"), dtype)
    for m in moe.exl3_modules():
        m.load_weights(ctx)
    return moe


def _moe_oracle(t: dict[str, torch.Tensor], x: torch.Tensor, cfg: RoutingConfig, shared: bool, bias: bool,
                shared_gate: bool) -> tuple[torch.Tensor, list[dict[int, float]]]:
    """Per-token loop: sum over the token's chosen experts of weight * expert(x), plus shared."""
    x = x.double()
    p = "m"
    logits = x @ t[f"{p}.gate.weight"].double().T
    routes = route_oracle(logits, cfg, t.get(f"{p}.gate.e_score_correction_bias"))
    fused = f"{p}.experts.gate_up_proj" in t
    I = (t[f"{p}.experts.down_proj"].shape[2] if fused else t[f"{p}.experts.0.down_proj.weight"].shape[1])

    def expert(e: int, v: torch.Tensor) -> torch.Tensor:
        if fused:
            g, u = t[f"{p}.experts.gate_up_proj"][e, :I].double(), t[f"{p}.experts.gate_up_proj"][e, I:].double()
            d = t[f"{p}.experts.down_proj"][e].double()
        else:
            g, u, d = (t[f"{p}.experts.{e}.{n}_proj.weight"].double() for n in ("gate", "up", "down"))
        return d @ (F.silu(g @ v) * (u @ v))

    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for e, w in routes[i].items():
            out[i] += w * expert(e, x[i])
        if shared:
            g, u, d = (t[f"{p}.shared_experts.{n}_proj.weight"].double() for n in ("gate", "up", "down"))
            s = d @ (F.silu(g @ x[i]) * (u @ x[i]))
            if shared_gate:
                s = s * torch.sigmoid(t[f"{p}.shared_expert_gate.weight"].double() @ x[i])
            out[i] += s
    return out, routes


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_gemm", "sliced"])
@pytest.mark.parametrize("name,shared,fused,bias,shared_gate", [
    ("softmax_renorm", None, False, False, False),
    ("softmax_greedy", 24, True, False, True),
    ("group_limited_max", 16, False, False, False),
    ("sigmoid_grouped_top2", 32, False, True, False),
    ("sigmoid_grouped_top2", 32, True, True, False),
])
def test_moe_matches_per_token_loop(name: str, shared: int | None, fused: bool, bias: bool,
                                    shared_gate: bool, grouped: bool) -> None:
    cfg = CONFIGS[name]
    H, I = 32, 16
    t = _moe_tensors("m", cfg.num_experts, H, I, shared, fused, bias, shared_gate)
    moe = _build(t, cfg, H, I, shared, bias, shared_gate, grouped=grouped)
    assert (moe.gate_up_t is not None) == (grouped and grouped_gemm_works(torch.device("cpu"), torch.float32))
    # CUDA graphs are declined exactly when the forward takes the sliced path (a host read)
    assert (moe.graph_capturable() is None) == (moe.gate_up_t is not None)
    x = torch.randn(40, H)
    ref, routes = _moe_oracle(t, x, cfg, shared is not None, bias, shared_gate)
    got = moe(x)
    err = (got.double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, f"max relative error {err:.2e}"
    assert len({tuple(sorted(r)) for r in routes}) > 4, "routing should differ between tokens"
    # a batched [B, S, H] input gives the same rows
    torch.testing.assert_close(moe(x.view(4, 10, H)).view(40, H), got)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_gemm", "sliced"])
def test_moe_bf16_close_to_fp32(grouped: bool) -> None:
    cfg = CONFIGS["sigmoid_grouped_top2"]
    H, I = 32, 16
    t = _moe_tensors("m", cfg.num_experts, H, I, 32, False, True, False)
    x = torch.randn(40, H)
    ref = _build(t, cfg, H, I, 32, True, False)(x)
    m16 = _build(t, cfg, H, I, 32, True, False, dtype=torch.bfloat16, grouped=grouped)
    with pin_routing({m16: _build(t, cfg, H, I, 32, True, False).select(x)[1]}):  # same experts as fp32
        got = m16(x.bfloat16())
    assert got.dtype == torch.bfloat16
    assert (got.float() - ref).abs().max() / ref.abs().max() < 2e-2


def test_grouped_path_shares_expert_memory() -> None:
    cfg = CONFIGS["softmax_greedy"]
    t = _moe_tensors("m", cfg.num_experts, 32, 16, None, False, False, False)
    moe = _build(t, cfg, 32, 16, None, False, False)
    if moe.gate_up_t is None:
        pytest.skip("grouped GEMM unavailable on this torch build")
    assert moe.experts is not None
    # the per-expert linears are views of the stacked tensors, not copies
    assert moe.experts[3].up.weight.data_ptr() == moe.gate_up_t[3].T[16:].data_ptr()


def test_moe_unload_and_missing_experts() -> None:
    from exl3_core.nn.module import WeightError

    cfg = CONFIGS["softmax_greedy"]
    t = _moe_tensors("m", cfg.num_experts, 32, 16, None, False, False, False)
    moe = _build(t, cfg, 32, 16, None, False, False)
    moe.unload_weights()
    assert moe.experts is None and moe.router is None
    broken = {k: v for k, v in t.items() if ".experts." not in k}
    with pytest.raises(WeightError, match="no experts found"):
        _build(broken, cfg, 32, 16, None, False, False)
