"""The quantized KV cache (variant "quant", format spec 6) on the GPU: the Triton store kernels bit-exact against
the torch reference, the Triton and CUDA attention reading the quantized view within fp16 tolerance (graph
replays included; the short-bound CUDA kernel with recent rows too, each sequence's window read at 8 bits, against
the reference reading them on queries aimed at keys in and around the window, so that the 8-bit reads matter), the
engine through CUDA graphs, and the speed bars of the issue measured as ``exl3 bench`` measures them (same process,
the unquantized cache first):

* 8B shape, b=1 decode at ctx 32768: K4V4 >= 1.3x the fp16 cache's rate;
* 8B shape, b=1 decode at ctx 256: K4V4 >= 0.97x;
* 8B shape, b=32 decode at ctx 4096: K4V4 throughput >= fp16's.

The same figures from the command line: ``exl3 bench --shape 8b --contexts 256,32768 --batches '' --prefill 0
--cache-bits 16 --cache-bits 4`` and ``exl3 bench --shape 8b --contexts 4096 --batches 32 --prefill 0
--cache-bits 16 --cache-bits 4`` (``cache_compare`` in the output). CPU counterparts: tests/core/test_kv_quant.py.
"""
from __future__ import annotations


import pytest
import torch

from exl3_core.attention.spec import AttnArgs, AttnSpec, CallShape, device_cc
from exl3_core.bench.models import build_model, parse_shape
from exl3_core.cache import Cache
from exl3_core.cache.kv_quant import KVQuantLayer
from exl3_core.cache_bits import CacheBits
from exl3_core.generator.graphs import DecodeGraphs
from exl3_core.plan import ExecutionPlan
from exl3_core.reference import fused as fused_ref
from exl3_core.reference import kv_quant as ref
from exl3_core.reference.attention import attention as reference_attention
from exl3_core.testing.attention import Case, check_backend, default_cases, make_args, tolerance
from exl3_core.testing.attention import focus_recent as _focus
from exl3_core.testing.kernels import captured

pytestmark = pytest.mark.cuda
DEV = "cuda"


@pytest.fixture(scope="module", autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


# -- store kernels ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [(k, v) for k in range(2, 9) for v in (2, 5, 8)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quant_write_bit_exact_on_gpu(bits: tuple[int, int], dtype: torch.dtype) -> None:
    from exl3_core.kernels import kv_quant as kq

    kb, vb = bits
    T, H, D = 37, 8, 128
    g = torch.Generator().manual_seed(kb * 16 + vb)
    k = (torch.randn(T, H, D, generator=g) * torch.rand(T, 1, 1, generator=g) * 30).to(dtype)
    v = torch.randn(T, H, D, generator=g).to(dtype)
    slots = torch.randperm(8 * 256, generator=g)[:T]
    ng = H * D // 32
    kc = torch.zeros(8, 256, ng * kb, dtype=torch.int32, device=DEV)
    ks = torch.zeros(8, 256, ng, dtype=torch.float16, device=DEV)
    vc = torch.zeros(8, 256, ng * vb, dtype=torch.int32, device=DEV)
    vs = torch.zeros(8, 256, ng, dtype=torch.float16, device=DEV)
    kq.quant_write(k.to(DEV), v.to(DEV), slots.to(DEV), kc, ks, vc, vs, kb, vb)
    want = [t.cpu().zero_() for t in (kc, ks, vc, vs)]
    ref.quant_write(want[0], want[1], k, slots, kb)
    ref.quant_write(want[2], want[3], v, slots, vb)
    for got, exp in zip((kc, ks, vc, vs), want):
        assert torch.equal(got.cpu(), exp)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_read_rows_equals_the_reference_on_gpu(bits: int, dtype: torch.dtype) -> None:
    """A fresh prompt's rows read back in one launch: the reference's dequantization, in the rows' dtype (within
    a rounding)."""
    from exl3_core.kernels import kv_quant as kq

    T, H, D = 300, 8, 128
    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(T, H, D, generator=g) * torch.rand(T, 1, 1, generator=g) * 30).to(dtype)
    slots = torch.randperm(8 * 256, generator=g)[:T]
    ng = H * D // 32
    codes = torch.zeros(8, 256, ng * bits, dtype=torch.int32, device=DEV)
    scales = torch.zeros(8, 256, ng, dtype=torch.float16, device=DEV)
    kq.quant_write(x.to(DEV), None, slots.to(DEV), codes, scales, None, None, bits, bits)
    got = kq.read_rows(codes, scales, bits, slots.to(DEV), x.to(DEV))
    want = ref.dequantize(codes.cpu().view(-1, ng * bits)[slots], scales.cpu().view(-1, ng)[slots], bits)
    assert got.dtype == dtype
    # equal in the interpreter (tests/core); here the compiler may contract a product into the butterfly's add
    rtol = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(got.cpu(), want.view(T, H, D).to(dtype), atol=1e-4, rtol=rtol)


def test_rope_quant_write_on_gpu() -> None:
    from exl3_core.kernels import kv_quant as kq

    T, HQ, HK, D = 9, 32, 8, 128
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, HQ, D, generator=g).half().to(DEV)
    k = torch.randn(T, HK, D, generator=g).half().to(DEV)
    v = torch.randn(T, HK, D, generator=g).half().to(DEV)
    cos, sin = fused_ref.rope_tables(torch.arange(1000, 1000 + T),
                                     1.0 / (500000 ** (torch.arange(0, D, 2).float() / D)))
    slots = torch.arange(T, device=DEV) * 3
    ng = HK * D // 32
    kc = torch.zeros(1, 256, ng * 4, dtype=torch.int32, device=DEV)
    ks = torch.zeros(1, 256, ng, dtype=torch.float16, device=DEV)
    vc, vs = torch.zeros_like(kc), torch.zeros_like(ks)
    qr, kr = q.cpu().clone(), k.cpu().clone()
    fused_ref.rope_apply(qr, kr, cos, sin, D, False)
    kq.rope_quant_write(q, k, v, slots, cos.to(DEV), sin.to(DEV), D, False, kc, ks, vc, vs, 4, 4)
    torch.testing.assert_close(k.cpu(), kr, rtol=0, atol=2e-3)
    want = [t.cpu().zero_() for t in (kc, ks, vc, vs)]
    ref.quant_write(want[0], want[1], k.cpu(), slots.cpu(), 4)
    ref.quant_write(want[2], want[3], v.cpu(), slots.cpu(), 4)
    for got, exp in zip((kc, ks, vc, vs), want):
        assert torch.equal(got.cpu(), exp)


# -- attention reading the quantized view ------------------------------------------------------------------------
QUANT = [c for dt in (torch.float16, torch.bfloat16) for c in default_cases(DEV, dt, small=False)
         if c.spec.cache is not None and c.spec.cache.endswith("/quant")] if torch.cuda.is_available() else []


@pytest.mark.parametrize("case", QUANT, ids=lambda c: c.id)
def test_triton_reads_quantized_views_on_gpu(case: Case) -> None:
    from exl3_attn_backends.triton_paged import TritonPagedAttention

    b = TritonPagedAttention()
    assert b.unsupported_reasons(case.spec) == []
    check_backend(b, case, DEV, seed=3)


def _decode_case(hd: int, hq: int, hkv: int, past: tuple[int, ...], dtype: torch.dtype, bits: tuple[int, int],
                 page_size: int = 16) -> Case:
    spec = AttnSpec(head_dim=hd, num_q_heads=hq, num_kv_heads=hkv, dtype=dtype, cache="kv/quant", phase="decode",
                    page_size=page_size, q_per_seq=1, device_type="cuda", device_cc=device_cc(torch.device(DEV)))
    return Case(spec, (1,) * len(past), past, bits)


@pytest.fixture(scope="module")
def decode_op(exl3_ops):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the CUDA decode kernel needs compute capability >= 9.0")
    from exl3_attn_backends.cuda_decode import _reads_quant

    if not _reads_quant():
        pytest.fail("exl3_core._C's decode_attention predates quantized caches; rebuild it")
    return exl3_ops.decode_attention


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [(64, 32, 8), (128, 32, 8), (128, 28, 4), (64, 12, 4)], ids=lambda s: f"d{s[0]}")
@pytest.mark.parametrize("bits", [(4, 4), (8, 8), (3, 5), (2, 7)], ids=lambda b: f"k{b[0]}v{b[1]}")
def test_cuda_decode_reads_quantized_views(decode_op, shape: tuple[int, int, int], dtype: torch.dtype,
                                           bits: tuple[int, int]) -> None:
    from exl3_attn_backends.cuda_decode import decode_attention

    hd, hq, hkv = shape
    args = make_args(_decode_case(hd, hq, hkv, (0, 30, 127, 255, 400), dtype, bits), DEV, seed=hd + bits[0])
    assert args.quant is not None
    out = decode_attention(args.q, args.k_cache, args.v_cache, args.page_table, args.cu_seqlens_q, args.seq_lens_k,
                           args.scale, False, 512, quant=args.quant)
    r = reference_attention(args)
    assert torch.isfinite(out).all()
    err = (out.float() - r.float()).abs().max().item()
    assert err <= tolerance(dtype) * max(1.0, r.float().abs().max().item()), err
    # as a programmatic dependent: bit-equal
    pdl = decode_attention(args.q, args.k_cache, args.v_cache, args.page_table, args.cu_seqlens_q, args.seq_lens_k,
                           args.scale, True, 512, quant=args.quant)
    assert torch.equal(out, pdl)


def test_cuda_decode_backend_takes_short_quantized_decode(decode_op) -> None:
    from exl3_attn_backends.cuda_decode import CudaDecodeAttention

    args = make_args(_decode_case(128, 32, 8, (100, 7), torch.float16, (4, 4)), DEV, seed=1)
    spec = args.spec._replace(max_keys=256, num_seqs=2, sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
    b = CudaDecodeAttention()
    assert b.unsupported_reasons(spec) == []
    check = args._replace(spec=spec, max_seqlen_k=256)
    out = b.forward(check)
    r = reference_attention(check)
    assert (out.float() - r.float()).abs().max().item() <= tolerance(torch.float16) * max(1.0, r.abs().max().item())


# -- recent rows through the short-bound CUDA kernel ------------------------------------------------------------------
def _check_recent(out: torch.Tensor, args: AttnArgs, what: str) -> None:
    """``out`` matches the reference reading the recent rows at 8 bits (rows with a query), and that reference is
    far from the one reading every key at the pages' width (3 tolerances in bf16, 10 in fp16), or within one of it
    where both sides are 8-bit (nothing to refine)."""
    assert args.quant is not None and args.quant.recent is not None
    tok = [int(args.cu_seqlens_q[b]) for b in range(len(args.seq_lens_k))
           if int(args.cu_seqlens_q[b + 1]) > int(args.cu_seqlens_q[b])]
    fine = reference_attention(args)[tok].float()
    coarse = reference_attention(args._replace(quant=args.quant._replace(recent=None)))[tok].float()
    got = out[tok].float()
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    tol = tolerance(args.spec.dtype) * max(1.0, fine.abs().max().item())
    err = (got - fine).abs().max().item()
    assert err <= tol, f"{what}: max err {err:.3g} > {tol:.3g}"
    gap = (fine - coarse).abs().max().item()
    if args.quant.k_bits == 8 and args.quant.v_bits == 8:
        assert gap <= tol, f"{what}: 8-bit sides have nothing to refine, yet the references differ by {gap:.3g}"
    else:
        least = (10 if args.spec.dtype == torch.float16 else 3) * tol
        assert gap >= least, f"{what}: the recent rows move the reference by {gap:.3g} only (tolerance {tol:.3g})"


def _recent_case(hd: int, hq: int, hkv: int, past: tuple[int, ...], dtype: torch.dtype, bits: tuple[int, int],
                 window: int) -> Case:
    case = _decode_case(hd, hq, hkv, past, dtype, bits)
    return Case(case.spec._replace(recent=window), case.q_lens, case.past_lens, case.bits)


@pytest.fixture(scope="module")
def recent_decode_op(decode_op):
    from exl3_attn_backends.cuda_decode import reads_recent

    if not reads_recent():
        pytest.fail("exl3_core._C's decode_attention predates recent rows; rebuild it")
    return decode_op


@pytest.mark.parametrize("window", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [(64, 32, 8), (128, 32, 8), (128, 28, 4), (64, 12, 4)], ids=lambda s: f"d{s[0]}")
@pytest.mark.parametrize("bits", [(4, 4), (3, 5), (2, 7), (6, 2), (8, 3), (8, 8)], ids=lambda b: f"k{b[0]}v{b[1]}")
def test_cuda_decode_reads_recent_rows(recent_decode_op, shape: tuple[int, int, int], dtype: torch.dtype,
                                       bits: tuple[int, int], window: int) -> None:
    """Lengths 1-401 under a 512 bound: at head dim 128 a pass holds 256 rows, so the windows of 281 and 401 keys lie
    across the second pass or in it (read after the wait); shorter ones lie whole in the window. Low bits of every
    width 1-6 (planes 4, 2, 1). As a programmatic dependent the output is bit-equal."""
    from exl3_attn_backends.cuda_decode import decode_attention

    hd, hq, hkv = shape
    case = _recent_case(hd, hq, hkv, (0, 30, 127, 255, 280, 400), dtype, bits, window)
    args = _focus(make_args(case, DEV, seed=hd + hq + bits[0] + window))
    assert args.quant is not None
    outs = [decode_attention(args.q, args.k_cache, args.v_cache, args.page_table, args.cu_seqlens_q, args.seq_lens_k,
                             args.scale, pdl, 512, quant=args.quant) for pdl in (False, True)]
    _check_recent(outs[0], args, f"window={window}")
    assert torch.equal(outs[0], outs[1])


def test_cuda_decode_backend_takes_recent_rows_and_replays_them(recent_decode_op) -> None:
    """Through the backend with recent rows, captured in a CUDA graph once and replayed over fresh caches, rings, tags
    and ring slots copied into the captured tensors: each replay reads them from the device."""
    from exl3_attn_backends.cuda_decode import CudaDecodeAttention

    case = _recent_case(128, 32, 8, (100, 7, 250), torch.float16, (4, 4), 64)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    spec = case.spec._replace(max_keys=256, num_seqs=4, sm_count=sms, kv_bits=(4, 4))
    b = CudaDecodeAttention()
    assert b.unsupported_reasons(spec) == []
    static = _focus(make_args(case, DEV, seed=1))._replace(spec=spec, max_seqlen_k=256)
    _check_recent(b.forward(static), static, "eager")
    graph, out = captured(lambda: b.forward(static))
    for seed in (2, 3):
        fresh = _focus(make_args(case, DEV, seed=seed))
        assert static.quant is not None and static.quant.recent is not None
        assert fresh.quant is not None and fresh.quant.recent is not None
        pairs = [(static.q, fresh.q), (static.k_cache, fresh.k_cache), (static.v_cache, fresh.v_cache),
                 (static.page_table, fresh.page_table), (static.quant.k_scales, fresh.quant.k_scales),
                 (static.quant.v_scales, fresh.quant.v_scales)]
        pairs += [(x, y) for x, y in zip(static.quant.recent[:6], fresh.quant.recent[:6]) if x is not None]
        for x, y in pairs:
            assert y is not None
            x.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        _check_recent(out, static, f"replay seed={seed}")


# -- the engine through CUDA graphs --------------------------------------------------------------------------------
@pytest.mark.parametrize("width,backend", [(4, "cuda_decode"), (32, "cuda_qsplit")])
def test_decode_graphs_over_a_quantized_cache(width: int, backend: str) -> None:
    """Replayed decode steps over K4V4 pages equal the eager plan's steps from the same cache state, with the
    graphs captured at a 256-key bound (the short-bound kernel's) and at 2048 (the quantized split kernel's).
    The prompts are longer than the recent-row window, so both widths are read; a step that names no ring slots
    is refused by the graphs.

    Both step from one cache (the eager step runs first, then its writes are undone): the graph's fused store
    rounds the new key in other kernels before quantizing it, so the token's own codes may differ at a level
    boundary, and nothing else may. The gap must stay a small part of what 4-bit storage itself changes (the
    same steps over an fp16 cache)."""
    from exl3_core.generator.batching import Chunk, build_batch

    model, _ = build_model(parse_shape("custom(512,1024,2,4,2,2000)"), device=DEV, dtype=torch.float16, seed=4)
    plan = ExecutionPlan(model)
    page = 64
    prompts = [list(range(5, 125)), list(range(100, 181))]

    def run(cache: Cache, graphed: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per decode step: (eager logits, graphed logits or the eager ones again), the graph's writes kept."""
        graphs = DecodeGraphs.create(plan, cache, width) if graphed else None
        assert not graphed or graphs is not None, "decode graphs declined over a quantized cache"
        pages = [cache.allocator.allocate(width) for _ in range(2)]
        meta, _ = build_batch([Chunk(p, 0, pg, True, b + 1) for b, (p, pg) in enumerate(zip(prompts, pages))],
                              page_size=page,
                              table_width=width, scratch_page=cache.scratch_page, device=torch.device(DEV),
                              decode=False)
        plan.forward(meta, cache)
        past = [len(p) for p in prompts]
        out = []
        for s in range(5):
            chunks = [Chunk([(13 * s + 7 * b) % 2000], past[b], pages[b], True, b + 1) for b in range(2)]
            before = [t.clone() for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
            meta, _ = build_batch(chunks, page_size=page, table_width=width, scratch_page=cache.scratch_page,
                                  device=torch.device(DEV), decode=True)
            eager = plan.forward(meta, cache)[:2].float().clone()
            if graphs is None:
                out.append((eager, eager))
            else:
                now = [t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
                for t, b in zip(now, before):
                    t.copy_(b)
                if s == 0:
                    bare = [Chunk(c.tokens, c.past, c.pages, True) for c in chunks]
                    meta, _ = build_batch(bare, page_size=page, table_width=width, scratch_page=cache.scratch_page,
                                          device=torch.device("cpu"), decode=True)
                    with pytest.raises(ValueError, match="ring slots"):
                        graphs.run(meta)
                meta, _ = build_batch(chunks, page_size=page, table_width=width, scratch_page=cache.scratch_page,
                                      device=torch.device("cpu"), decode=True)
                out.append((eager, graphs.run(meta)[0][:2].float().clone()))
            past = [p + 1 for p in past]
        if graphs is not None:
            assert graphs.replays == 5
        return out

    quant = Cache(model, 2 * width * page, page_size=page, variant="quant", k_bits=4, v_bits=4)
    assert isinstance(quant.layers[0], KVQuantLayer)
    choices = plan.attention_choices(quant, [CallShape("decode", width * page, 2, 1)])
    assert all(f"{backend} on kv/quant" in c for c in choices), choices
    steps = run(quant, True)
    fp16 = run(Cache(model, 2 * width * page, page_size=page), False)
    for (eager, graphed), (exact, _) in zip(steps, fp16):
        gap = (graphed - eager).abs()
        storage = (eager - exact).abs()
        assert float(storage.mean()) > 0, "4-bit storage changed nothing: the cache is not quantized"
        assert float(gap.mean()) <= 0.25 * float(storage.mean()), (float(gap.mean()), float(storage.mean()))
        assert float(gap.max()) <= 0.5 * float(storage.max()), (float(gap.max()), float(storage.max()))


# -- speed (the bars; long: builds the 8B shape) ------------------------------------------------------------
@pytest.mark.slow
def test_speed_bars_8b() -> None:
    from exl3_core.bench.run import bench_decode

    if torch.cuda.get_device_properties(0).total_memory < 80 << 30:
        pytest.skip("the 8B shape at ctx 32768 and b=32 at 4096 needs an 80+ GB GPU")
    shape = parse_shape("8b")
    tokens = 40 * 1024 + 34 * 4352
    model, fp16 = build_model(shape, device=DEV, cache_tokens=tokens)
    rates: dict[tuple[str, int, int], float] = {}
    for bits in (CacheBits(), CacheBits(4, 4)):
        cache = fp16 if not bits.quantized else Cache(model, tokens, **bits.cache_kwargs())
        for batch, ctx in ((1, 256), (1, 32768), (32, 4096)):
            rates[(bits.label(model.dtype), batch, ctx)] = bench_decode(model, cache, batch=batch, ctx=ctx, new_tokens=128)["tok_s"]
        cache.free()
    ratio = {k[1:]: rates[("k4v4", *k[1:])] / rates[("fp16", *k[1:])] for k in rates if k[0] == "fp16"}
    print("K4V4 / fp16 decode rates:", {f"b={b} ctx={c}": f"{r:.3f}" for (b, c), r in ratio.items()})
    assert ratio[(1, 32768)] >= 1.3 and ratio[(1, 256)] >= 0.97 and ratio[(32, 4096)] >= 1.0, ratio
