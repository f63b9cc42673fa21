"""The quantized KV cache (variant "quant", format spec 6) on CPU: the torch reference against the format's
definition, the Triton store and read kernels (interpreter) against the reference on fresh random inputs
(bit-exact codes and scales; attention within fp16 tolerance), the cache layers' accounting and options,
the engine (fused plan, generator, prefix cache, multi-token steps) over a quantized cache, and the
errors for bad options. GPU runs: tests/gpu/test_kv_quant_gpu.py."""
from __future__ import annotations

import argparse
import math
from typing import Any

import pytest
import torch

from exl3_core import ops
from exl3_core.archkit.batch import BatchMeta
from exl3_core.attention.spec import AttnSpec, CallShape
from exl3_core.bench.models import build_model, parse_shape
from exl3_core.cache import Cache
from exl3_core.cache.geometry import LayerGeometry
from exl3_core.cache.kv_quant import KVQuantLayer, MLAQuantLayer
from exl3_core.cache_bits import CacheBits, add_cache_bits_arg, cache_kwargs, cache_variants, parse_cache_bits
from exl3_core.plan import ExecutionPlan
from exl3_core.reference import fused as fused_ref
from exl3_core.reference import kv_quant as ref
from exl3_core.reference.attention import attention as reference_attention
from exl3_core.testing.attention import Case, check_backend, default_cases, make_args, tolerance
from exl3_core.testing.kernels import EmulatedKernels

triton = pytest.importorskip("triton")  # the interpreter runs the kernels
from exl3_attn_backends import triton_paged as tp

from exl3_core.kernels import kv_quant as kq

PAGE = 16
ALL_BITS = list(range(2, 9))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- the reference against the format's definition ------------------------------------------------------------
def test_hadamard32_is_the_normalised_sylvester_matrix() -> None:
    h = torch.ones(1, 1)
    while h.shape[0] < 32:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    x = torch.randn(7, 96, generator=_gen(0))
    want = (x.view(7, 3, 32) @ h.T / math.sqrt(32)).view(7, 96)
    torch.testing.assert_close(ref.hadamard32(x), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ref.hadamard32(ref.hadamard32(x)), x, rtol=1e-5, atol=1e-5)  # its own inverse


def _pack_by_definition(codes: list[int], bits: int) -> list[int]:
    """One group's words from the format's words: planes widest first (8, 4, 2, 1) of the bits present; a w-bit
    plane takes w words and holds bits [low, low + w) of value j at bits [j * w, (j + 1) * w) of the plane."""
    widths = [w for w in (8, 4, 2, 1) if bits & w]
    words: list[int] = []
    low = bits
    for w in widths:
        low -= w
        plane = 0
        for j, c in enumerate(codes):
            plane |= ((c >> low) & ((1 << w) - 1)) << (j * w)
        words += [(plane >> (32 * i)) & 0xFFFFFFFF for i in range(w)]
    return words


@pytest.mark.parametrize("bits", ALL_BITS)
def test_pack_follows_the_plane_layout(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (3, 2, 32), generator=_gen(bits))
    words = ref.pack(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (3, 2 * bits)
    for t in range(3):
        for g in range(2):
            got = [w & 0xFFFFFFFF for w in words[t, g * bits:(g + 1) * bits].tolist()]
            assert got == _pack_by_definition(codes[t, g].tolist(), bits)
    assert torch.equal(ref.unpack(words, bits), codes)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_quantize_error_within_half_a_step(bits: int) -> None:
    """Per group, in the rotated basis every value is within half a grid step (s / 2^bits) of its code's
    midpoint, plus the fp16 rounding of the scale; the rotation keeps the L2 error of each group."""
    x = torch.randn(40, 128, generator=_gen(bits)) * torch.rand(40, 1, generator=_gen(1)) * 5
    x[3] = 0.0  # an all-zero row: a tiny nonzero scale, exact zeros back
    words, scales = ref.quantize(x, bits)
    assert words.shape == (40, 4 * bits) and scales.shape == (40, 4) and scales.dtype == torch.float16
    y = ref.dequantize(words, scales, bits)
    assert torch.equal(y[3], torch.zeros(128))
    s = scales.float()[..., None]
    bound = (0.5 / (1 << (bits - 1)) + 2.0 ** -11) * s * math.sqrt(32) * (1 + 1e-5)
    err = (y - x).view(40, 4, 32).norm(dim=-1, keepdim=True)
    assert (err <= bound).all(), (err / bound).max()
    rel = ((y - x).pow(2).mean() / x.pow(2).mean()).sqrt().item()
    assert rel < 2.0 ** (1 - bits)  # each extra bit halves the error


def test_check_bits_names_the_option() -> None:
    for bad in (1, 9, 16, 4.0, "4", True):
        with pytest.raises(ValueError, match=r"k_bits=.*2 to 8"):
            ref.check_bits("k_bits", bad)


# -- store kernels: bit-exact against the reference -----------------------------------------------------------
def _pages(pages: int, width: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((pages, PAGE, width // 32 * bits), -7, dtype=torch.int32),
            torch.full((pages, PAGE, width // 32), -3.0, dtype=torch.float16))


@pytest.mark.parametrize("bits", [(4, 4), (8, 3), (2, 7), (5, 6)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quant_write_is_bit_exact(bits: tuple[int, int], dtype: torch.dtype) -> None:
    kb, vb = bits
    T, H, D, DV = 6, 3, 64, 96
    g = _gen(kb * 10 + vb)
    # k and v as column slices of one projection output (row stride past the row), values up to ~40
    qkv = (torch.randn(T, H * (D + DV) + 32, generator=g) * torch.rand(T, 1, generator=g) * 40).to(dtype)
    k = qkv[:, :H * D].view(T, H, D)
    v = qkv[:, H * D:H * (D + DV)].view(T, H, DV)
    slots = torch.randperm(4 * PAGE, generator=g)[:T]
    kc, ks = _pages(4, H * D, kb)
    vc, vs = _pages(4, H * DV, vb)
    want = [t.clone() for t in (kc, ks, vc, vs)]
    kq.quant_write(k, v, slots, kc, ks, vc, vs, kb, vb)
    ref.quant_write(want[0], want[1], k, slots, kb)
    ref.quant_write(want[2], want[3], v, slots, vb)
    for got, exp in zip((kc, ks, vc, vs), want):
        assert torch.equal(got, exp)  # codes and scales; untouched slots keep their poison


@pytest.mark.parametrize("interleaved,per_head", [(False, True), (True, True), (False, False)])
def test_rope_quant_write_rotates_then_stores_exactly(interleaved: bool, per_head: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways of splitting the store over programs: a program per key and per value head (few tokens), one per
    side (many)."""
    if not per_head:
        monkeypatch.setattr(kq, "SPLIT_HEAD_PROGRAMS", 0)
    T, HQ, HK, D, kb, vb = 5, 8, 2, 128, 4, 5
    g = _gen(int(interleaved))
    q = torch.randn(T, HQ, D, generator=g).half()
    k = (torch.randn(T, HK, D, generator=g) * 3).half()
    v = torch.randn(T, HK, D, generator=g).half()
    pos = torch.arange(100, 100 + T)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = fused_ref.rope_tables(pos, inv)
    slots = torch.randperm(3 * PAGE, generator=g)[:T]
    kc, ks = _pages(3, HK * D, kb)
    vc, vs = _pages(3, HK * D, vb)
    qr, kr = q.clone(), k.clone()
    fused_ref.rope_apply(qr, kr, cos, sin, D, interleaved)
    q2, k2 = q.clone(), k.clone()
    kq.rope_quant_write(q2, k2, v, slots, cos, sin, D, interleaved, kc, ks, vc, vs, kb, vb)
    torch.testing.assert_close(q2, qr, rtol=0, atol=2e-3)  # rotated in place, as the unquantized store does
    torch.testing.assert_close(k2, kr, rtol=0, atol=2e-3)
    want = _pages(3, HK * D, kb) + _pages(3, HK * D, vb)
    ref.quant_write(want[0], want[1], k2, slots, kb)  # the codes of the key it stored, bit for bit
    ref.quant_write(want[2], want[3], v, slots, vb)
    for got, exp in zip((kc, ks, vc, vs), want):
        assert torch.equal(got, exp)


def test_store_kernels_refuse_bad_pages() -> None:
    k = torch.randn(2, 2, 64).half()
    kc, ks = _pages(2, 128, 4)
    with pytest.raises(ValueError, match=r"k pages must be contiguous int32 \[\.\.\., 12\]"):
        kq.quant_write(k, None, torch.tensor([0, 1]), kc, ks, None, None, 3, 3)
    with pytest.raises(ValueError, match="k_bits=9"):
        kq.quant_write(k, None, torch.tensor([0, 1]), kc, ks, None, None, 9, 9)
    with pytest.raises(ValueError, match="one slot per token"):
        kq.quant_write(k, None, torch.tensor([0]), kc, ks, None, None, 4, 4)


# -- read kernels: the conformance cases, and the split route at every split count -----------------------------
# fp16: the fp32 cases run in tests/contract and the plugin's own tests
QUANT_CASES = [c for c in default_cases("cpu", torch.float16) if c.spec.cache is not None
               and c.spec.cache.endswith("/quant")]


@pytest.mark.parametrize("case", QUANT_CASES, ids=lambda c: c.id)
def test_triton_reads_quantized_views(case: Case) -> None:
    backend = tp.TritonPagedAttention()
    assert backend.unsupported_reasons(case.spec) == []
    check_backend(backend, case, "cpu", seed=7)


@pytest.mark.parametrize("splits,dtype", [(1, torch.float16), (2, torch.float32), (5, torch.float16)])
# each split count once, both dtypes; bf16 here: tests/gpu (the interpreter's bf16 stores in this kernel are wrong
# for the unquantized bf16 view as well)
def test_split_decode_reads_quantized_views(splits: int, dtype: torch.dtype) -> None:
    """Every split count (the merge of rotated partials, the one-split path), several key chunks per split, and
    the newest row reloaded after the wait, as a programmatic dependent does."""
    spec = AttnSpec(head_dim=64, num_q_heads=8, num_kv_heads=2, dtype=dtype, cache="kv/quant", phase="decode",
                    q_per_seq=1, page_size=PAGE)
    args = make_args(Case(spec, (1, 1, 1, 0), (0, 270, 33, 12), (3, 6)), "cpu", seed=splits)
    refo = reference_attention(args)
    for reload in (False, True):
        out = tp.decode_split_kv(args, splits, reload_fresh=reload)
        rows = args.cu_seqlens_q[1:] > args.cu_seqlens_q[:-1]
        err = (out[: int(args.cu_seqlens_q[-1])].float() - refo.float()).abs().max().item()
        assert err <= tolerance(dtype) * max(1.0, refo.float().abs().max().item()), (splits, reload, err, rows)


def test_backends_that_cannot_read_decline_with_reasons() -> None:
    from exl3_attn_backends.cuda_decode import CudaDecodeAttention, check_quant_call
    from exl3_attn_backends.dense import DenseCausalAttention

    spec = AttnSpec(head_dim=80, num_q_heads=4, num_kv_heads=2, dtype=torch.float16, cache="kv/quant", page_size=16)
    assert any("multiples of 32" in r for r in tp.TritonPagedAttention().unsupported_reasons(spec))
    cuda = AttnSpec(head_dim=128, num_q_heads=8, num_kv_heads=2, dtype=torch.float16, cache="mla/quant",
                    phase="decode", device_type="cuda", device_cc=(9, 0), max_keys=256, num_seqs=1, q_per_seq=1,
                    sm_count=132, page_size=256)
    assert any("kv/quant" in r for r in CudaDecodeAttention().unsupported_reasons(cuda))
    assert DenseCausalAttention().unsupported_reasons(spec._replace(device_type="cuda"))
    # the CUDA kernel's host-side checks name what does not fit (here: CPU tensors and a wrong bit width)
    args = make_args(Case(AttnSpec(head_dim=64, num_q_heads=8, num_kv_heads=2, dtype=torch.float16,
                                   cache="kv/quant", phase="decode", page_size=PAGE), (1, 1), (5, 9), (4, 4)))
    assert args.quant is not None
    bad = check_quant_call(args.q, args.k_cache, args.v_cache, args.quant, args.page_table, args.cu_seqlens_q,
                           args.seq_lens_k)
    assert len(bad) == 1 and "must be on the GPU" in bad[0]
    bad = check_quant_call(args.q, args.k_cache, args.v_cache, args.quant._replace(k_bits=5), args.page_table,
                           args.cu_seqlens_q, args.seq_lens_k)
    assert any("do not fit" in b for b in bad)


# -- layers: accounting, pages, options ------------------------------------------------------------------------
@pytest.mark.parametrize("geo", [(2, 64, 64, 4, 4), (8, 128, 128, 8, 3), (1, 96, 32, 2, 7)])
def test_bytes_per_token_is_exact(geo: tuple[int, int, int, int, int]) -> None:
    heads, d, dv, kb, vb = geo
    per = KVQuantLayer.bytes_per_token(heads, d, dv, torch.float16, k_bits=kb, v_bits=vb)
    layer = KVQuantLayer(num_pages=3, page_size=PAGE, num_kv_heads=heads, head_dim=d, head_dim_v=dv,
                         dtype=torch.float16, device="cpu", k_bits=kb, v_bits=vb)
    fixed = KVQuantLayer.fixed_bytes(heads, d, dv, torch.float16, 3, k_bits=kb, v_bits=vb)
    assert layer.storage_size() == per * 3 * PAGE + fixed
    assert fixed > 0 and KVQuantLayer.fixed_bytes(heads, d, dv, torch.float16, 3, k_bits=kb, v_bits=vb, recent=0) == 0
    latent = MLAQuantLayer.bytes_per_token(1, 96, 64, torch.bfloat16, k_bits=kb)
    mla = MLAQuantLayer(num_pages=3, page_size=PAGE, num_kv_heads=1, head_dim=96, head_dim_v=64,
                        dtype=torch.bfloat16, device="cpu", k_bits=kb)
    assert mla.storage_size() == latent * 3 * PAGE


def _geometry_model(attention: list[str] | None = None):
    model, _ = build_model(parse_shape("custom(256,512,2,4,2,300)"), device="cpu", dtype=torch.float16, seed=3,
                           attention=attention)
    return model


def test_capacity_at_4_bits_is_over_3_5x_fp16() -> None:
    """The 4096-token sequences a K4V4 cache holds in the bytes of an fp16 one (each with its ring of recent rows), by
    the caches' own planning figures, which equal what they allocate."""
    model = _geometry_model()
    small = Cache(model, 4 * PAGE, page_size=PAGE, variant="quant", k_bits=4, v_bits=4, recent=16, recent_seqs=3,
                  device="cpu", dtype=torch.float16)
    assert small.storage_size() == small.bytes_for(torch.float16) and small.ring_slots == 4
    seq, fp16_seqs = 4096, 64
    fp16 = Cache(model, fp16_seqs * seq, page_size=256).bytes_for(torch.float16)

    def most(**opts: int) -> int:  # the most sequences whose pages (and rings) fit in fp16's bytes
        n = 3 * fp16_seqs
        while Cache(model, (n + 1) * seq, page_size=256, variant="quant", k_bits=4, v_bits=4,
                    **{k: (n + 1 if v < 0 else v) for k, v in opts.items()}).bytes_for(torch.float16) <= fp16:
            n += 1
        return n

    assert most(recent_seqs=-1) >= 3.5 * fp16_seqs  # a ring slot for every sequence
    assert most(recent=0) >= 3.54 * fp16_seqs


def test_load_plan_counts_the_quantized_bytes() -> None:
    model, cache = build_model(parse_shape("custom(256,512,2,4,2,300)"), device="cpu", dtype=torch.float16, seed=3,
                               cache_tokens=5 * PAGE, page_size=PAGE,
                               cache_kwargs={"variant": "quant", "k_bits": 3, "v_bits": 6})
    rep = model.memory_report()
    assert rep["planned"]["caches"] == rep["allocated"]["caches"] == cache.storage_size()
    per_token = sum(KVQuantLayer.bytes_per_token(g.num_kv_heads, g.head_dim, g.head_dim_v, torch.float16, k_bits=3,
                                                 v_bits=6) for g in model.cache_geometry())
    fixed = sum(KVQuantLayer.fixed_bytes(g.num_kv_heads, g.head_dim, g.head_dim_v, torch.float16, cache.num_pages + 1,
                                         k_bits=3, v_bits=6) for g in model.cache_geometry())
    assert cache.storage_size() == per_token * (cache.num_pages + 1) * PAGE + fixed


def test_copy_page_and_dequantized() -> None:
    layer = KVQuantLayer(num_pages=4, page_size=PAGE, num_kv_heads=2, head_dim=64, head_dim_v=64,
                         dtype=torch.float32, device="cpu", k_bits=6, v_bits=3)
    k, v = torch.randn(PAGE, 2, 64, generator=_gen(1)), torch.randn(PAGE, 2, 64, generator=_gen(2))
    layer.write(k, v, torch.arange(PAGE, 2 * PAGE))  # page 1
    layer.copy_page(1, 3)
    kd, vd = layer.dequantized()
    assert torch.equal(kd[3], kd[1]) and torch.equal(vd[3], vd[1])
    assert ((kd[1] - k).norm() / k.norm()).item() < 2.0 ** -4 and ((vd[1] - v).norm() / v.norm()).item() < 2.0 ** -1


@pytest.mark.parametrize(("kb", "vb"), [(3, 5), (8, 2), (4, 7)])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_stored_rows_are_what_the_cache_returns(kb: int, vb: int, impl: str) -> None:
    """``stored`` hands back a step's rows as a read of the cache returns them, in their own dtype; the one-launch
    read equals the reference bit for bit."""
    g = _gen(7 + kb)
    layer = KVQuantLayer(num_pages=3, page_size=PAGE, num_kv_heads=3, head_dim=64, head_dim_v=32,
                         dtype=torch.float16, device="cpu", k_bits=kb, v_bits=vb)
    # k and v as strided column slices of one projection output, as the q/k/v split hands them over
    kv = (torch.randn(5, 3 * 96 + 8, generator=g) * torch.rand(5, 1, generator=g) * 30).half()
    k, v = kv[:, :3 * 64].view(5, 3, 64), kv[:, 3 * 64:3 * 96].view(5, 3, 32)
    assert not k.is_contiguous() and not v.is_contiguous()
    slots = torch.tensor([17, 3, 40, 41, 0])
    layer.write(k, v, slots, impl="torch")
    ks, vs = layer.stored(k, v, slots, impl=impl)  # type: ignore[arg-type]
    keys, values = layer.dequantized()
    assert vs is not None and ks.dtype == vs.dtype == torch.float16 and ks.shape == k.shape and vs.shape == v.shape
    assert torch.equal(ks, keys.view(-1, 3, 64)[slots].half()) and torch.equal(vs, values.view(-1, 3, 32)[slots].half())
    assert not torch.equal(vs if vb < kb else ks, v if vb < kb else k)  # the fewer bits moved them
    if impl == "triton":
        f32 = kq.read_rows(layer.k_codes, layer.k_scales, kb, slots, k.float())  # fp32: no rounding after
        assert f32.dtype == torch.float32 and torch.equal(f32, keys.view(-1, 3, 64)[slots])
    mla = MLAQuantLayer(num_pages=3, page_size=PAGE, num_kv_heads=1, head_dim=72, head_dim_v=64,
                        dtype=torch.float32, device="cpu", k_bits=4)
    kv = torch.randn(5, 1, 72, generator=g)
    mla.write(kv, None, slots)
    got, none = mla.stored(kv, None, slots, impl=impl)  # type: ignore[arg-type]
    assert none is None and got.shape == kv.shape
    latent = ref.dequantize(mla.codes.view(-1, mla.codes.shape[-1])[slots], mla.scales.view(-1, 2)[slots], 4)
    assert torch.equal(got[:, 0, :64], latent) and torch.equal(got[:, 0, 64:], kv[:, 0, 64:])


def test_bad_options_fail_before_allocation() -> None:
    model = _geometry_model()
    for kw, match in (({"k_bits": 9}, "k_bits=9"), ({"v_bits": 1}, "v_bits=1"), ({"k_bits": 16}, "k_bits=16"),
                      ({"bits": 4}, "takes k_bits and v_bits")):
        with pytest.raises(ValueError, match=match):
            Cache(model, 4 * PAGE, variant="quant", page_size=PAGE, **kw)
    with pytest.raises(ValueError, match="takes no options"):
        Cache(model, 4 * PAGE, page_size=PAGE, k_bits=4)
    with pytest.raises(ValueError, match=r"not a multiple of 32.*no --cache-bits"):
        Cache([LayerGeometry("kv", 2, 80, 80)], 4 * PAGE, variant="quant", page_size=PAGE)
    with pytest.raises(ValueError, match="one bit width"):
        MLAQuantLayer.check_options(1, 96, 64, k_bits=4, v_bits=3)


def test_unreadable_variant_fails_at_load_before_allocation() -> None:
    from exl3_core.archkit import Config, Model
    from exl3_core.bench.models import RandomSource, bench_plugins

    shape = parse_shape("custom(256,512,2,4,2,300)")
    plugins = bench_plugins()
    source = RandomSource(shape, 4.0, 6, "mcg", 0)
    model = Model.from_config(Config(source.directory, shape.hf_config(), plugins=plugins))
    cache = Cache(model, 4 * PAGE, variant="quant", page_size=PAGE, plugins=plugins)
    with pytest.raises(ValueError, match=r"--cache-bits.*cannot be read by any attention backend.*torch_sdpa"):
        model.load("cpu", dtype=torch.float16, source=source, attention=["torch_sdpa"], caches=[cache])
    assert not cache.allocated and not model.loaded


def test_specs_state_the_views_widths_and_page_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every place that picks a backend for a cache view (the load-time check, the forward, the plan's report)
    states the view's code widths and page size in the spec, on which backends decide (cuda_qsplit reads 4 and 8
    bits only, on pages of whole 16-key tiles)."""
    from exl3_core.archkit import Config, Model
    from exl3_core.attention.dispatch import Dispatcher
    from exl3_core.bench.models import RandomSource, bench_plugins

    seen: list[tuple[str, AttnSpec]] = []
    real = Dispatcher.select_view

    def spy(self, spec_of, views, allowed=None):  # type: ignore[no-untyped-def]
        seen.extend((v, spec_of(v)) for v in views)
        return real(self, spec_of, views, allowed)

    monkeypatch.setattr(Dispatcher, "select_view", spy)
    shape = parse_shape("custom(256,512,2,4,2,300)")
    plugins = bench_plugins()
    source = RandomSource(shape, 4.0, 6, "mcg", 0)
    model = Model.from_config(Config(source.directory, shape.hf_config(), plugins=plugins))
    page = 2 * PAGE
    cache = Cache(model, 8 * page, variant="quant", k_bits=8, v_bits=4, page_size=page, plugins=plugins)
    model.load("cpu", dtype=torch.float16, source=source, attention=["triton_paged", "torch"], caches=[cache])
    loaded = len(seen)
    assert loaded, "the load-time check picked no backend for the quantized view"
    _run(model, model.forward_batch, cache, [list(range(5, 25))], 1)
    forward = len(seen)
    assert forward > loaded, "the forward picked no backend for the quantized view"
    ExecutionPlan(model).attention_choices(cache, [CallShape("decode", 4096, 1, 1)])
    assert len(seen) > forward
    assert {(v, s.kv_bits, s.page_size) for v, s in seen} == {("kv/quant", (8, 4), page)}


# -- the --cache-bits option ------------------------------------------------------------------------------------
def test_cache_bits_option() -> None:
    assert parse_cache_bits("4") == CacheBits(4, 4) and parse_cache_bits("8,4") == CacheBits(8, 4)
    assert parse_cache_bits("16").cache_kwargs() == {"variant": "fp16"}
    assert parse_cache_bits(" 8 , 3 ").cache_kwargs() == {"variant": "quant", "k_bits": 8, "v_bits": 3}
    for bad, why in (("9", "outside 2..8"), ("1,4", "outside 2..8"), ("16,4", "together"), ("4,4,4", "K or K,V"),
                     ("four", "K or K,V"), ("", "K or K,V")):
        with pytest.raises(ValueError, match=f"--cache-bits.*{why}"):
            parse_cache_bits(bad)
    p = argparse.ArgumentParser()
    add_cache_bits_arg(p)
    assert cache_kwargs(p.parse_args([])) == {"variant": "fp16"}
    assert cache_kwargs(p.parse_args(["--cache-bits", "6,5"])) == {"variant": "quant", "k_bits": 6, "v_bits": 5}
    with pytest.raises(SystemExit):
        p.parse_args(["--cache-bits", "0"])


def test_cache_recent_option(capsys: pytest.CaptureFixture[str]) -> None:
    """``--cache-recent N`` reaches the quantized cache's ``recent`` option (and its report label); it is refused
    when no cache is quantized, or when N is not 0 or a power of two, naming the option."""
    p = argparse.ArgumentParser()
    add_cache_bits_arg(p)
    assert cache_kwargs(p.parse_args(["--cache-bits", "4", "--cache-recent", "0"])) == {
        "variant": "quant", "k_bits": 4, "v_bits": 4, "recent": 0}
    assert "recent" not in cache_kwargs(p.parse_args(["--cache-bits", "4"]))
    model = _geometry_model()
    for argv, rings in ((["--cache-recent", "0"], False), ([], True)):
        cache = Cache(model, 4 * PAGE, page_size=PAGE, device="cpu", dtype=torch.float16,
                      **cache_kwargs(p.parse_args(["--cache-bits", "4", *argv])))
        assert (cache.ring_slots > 0) == rings, argv
    with pytest.raises(ValueError, match="--cache-recent 0: only a quantized cache"):
        cache_kwargs(p.parse_args(["--cache-recent", "0"]))
    for bad in ("3", "-1", "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["--cache-bits", "4", "--cache-recent", bad])
        assert "--cache-recent" in capsys.readouterr().err
    many = argparse.ArgumentParser()
    add_cache_bits_arg(many, repeat=True)
    labels = [b.label(torch.float16) for b in
              cache_variants(many.parse_args(["--cache-bits", "16", "--cache-bits", "4", "--cache-recent", "16"]))]
    assert labels == ["fp16", "k4v4r16"]


# -- the engine over a quantized cache ------------------------------------------------------------------------
@pytest.fixture
def fused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "fused_enabled", lambda t: True)


def _run(model, forward, cache: Cache, prompts: list[list[int]], decode: int, k: int = 1) -> list[torch.Tensor]:
    pages = [cache.allocator.allocate(4) for _ in prompts]
    table = torch.tensor(pages, dtype=torch.int32)
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    out = [forward(BatchMeta.from_lists(prompts, [0] * len(prompts), page_table=table, page_size=PAGE,
                                        logits_indices=ends), cache)]
    past = [len(p) for p in prompts]
    for step in range(decode):
        toks = [[(7 * step + 11 * b + 3 * i) % 300 for i in range(k)] for b in range(len(prompts))]
        out.append(forward(BatchMeta.from_lists(toks, past, page_table=table, page_size=PAGE, phase="decode"), cache))
        past = [p + k for p in past]
    return out


def test_fused_plan_stores_and_reads_in_place(fused: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's fused forms over a K8V8 cache (RoPE + quantize in one Triton launch, Triton attention on the
    quantized view) against the reference forward over its own K8V8 cache."""
    model = _geometry_model(attention=["triton_paged", "torch"])
    calls: dict[str, int] = {}
    for name in ("rope_quant_write", "quant_write"):
        real = getattr(kq, name)
        monkeypatch.setattr(kq, name, lambda *a, _r=real, _n=name, **kw: calls.__setitem__(_n, calls.get(_n, 0) + 1)
                            or _r(*a, **kw))
    plan = ExecutionPlan(model, kernels=EmulatedKernels())
    prompts = [list(range(5, 25)), list(range(40, 53))]
    qc = Cache(model, 12 * PAGE, page_size=PAGE, variant="quant", k_bits=8, v_bits=8)
    got = _run(model, plan.forward, qc, prompts, 3)
    assert calls.get("rope_quant_write", 0) == 2 * 4 and "quant_write" not in calls  # 2 layers x 4 steps
    text = "\n".join(plan.cache_report(qc))
    assert "kv/quant" in text and "no in-kernel write target" in text
    choices = "\n".join(plan.attention_choices(qc, [CallShape("decode", 64, 2, 1)]))
    assert "triton_paged on kv/quant" in choices

    def reference(meta: BatchMeta, cache: Cache) -> torch.Tensor:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(ops, "fused_enabled", lambda t: False)
            m.setattr(model, "allowed_backends", ("torch",))
            return model.forward_batch(meta, cache)

    want = _run(model, reference, Cache(model, 12 * PAGE, page_size=PAGE, variant="quant", k_bits=8, v_bits=8),
                prompts, 3)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("k", [3])
def test_multi_token_step_over_a_quantized_cache(fused: None, k: int) -> None:
    """A decode step of k tokens per sequence (speculative/multi-token) equals k single-token steps."""
    model = _geometry_model()
    plan = ExecutionPlan(model, kernels=EmulatedKernels())
    prompts = [list(range(5, 25)), list(range(40, 53))]
    new = [[(5 * i + 17 * b) % 300 for i in range(k)] for b in range(2)]

    def prefilled() -> tuple[Cache, torch.Tensor, list[int]]:
        cache = Cache(model, 12 * PAGE, page_size=PAGE, variant="quant", k_bits=4, v_bits=4)
        table = torch.tensor([cache.allocator.allocate(4) for _ in prompts], dtype=torch.int32)
        ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        plan.forward(BatchMeta.from_lists(prompts, [0, 0], page_table=table, page_size=PAGE, logits_indices=ends),
                     cache)
        return cache, table, [len(p) for p in prompts]

    cache, table, past = prefilled()
    multi = plan.forward(BatchMeta.from_lists(new, past, page_table=table, page_size=PAGE, phase="decode"),
                         cache).view(2, k, -1)
    cache1, table1, past1 = prefilled()
    single = torch.stack([plan.forward(BatchMeta.from_lists([[t[i]] for t in new], [p + i for p in past1],
                                                            page_table=table1, page_size=PAGE), cache1)
                          for i in range(k)], dim=1)
    torch.testing.assert_close(multi, single, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("variant", ["quant", "fp16"])
def test_a_prompt_reads_the_same_keys_alone_batched_and_chunked(variant: str) -> None:
    """A fresh prompt alone attends to its own rows without the cache, yet sees them as the cache stores them:
    its logits equal those of the same prompt prefilled beside another sequence or in two chunks (both read
    the cache), while K3V3 quantization itself moves them far more than that."""
    model, _ = build_model(parse_shape("custom(128,256,2,4,2,300)"), device="cpu", dtype=torch.float32, seed=5,
                           page_size=PAGE)
    prompt, other = list(range(10, 10 + 2 * PAGE + 5)), list(range(100, 120))
    opts: dict[str, Any] = {"variant": "quant", "k_bits": 3, "v_bits": 3} if variant == "quant" else {}

    def last_logits(steps: list[list[tuple[list[int], int]]]) -> torch.Tensor:
        """``steps``: per forward, ``(tokens, past)`` of the prompt, then of the other sequence if given."""
        cache = Cache(model, 12 * PAGE, page_size=PAGE, **opts)
        table = torch.tensor([cache.allocator.allocate(4) for _ in range(2)], dtype=torch.int32)
        out = torch.empty(0)
        for step in steps:
            toks, past = [t for t, _ in step], [p for _, p in step]
            ends = torch.tensor([len(t) for t in toks]).cumsum(0) - 1
            meta = BatchMeta.from_lists(toks, past, page_table=table[:len(step)], page_size=PAGE, logits_indices=ends)
            assert meta.fresh_single_sequence == (len(step) == 1 and past == [0])
            out = model.forward_batch(meta, cache)[0]
        return out

    alone = last_logits([[(prompt, 0)]])
    batched = last_logits([[(prompt, 0), (other, 0)]])
    chunked = last_logits([[(prompt[:PAGE + 3], 0)], [(prompt[PAGE + 3:], PAGE + 3)]])
    for got in (batched, chunked):
        torch.testing.assert_close(got, alone, rtol=1e-4, atol=1e-4)
    if variant == "quant":
        unquantized = Cache(model, 12 * PAGE, page_size=PAGE)
        table = torch.tensor([unquantized.allocator.allocate(4)], dtype=torch.int32)
        exact = model.forward_batch(BatchMeta.from_lists([prompt], [0], page_table=table, page_size=PAGE,
                                                         logits_indices=torch.tensor([len(prompt) - 1])), unquantized)[0]
        assert (exact - alone).abs().max() > 100 * 1e-4, "3-bit keys changed nothing: the check is vacuous"


@pytest.mark.parametrize("recent", [0, 64])
def test_generator_batches_and_reuses_prefix_pages(recent: int) -> None:
    """Continuous batching and the prefix cache over a quantized cache: jobs sharing a prompt prefix run
    together, the later ones reuse the first's full pages (bit-equal to the pages they would write), and every
    job's tokens equal its run alone: a fresh prompt alone attends to its own rows as the cache stores them,
    as it does through the cache in a batch. With recent rows, a job that reuses a prefix reads the prefix's last
    positions at the pages' width (their low bits went with the job that wrote them), so only the jobs without a
    hit must equal their runs alone."""
    from exl3_core.generator import Generator, Job

    model, _ = build_model(parse_shape("custom(128,256,2,4,2,300)"), device="cpu", dtype=torch.float32, seed=5,
                           page_size=PAGE)
    base = list(range(10, 10 + 2 * PAGE + 3))

    def run(prompts: list[list[int]], cache: Cache) -> list[list[int]]:
        gen = Generator(model=model, cache=cache, tokenizer=None)
        jobs = [Job(torch.tensor([p]), max_new_tokens=6, stop_at_eos=False, identifier=i) for i, p in enumerate(prompts)]
        gen.enqueue(jobs)
        out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        while gen.num_remaining():
            for r in gen.iterate():
                out[r["identifier"]] += r["token_ids"]
        return [out[i] for i in range(len(prompts))]

    def quant() -> Cache:
        return Cache(model, 24 * PAGE, page_size=PAGE, variant="quant", k_bits=5, v_bits=4, recent=recent)

    prompts = [base + [1, 2], base + [3], [7] * 5]
    cache = quant()
    first = run(prompts[:1], cache)
    together = run(prompts, cache)  # the shared prefix's pages come from the cache now
    assert cache.allocator.hits >= 2
    alone_caches = [quant() for _ in prompts]
    alone = [run([p], c)[0] for p, c in zip(prompts, alone_caches)]
    assert first[0] == alone[0] and together[2] == alone[2]
    if not recent:
        assert together[:2] == alone[:2]
    # the reused pages hold exactly what the second job writes on its own
    own = alone_caches[1]
    compared = 0
    for h, page in cache.allocator.by_hash.items():
        if h in own.allocator.by_hash:
            compared += 1
            p2 = own.allocator.by_hash[h]
            for a, b in zip(cache.layers, own.layers):
                assert isinstance(a, KVQuantLayer) and isinstance(b, KVQuantLayer)
                for x, y in ((a.k_codes, b.k_codes), (a.k_scales, b.k_scales), (a.v_codes, b.v_codes),
                             (a.v_scales, b.v_scales)):
                    assert torch.equal(x[page], y[p2])
    assert compared >= 2



@pytest.mark.parametrize("draft", ["self", "small", "small_fp16_target"])
def test_speculative_decoding_over_quantized_caches(draft: str) -> None:
    """Speculative decoding with quantized caches (the target's K5V4; the draft's own pages): verification
    steps of k + 1 rows and the rollbacks of rejected drafts give the plain generator's greedy tokens over the same
    quantized cache, with jobs arriving at different steps, and leave no page in use. The model drafting for
    itself (over a K5V4 cache of its own) has most drafts accepted; a small random draft (K4V3) has most rejected.
    Over an unquantized target cache, the draft's K4V3 cache still keeps its jobs' recent rows."""
    from exl3_core.generator import Generator, Job

    model, _ = build_model(parse_shape("custom(128,256,2,4,2,300)"), device="cpu", dtype=torch.float32, seed=5,
                           page_size=PAGE)
    if draft == "self":
        drafter = model
    else:
        drafter, _ = build_model(parse_shape("custom(64,128,1,2,1,300)"), device="cpu", dtype=torch.float32, seed=6,
                                 page_size=PAGE)

    def quant(m: Any, k: int, v: int) -> Cache:
        return Cache(m, 24 * PAGE, page_size=PAGE, variant="quant", k_bits=k, v_bits=v)

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 20, 14)]

    def run(gen: Generator) -> list[list[int]]:
        jobs = [Job(torch.tensor([p]), max_new_tokens=12, stop_at_eos=False, identifier=i) for i, p in enumerate(prompts)]
        gen.enqueue(jobs[:2])
        out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        step = 0
        while gen.num_remaining() or step < 2:
            if step == 2:
                gen.enqueue(jobs[2:])  # a staggered arrival
            for r in gen.iterate():
                out[r["identifier"]] += r["token_ids"]
            step += 1
        return [out[i] for i in range(len(prompts))]

    def target() -> Cache:
        return Cache(model, 24 * PAGE, page_size=PAGE) if draft == "small_fp16_target" else quant(model, 5, 4)

    plain = run(Generator(model=model, cache=target(), tokenizer=None))
    cache, dcache = target(), (quant(drafter, 5, 4) if draft == "self" else quant(drafter, 4, 3))
    gen = Generator(model=model, cache=cache, tokenizer=None, dynamic_draft=False, draft_model=drafter,
                    draft_cache=dcache, num_draft_tokens=3)
    assert run(gen) == plain
    s = gen.spec.stats if gen.spec is not None else None
    assert s is not None and s.drafted > 0
    if draft == "self":
        assert s.accepted > s.drafted / 2
    else:
        assert s.accepted < s.drafted  # rejections: the rollbacks ran
    assert cache.allocator.num_live() == 0 and dcache.allocator.num_live() == 0
    assert all(bool((layer.tags >= 0).any()) for layer in dcache.layers), "the draft's steps kept no recent rows"

# -- exl3 bench --cache-bits ----------------------------------------------------------------------------------
def test_bench_measures_each_cache_and_reports_capacity(one_torch_thread: None) -> None:
    from exl3_core.bench.capacity import max_sequences
    from exl3_core.bench.run import run_bench

    shape = parse_shape("custom(256,384,2,4,2,700)")
    variants = (CacheBits(), CacheBits(4, 4))
    res = run_bench(shape, device="cpu", contexts=(16,), batches=(2,), prefill_tokens=(8,), new_tokens=2,
                    cache_bits=variants, cache_memory=3 << 20, log=lambda s: None)
    # the CPU bench runs in fp32: the unquantized cache is named by the dtype it holds
    assert {(r["cache"], r["batch"]) for r in res["decode"]} == {("fp32", 1), ("fp32", 2), ("k4v4", 1), ("k4v4", 2)}
    kv = {r["cache"]: r["bytes_per_step"] for r in res["decode"] if r["batch"] == 1}
    assert kv["k4v4"] < kv["fp32"]  # the roofline counts the quantized bytes
    ratios = {c["what"]: c for c in res["cache_compare"]}
    assert set(ratios) == {"decode b=1 ctx=16", "decode b=2 ctx=16", "prefill 8 after 0"}
    assert all(c["cache"] == "k4v4" and c["ratio"] == c["tok_s"] / c["base_tok_s"] > 0 for c in ratios.values())
    # capacity: whole 4096-token sequences of pages (and ring slots) of the allocated bytes, less the scratch ones
    from exl3_core.bench.capacity import page_bytes

    model, _ = build_model(shape, device="cpu", dtype=torch.float16)
    for c in max_sequences(model, variants, 3 << 20, torch.float16, page_size=PAGE):
        bits = parse_cache_bits("16" if c["cache"] == "fp16" else "4")
        per_page, _, per_slot = page_bytes(model, bits, torch.float16, PAGE)
        one = Cache(model, PAGE, page_size=PAGE, device="cpu", dtype=torch.float16,
                    **bits.cache_kwargs() | ({"recent_seqs": 1} if bits.quantized else {}))
        assert one.storage_size() == 2 * (per_page + per_slot)  # a page and a slot, and the scratch ones
        assert (per_slot > 0) == bits.quantized
        assert c["sequences"] == ((3 << 20) - per_page - per_slot) // (4096 // PAGE * per_page + per_slot)
    cap = {c["cache"]: c for c in res["capacity"]}
    assert cap["k4v4"]["sequences"] >= 3.5 * cap["fp32"]["sequences"]
    assert [CacheBits().label(t) for t in (torch.float16, torch.bfloat16)] == ["fp16", "bf16"]


# -- the latent (MLA) cache quantized -------------------------------------------------------------------------
def test_latent_cache_refuses_recent_rows_naming_the_option() -> None:
    with pytest.raises(ValueError, match=r"not \['recent'\].*leave --cache-recent out"):
        MLAQuantLayer.check_options(1, 40, 32, k_bits=4, recent=0)  # as Cache checks a layer type's options


@pytest.mark.parametrize("backends", [("torch",), ("triton_paged",)])
def test_quantized_latent_cache_in_chunked_steps(backends: tuple[str, ...]) -> None:
    """Latent attention over a quantized latent cache, prefilled in chunks and then decoded, against a cache-less
    full pass: the rotary key is stored as it is, the latent within 8-bit quantization error."""
    from types import SimpleNamespace

    from test_mla import YARN, H, make_attn  # the MLA test's small attention module (latent 32, rope 8)

    from exl3_core.nn.module import ForwardState
    from exl3_core.plugins import load_plugins

    plugins = load_plugins()  # the installed backends (Triton's among them)

    torch.manual_seed(0)
    attn = make_attn(None, YARN)
    layer = MLAQuantLayer(num_pages=10, page_size=8, num_kv_heads=1, head_dim=attn.head_dim,
                          head_dim_v=attn.head_dim_v, dtype=torch.float32, device="cpu", k_bits=8)
    attn.cache_index = 0
    cache = SimpleNamespace(layers=[layer])
    table = torch.tensor([[7, 2, 9], [0, 5, 3]], dtype=torch.int32)
    lens = [21, 13]
    xs = [torch.randn(n, H) for n in lens]
    full = [attn(x, ForwardState(BatchMeta.full(torch.zeros(1, len(x), dtype=torch.long)), plugins=plugins))
            for x in xs]
    done = [0, 0]
    for step in ([9, 5], [lens[0] - 11, lens[1] - 7], [1, 1], [1, 1]):
        new = [list(range(done[b], done[b] + step[b])) for b in range(2)]
        meta = BatchMeta.from_lists([[0] * len(n) for n in new], done, page_table=table, page_size=8)
        out = attn(torch.cat([xs[b][new[b]] for b in range(2)]),
                   ForwardState(meta, cache=cache, plugins=plugins, allowed_backends=backends))
        want = torch.cat([full[b][new[b]] for b in range(2)])
        assert ((out - want).abs().max() / want.abs().max()).item() < 2e-2
        done = [done[b] + step[b] for b in range(2)]
    # the stored rotary keys are the projection's own, unquantized (the chunks' products round apart at fp32's
    # last bits); one code row per token
    _, _, kv = attn.project(xs[0], ForwardState(BatchMeta.full(torch.zeros(1, lens[0], dtype=torch.long)),
                                                plugins=plugins))
    rows = torch.cat([table[0, i // 8:i // 8 + 1] * 8 + i % 8 for i in range(lens[0])]).long()
    torch.testing.assert_close(layer.rope.view(-1, layer.rope.shape[-1])[rows], kv[:, 0, attn.head_dim_v:],
                               rtol=1e-5, atol=1e-6)
    assert layer.codes.shape == (10, 8, attn.head_dim_v // 32 * 8)
