"""EXL3 quantizer: Hessian finalisation, regularisation, LDLQ, stored tensors, bit allocation.

Quality tests use the real tail-biting Viterbi (compiled op); without it they skip, and the
structural tests run with a small greedy stand-in encoder defined here.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest
import torch

from exl3_core.quant.exl3 import codebook as cb
from exl3_core.quant.exl3 import viterbi
from exl3_core.quant.exl3.allocation import AllocItem, allocate_bits, average_bits
from exl3_core.quant.exl3.dequant import reconstruct
from exl3_core.quant.exl3.hadamard import get_hadamard
from exl3_core.quant.exl3.hessian import HessianAccumulator, finalize_hessian, sign_pattern
from exl3_core.quant.exl3.ldlq import ldlq
from exl3_core.quant.exl3.quantize import quantize_linear, tensor_storage_entry
from exl3_core.quant.exl3.regularize import regularize, sample_scale_tiles, search_global_scale
from exl3_core.quant.exl3.trellis import check_states, check_wrap, pack_trellis, unpack_states

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "exl3-golden"  # vendored copy
HAS_VITERBI = viterbi.has_cpp()
needs_viterbi = pytest.mark.skipif(
    not HAS_VITERBI, reason="compiled exl3::viterbi_encode not built (python setup.py build_ext --inplace)"
)


def greedy_encoder(tiles: torch.Tensor, K: int, codebook: int) -> torch.Tensor:
    """Test stand-in: per-position greedy symbol choice, two passes, states re-derived circularly.

    Much worse than Viterbi but fast and always tail-biting consistent (states come from the
    packed stream itself).
    """
    lut = cb.lut(codebook).to(torch.float32)
    n = tiles.shape[0]
    cand = torch.arange(1 << K, dtype=torch.int64)
    state = torch.zeros(n, dtype=torch.int64)
    sym = torch.zeros(n, 256, dtype=torch.int64)
    for _ in range(2):  # the second pass starts from the first pass's end state
        for p in range(256):
            s = ((state[:, None] << K) | cand[None, :]) & 0xFFFF
            best = (lut[s] - tiles[:, p : p + 1]).pow(2).argmin(dim=1)
            state = s[torch.arange(n), best]
            sym[:, p] = state & ((1 << K) - 1)
    return unpack_states(pack_trellis(sym, K), K)


ENC = None if HAS_VITERBI else greedy_encoder


def correlated_x(rows: int, k: int, seed: int, strength: float = 0.3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(k, k, generator=g) / math.sqrt(k) + strength * torch.eye(k)
    return torch.randn(rows, k, generator=g) @ a


def hf_weight(out_f: int, in_f: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.02
    return w * (1 + torch.rand(out_f, 1, generator=g))  # uneven output channels


def h_weighted_rel(w_q: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> float:
    """tr(E H Eᵀ)/tr(W H Wᵀ) for HF-orientation weights, fp64."""
    e, w, h = (t.double() for t in (w_q - w, w, h))
    return float(torch.trace(e @ h @ e.T) / torch.trace(w @ h @ w.T))


def bd_dense(k: int) -> torch.Tensor:
    return torch.block_diag(*[get_hadamard(128).double() / math.sqrt(128)] * (k // 128))


# ---------------------------------------------------------------- Hessian


def test_finalize_hessian_matches_dense_oracle_and_block_ldl():
    k, rows = 256, 1024
    x = correlated_x(rows, k, 0)
    acc = HessianAccumulator(k)
    acc.add(x[:600])
    acc.add(torch.cat([x[600:], torch.full((3, k), float("nan"))]))  # non-finite rows are dropped
    assert acc.count == rows
    hi = acc.finalize(seed=7)
    assert not hi.fallback and hi.k == k and hi.count == rows
    su0 = sign_pattern(k, 7)
    assert set(su0.unique().tolist()) <= {-1.0, 1.0} and torch.equal(hi.su0, su0)
    assert not torch.equal(su0, sign_pattern(k, 8))
    h = x.double().T @ x.double() / rows
    h += 0.025 * h.diagonal().mean() * torch.eye(k, dtype=torch.float64)
    bd = bd_dense(k)
    want = bd @ torch.diag(su0.double()) @ h @ torch.diag(su0.double()) @ bd
    assert torch.allclose(hi.h_rot.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # L_u is strictly block-lower (zero diagonal blocks) and (I+L_u)^-1 H' (I+L_u)^-T is block diagonal
    lu = hi.l_u.double()
    blk = torch.arange(k) // 16
    assert float(lu[blk[:, None] <= blk[None, :]].abs().max()) == 0.0
    inv = torch.linalg.inv(torch.eye(k, dtype=torch.float64) + lu)
    d = inv @ hi.h_rot.double() @ inv.T
    off = d[blk[:, None] != blk[None, :]].abs().max()
    assert float(off) < 1e-4 * float(d.abs().max())


def test_finalize_hessian_fallbacks_padding_and_retry():
    assert finalize_hessian(torch.zeros(128, 128), 0).fallback
    nan_h = torch.eye(128)
    nan_h[3, 3] = float("nan")
    assert finalize_hessian(nan_h, 10).fallback
    tiny = finalize_hessian(torch.eye(128) * 1e-25, 1)
    assert tiny.fallback and tiny.l_u is None and "1e-20" in tiny.reason
    # a 320-wide input is zero-padded to the stored 384
    assert finalize_hessian(correlated_x(500, 320, 1).T @ correlated_x(500, 320, 1), 500).k == 384
    # indefinite H (eigenvalue -0.2): damping 0.025 is not enough, retries add 0.05 until it factors
    u = torch.randn(128, generator=torch.Generator().manual_seed(0))
    u /= u.norm()
    h = torch.eye(128) - 1.2 * torch.outer(u, u)
    hi = finalize_hessian(h, 1, sigma_reg=0.025)
    assert not hi.fallback and hi.damping > 0.2 and torch.isfinite(hi.l_u).all()
    with pytest.warns(UserWarning, match="Cholesky failed"):
        assert finalize_hessian(torch.eye(128) - 3 * torch.outer(u, u), 1).fallback


# ---------------------------------------------------------------- regularisation and LDLQ


def test_regularize_is_exact_before_quantization():
    k, n = 256, 384
    w = torch.zeros(k, n)
    w[:, :300] = hf_weight(300, k, 1).T  # trailing zero columns, like padding
    hi = finalize_hessian(correlated_x(800, k, 2).T @ correlated_x(800, k, 2), 800, seed=3)
    for mode in ("always", "never"):
        w_rot, su, sv, g = regularize(w, hi, out_scales=mode, codebook="mul1", K=4, seed=5, encoder=ENC)
        assert 0.01 <= g <= 2.2
        assert torch.equal(sv[300:], torch.zeros(n - 300))
        assert torch.equal(torch.sign(su) * -1, hi.su0)  # shared input signs (spec's minus sign)
        bd_k, bd_n = bd_dense(k), bd_dense(n)
        back = torch.diag(su.double()) @ bd_k @ w_rot.double() @ bd_n @ torch.diag(sv.double())
        assert torch.allclose(back, w.double(), atol=1e-6 * float(w.abs().max()))
        if mode == "never":
            assert torch.equal(sv[:300].abs(), torch.ones(300))


def test_regularize_scales_match_golden_checkpoint():
    """Output scales are Hessian-independent: svh must equal the reference engine's bit for bit, and
    |suh| must match up to the (random-sign dependent) global scale g."""
    ck_path = GOLDEN / "exl3" / "model_c_exl3_3.0bpw_mul1" / "model.safetensors"
    hf_path = GOLDEN / "hf" / "model_c" / "model.safetensors"
    if not (ck_path.exists() and hf_path.exists()):
        pytest.skip(f"golden data missing under {GOLDEN}")
    from safetensors.torch import load_file

    from exl3_core.quant.exl3.hessian import fallback_hessian

    hf, ck = load_file(str(hf_path)), load_file(str(ck_path))
    for key in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
        w = hf[f"{key}.weight"].float().T
        i, o = w.shape
        k, n = -(-i // 128) * 128, -(-o // 128) * 128
        wp = torch.zeros(k, n)
        wp[:i, :o] = w
        _, su, sv, _g = regularize(wp, fallback_hessian(i), K=4, codebook="mul1", encoder=ENC)
        assert torch.equal(sv.half().abs(), ck[f"{key}.svh"].abs()), key
        ratio = su.abs() / ck[f"{key}.suh"].float().abs()
        assert float(ratio.std() / ratio.mean()) < 1e-3, key
        assert 0.8 < float(ratio.mean()) < 1.25, key  # both global scales land near the same optimum


@needs_viterbi
def test_global_scale_search_near_brute_force():
    g = torch.Generator().manual_seed(4)
    w_rot = torch.randn(128, 256, generator=g) * 1.25
    tiles = sample_scale_tiles(w_rot)
    assert tiles.shape[1] == 256 and 24 <= tiles.shape[0] <= 128
    best, err = search_global_scale(tiles, 4, cb.CB_MUL1)
    grid = [0.45 + 0.05 * i for i in range(13)]
    assert grid[0] < best < grid[-1]
    batch = torch.cat([tiles * s for s in grid])
    vals = cb.lut(cb.CB_MUL1).float()[viterbi.encode_tiles(batch, 4, cb.CB_MUL1).long()]
    errs = [
        float(((vals[i * len(tiles) : (i + 1) * len(tiles)] / s - tiles) ** 2).mean())
        for i, s in enumerate(grid)
    ]
    assert err <= min(errs) * 1.03
    # scaling the data by 2 halves the best global scale
    half, _ = search_global_scale(tiles * 2, 4, cb.CB_MUL1)
    assert abs(half - best / 2) < 0.08 * best


def test_ldlq_beats_plain_tile_quantization_on_h_weighted_error():
    k, n, K = 256, 128, 2
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2000, 24, generator=g) @ torch.randn(24, k, generator=g) + 0.05 * torch.randn(
        2000, k, generator=g
    )
    hi = finalize_hessian(x.T @ x, 2000, seed=1)
    w_rot = torch.randn(k, n, generator=g)
    s_fb, w_fb = ldlq(w_rot, hi.l_u, K, "mul1", encoder=ENC)
    s_pl, w_pl = ldlq(w_rot, None, K, "mul1", encoder=ENC)
    h = hi.h_rot.double()

    def herr(w_hat: torch.Tensor) -> float:
        e = (w_rot - w_hat).double()
        return float(torch.trace(e.T @ h @ e))

    assert herr(w_fb) < 0.5 * herr(w_pl)
    for s in (s_fb, s_pl):
        assert s.shape == (k // 16, n // 16, 256)
        assert bool(check_wrap(s, K).all()) and bool(check_states(s, K).all())
        assert torch.equal(unpack_states(pack_trellis(s, K), K), s)
    # Ŵ is exactly the codebook value of each state, placed in tensor-core order
    from exl3_core.quant.exl3.trellis import decode_inner

    assert torch.equal(decode_inner(pack_trellis(s_fb, K), K, cb.CB_MUL1).float(), w_fb)
    # span size only changes the order of float sums, not the algorithm
    _, w_fb64 = ldlq(w_rot, hi.l_u, K, "mul1", buf_size_k=64, encoder=ENC)
    assert herr(w_fb64) < 0.5 * herr(w_pl)


# ---------------------------------------------------------------- quantize_linear


@needs_viterbi
def test_quality_falls_with_k_and_reader_reconstruction_matches():
    in_f, out_f, rows = 256, 384, 2048
    x = correlated_x(rows, in_f, 11)
    h = x.T @ x
    hi = finalize_hessian(h, rows, seed=2)
    w = hf_weight(out_f, in_f, 12)
    limits = {2: 0.1, 3: 0.05, 4: 0.01}  # spec 7 proxy_err thresholds
    errs = []
    for K, limit in limits.items():
        q = quantize_linear(w, hi, K=K, codebook="mul1", seed=K, name=f"test.K{K}")
        assert not q.fallback and q.proxy_err < limit, q.summary()
        w_q = reconstruct(q.trellis, q.suh, q.svh, K, cb.CB_MUL1)[:in_f, :out_f].T  # how a reader decodes
        e = h_weighted_rel(w_q, w, h)
        assert e == pytest.approx(q.proxy_err, rel=0.25)  # rotation preserves the H-weighted error
        errs.append(e)
    assert all(b < 0.5 * a for a, b in itertools.pairwise(errs)), errs


@pytest.mark.parametrize(
    ("codebook", "marker", "value"),
    [("mul1", "mul1", -2082680531), ("mcg", "mcg", -877912083), ("3inst", None, None)],
)
def test_stored_tensors_shapes_dtypes_markers(codebook, marker, value):
    in_f, out_f, K = 128, 384, 3
    hi = finalize_hessian(correlated_x(600, in_f, 3).T @ correlated_x(600, in_f, 3), 600, seed=0)
    bias = torch.randn(out_f, dtype=torch.bfloat16)
    q = quantize_linear(
        hf_weight(out_f, in_f, 4).bfloat16(), hi, K=K, codebook=codebook, seed=1, bias=bias, encoder=ENC
    )
    t = q.tensors("blk.proj")
    want = {"blk.proj.suh", "blk.proj.svh", "blk.proj.trellis", "blk.proj.bias"} | (
        {f"blk.proj.{marker}"} if marker else set()
    )
    assert set(t) == want
    assert t["blk.proj.trellis"].dtype == torch.int16 and t["blk.proj.trellis"].shape == (8, 24, 16 * K)
    assert t["blk.proj.suh"].dtype == torch.float16 and t["blk.proj.suh"].shape == (128,)
    assert t["blk.proj.svh"].dtype == torch.float16 and t["blk.proj.svh"].shape == (384,)
    assert t["blk.proj.bias"].dtype == torch.float16 and torch.equal(t["blk.proj.bias"], bias.half())
    if marker:
        m = t[f"blk.proj.{marker}"]
        assert m.dtype == torch.int32 and m.dim() == 0 and int(m) == value
    assert bool(check_wrap(unpack_states(q.trellis), K).all())
    entry = tensor_storage_entry(t)
    assert entry["quant_format"] == "exl3" and entry["bits_per_weight"] == K
    assert entry["stored_tensors"]["blk.proj.trellis"] == {
        "shape": [8, 24, 48],
        "n_bytes": 8 * 24 * 48 * 2,
        "dtype": "torch.int16",
    }
    assert entry["stored_tensors"]["blk.proj.suh"]["dtype"] == "torch.float16"
    mult = {"mul1": 2212286765, "mcg": 3417055213}
    assert {k: v for k, v in entry.items() if k.endswith("_multiplier")} == (
        {f"{marker}_multiplier": mult[marker]} if marker else {}
    )


def test_tensor_storage_entry_matches_golden_layout():
    path = GOLDEN / "exl3" / "model_c_exl3_3.0bpw_mcg" / "quantization_config.json"
    if not path.exists():
        pytest.skip(f"golden data missing at {path}")
    golden = json.loads(path.read_text())["tensor_storage"]["model.layers.0.self_attn.q_proj"]
    key = "model.layers.0.self_attn.q_proj"
    tensors = {}
    for name, spec in golden["stored_tensors"].items():
        dtype = getattr(torch, spec["dtype"].removeprefix("torch."))
        tensors[name] = torch.zeros(spec["shape"], dtype=dtype)
    assert tensor_storage_entry(tensors) == golden and key in next(iter(tensors))


def test_padding_320x480_gives_384x512_and_zero_padded_outputs():
    in_f, out_f, K = 320, 480, 4
    x = correlated_x(700, in_f, 5)
    hi = finalize_hessian(x.T @ x, 700, seed=4)
    w = hf_weight(out_f, in_f, 6)
    q = quantize_linear(
        w, hi, K=K, codebook="mul1", seed=2, in_features=in_f, out_features=out_f, encoder=ENC
    )
    assert q.trellis.shape == (24, 32, 64) and q.suh.shape == (384,) and q.svh.shape == (512,)
    assert torch.equal(q.svh[out_f:], torch.zeros(512 - out_f, dtype=torch.float16))
    full = reconstruct(q.trellis, q.suh, q.svh, K, cb.CB_MUL1)
    assert torch.equal(full[:, out_f:], torch.zeros(384, 512 - out_f))  # padded outputs exactly zero
    w_q = q.dequantize()
    assert w_q.shape == (out_f, in_f) and torch.allclose(
        w_q, full[:in_f, :out_f].T, rtol=0, atol=1e-5 * float(full.abs().max())
    )
    assert h_weighted_rel(w_q, w, x.T @ x) < (0.01 if HAS_VITERBI else 0.4)
    # no Hessian: plain tile quantization, still a valid checkpoint
    qf = quantize_linear(w, None, K=K, seed=2, encoder=ENC)
    assert qf.fallback and qf.trellis.shape == (24, 32, 64) and qf.nmse < (0.03 if HAS_VITERBI else 0.6)


def test_bad_inputs_raise_clear_errors():
    w = hf_weight(128, 128, 0)
    for K in (0, 9, 2.5, True):
        with pytest.raises(ValueError, match="K="):
            quantize_linear(w, None, K=K, encoder=ENC, name="layer.x")
    bad = w.clone()
    bad[3, 4] = float("inf")
    with pytest.raises(ValueError, match="layer.x: weight has 1 non-finite"):
        quantize_linear(bad, None, K=2, encoder=ENC, name="layer.x")
    with pytest.raises(ValueError, match="codebook"):
        quantize_linear(w, None, K=2, codebook="e8p", encoder=ENC)
    with pytest.raises(ValueError, match="out_scales"):
        quantize_linear(w, None, K=2, out_scales="sometimes", encoder=ENC)
    with pytest.raises(ValueError, match="Hessian is for 256"):
        quantize_linear(w, finalize_hessian(torch.eye(256), 1), K=2, encoder=ENC, name="layer.x")
    with pytest.raises(ValueError, match="does not match"):
        quantize_linear(w, None, K=2, in_features=100, encoder=ENC)
    with pytest.raises(ValueError, match="square"):
        finalize_hessian(torch.zeros(4, 5), 1)
    with pytest.raises(RuntimeError, match="tail-biting"):
        quantize_linear(w, None, K=2, encoder=lambda t, K, c: torch.randint(0, 65536, t.shape))


# ---------------------------------------------------------------- allocation


def _stack(n_layers: int) -> list[AllocItem]:
    items = []
    for i in range(n_layers):
        p = f"layers.{i}"
        items += [
            AllocItem(f"{p}.attn.q", 4096, f"{p}.attn.qkv", 2, i),
            AllocItem(f"{p}.attn.k", 1024, f"{p}.attn.qkv", 2, i),
            AllocItem(f"{p}.attn.v", 1024, f"{p}.attn.qkv", 2, i),
            AllocItem(f"{p}.attn.o", 4096, f"{p}.attn.o", 2, i),
            AllocItem(f"{p}.mlp.gate", 12288, f"{p}.mlp.in", 1, i),
            AllocItem(f"{p}.mlp.up", 12288, f"{p}.mlp.in", 1, i),
            AllocItem(f"{p}.mlp.down", 12288, f"{p}.mlp.down", 1, i),
        ]
    return items


@pytest.mark.parametrize("bpw", [1.0, 2.0, 2.3, 2.5, 3.25, 4.07, 5.5, 7.9, 8.0])
def test_allocation_budget_integer_and_tight(bpw):
    items = _stack(10)
    alloc = allocate_bits(items, bpw, head_keys=["head"], head_bits=6)
    assert alloc["head"] == 6
    ks = [alloc[it.key] for it in items]
    assert all(isinstance(K, int) and 1 <= K <= 8 for K in ks)
    total = sum(it.numel for it in items)
    used = sum(alloc[it.key] * it.numel for it in items)
    budget = math.floor(bpw * total)
    assert used <= budget and average_bits(alloc, items) <= bpw
    # tight: no group below 8 bits could still take one more bit
    groups: dict[str, int] = {}
    for it in items:
        groups[it.group] = groups.get(it.group, 0) + it.numel
    left = budget - used
    assert all(
        cost > left or alloc[next(i.key for i in items if i.group == g)] == 8 for g, cost in groups.items()
    )
    assert allocate_bits(items, bpw, head_keys=["head"]) == alloc  # deterministic
    for g in groups:  # one K per group
        assert len({alloc[it.key] for it in items if it.group == g}) == 1


def test_allocation_priority_then_stack_ends():
    items = _stack(10)
    alloc = allocate_bits(items, 2.25, head_keys=[])
    attn = [alloc[it.key] for it in items if ".attn." in it.key]
    mlp = {it.layer: alloc[it.key] for it in items if it.group.endswith("mlp.down")}
    assert min(attn) == 3  # 0.25 extra bits cover every attention group first
    # MLP upgrades go to the layers nearest the ends of the stack
    upgraded = sorted(i for i, K in mlp.items() if K == 3)
    assert upgraded and all(
        min(i, 9 - i) <= min(j, 9 - j) for i in upgraded for j in mlp if j not in upgraded
    )
    # order of the input list does not matter for distinct priorities/distances
    shuffled = items[:]
    random.Random(0).shuffle(shuffled)
    assert allocate_bits(shuffled, 2.25) == alloc


def test_allocation_reproduces_golden_mixed_checkpoint():
    path = GOLDEN / "exl3" / "model_c_exl3_2.5bpw" / "quantization_config.json"
    if not path.exists():
        pytest.skip(f"golden data missing at {path}")
    storage = json.loads(path.read_text())["tensor_storage"]
    items, want = [], {}
    for key, entry in storage.items():
        if entry.get("quant_format") != "exl3" or not key.startswith("model.layers."):
            continue
        shape = next(s["shape"] for n, s in entry["stored_tensors"].items() if n.endswith(".trellis"))
        layer = int(key.split(".")[2])
        leaf = key.rsplit(".", 1)[1]
        group = {
            "q_proj": "qkv",
            "k_proj": "qkv",
            "v_proj": "qkv",
            "o_proj": "o",
            "gate_proj": "in",
            "up_proj": "in",
        }.get(leaf, leaf)
        prio = 2 if ".self_attn." in key else 1
        items.append(AllocItem(key, shape[0] * shape[1] * 256, f"{layer}.{group}", prio, layer))
        want[key] = entry["bits_per_weight"]
    alloc = allocate_bits(items, 2.5, head_keys=["lm_head"], head_bits=6)
    assert {k: alloc[k] for k in want} == want and alloc["lm_head"] == storage["lm_head"]["bits_per_weight"]


def test_allocation_bad_inputs():
    items = _stack(2)
    for bpw in (0.5, 8.5, float("nan")):
        with pytest.raises(ValueError, match="bpw"):
            allocate_bits(items, bpw)
    with pytest.raises(ValueError, match="listed twice"):
        allocate_bits(items + items[:1], 3.0)
    with pytest.raises(ValueError, match="mixes priorities"):
        allocate_bits([AllocItem("a", 10, "g", 1, 0), AllocItem("b", 10, "g", 2, 0)], 3.0)
    with pytest.raises(ValueError, match="fixed bits"):
        allocate_bits(items, 3.0, head_keys=["head"], head_bits=12)
    assert allocate_bits([("a", 10, "g", 0, None)], 3.0, fixed={"emb": 16}) == {"emb": 16, "a": 3}
