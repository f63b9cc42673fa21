"""On CUDA (compute capability >= 9.0): the tensor-core decode attention (torch.ops.exl3.decode_attention,
csrc/attn/decode_attn.cu) and its backend against the torch reference on fresh random paged caches, with
and without PDL, replayed from a CUDA graph at other lengths, the dispatcher's routes around what it declines,
and its refusals of bad input."""
from __future__ import annotations

import pytest
import torch

from exl3_core.attention import AttnSpec
from exl3_core.attention.spec import device_cc, pow2_bucket, sm_count
from exl3_core.reference.attention import attention as reference_attention
from exl3_core.testing.attention import Case, make_args, tolerance
from exl3_core.testing.kernels import captured

pytestmark = pytest.mark.cuda
DEV = "cuda"


@pytest.fixture(scope="module")
def op(exl3_ops):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the kernel needs compute capability >= 9.0")
    if not hasattr(exl3_ops, "decode_attention"):
        pytest.fail("exl3_core._C predates decode_attention; rebuild it")
    return exl3_ops.decode_attention


def _case(hd: int, hq: int, hkv: int, past: tuple[int, ...], dtype: torch.dtype, page_size: int = 16,
          q_lens: tuple[int, ...] | None = None) -> Case:
    """A decode call over ``past`` cached tokens per sequence, its spec stating the call's static shape (key
    bound, sequences, queries per sequence, SMs) as the attention module does."""
    q = q_lens or (1,) * len(past)
    dev = torch.device(DEV)
    spec = AttnSpec(head_dim=hd, num_q_heads=hq, num_kv_heads=hkv, dtype=dtype,
                    cache="kv/fp16" if dtype == torch.float16 else "kv/bf16", phase="decode", page_size=page_size,
                    device_type="cuda", device_cc=device_cc(dev),
                    max_keys=pow2_bucket(max(p + n for p, n in zip(past, q))), num_seqs=pow2_bucket(len(past)),
                    q_per_seq=q[0] if len(set(q)) == 1 else 0, sm_count=sm_count(dev))
    return Case(spec, q, past)


def _check(out: torch.Tensor, args, what: str) -> None:
    ref = reference_attention(args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    rows = args.cu_seqlens_q[1:] > args.cu_seqlens_q[:-1]
    assert torch.isfinite(out).all(), f"{what}: non-finite output (a poisoned slot read?)"
    tol = tolerance(args.spec.dtype) * max(1.0, ref.float().abs().max().item())
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol, f"{what}: max err {err:.3g} > {tol:.3g} (rows with a query: {rows.tolist()})"


SHAPES = [(64, 32, 8), (128, 32, 8), (128, 28, 4), (64, 8, 8), (128, 16, 2), (64, 12, 4)]  # groups 4, 4, 7, 1, 8, 3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"d{s[0]}-h{s[1]}x{s[2]}")
@pytest.mark.parametrize("past", [(0, 30, 32, 63, 256, 499), (7, 127, 128, 200, 255, 1000)], ids=["a", "b"])
def test_matches_reference(op, shape: tuple[int, int, int], dtype: torch.dtype, past: tuple[int, ...]) -> None:
    """Lengths 1-1001 (past + the new key): one pass of the block's rows (256 at head dim 64, 128 at 128) or
    several, the later ones loaded after the wait; keys ending inside a warp's keys and inside an mma tile."""
    hd, hq, hkv = shape
    args = make_args(_case(hd, hq, hkv, past, dtype), DEV, seed=hd + hq + past[0])
    out = op(args.q, args.k_cache, args.v_cache, args.page_table, args.cu_seqlens_q, args.seq_lens_k,
             args.scale, False)
    _check(out, args, f"past={past}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("bound", [1, 40, 128, 129, 256, 300, 512])
def test_pass_sized_by_the_bound(op, hd: int, bound: int, dtype: torch.dtype) -> None:
    """The block's pass is the bound rounded up to whole warps' keys (short keys per warp while 8 warps' worth
    cover it): lengths within the bound take one pass, longer ones (past the contract, still right) several."""
    past = tuple(sorted({0, max(bound - 1, 0), bound // 2, bound + 5, 2 * bound + 40}))
    args = make_args(_case(hd, 32, 8, past, dtype), DEV, seed=hd + bound)
    out = op(args.q, args.k_cache, args.v_cache, args.page_table, args.cu_seqlens_q, args.seq_lens_k,
             args.scale, False, bound)
    _check(out, args, f"bound={bound} past={past}")


@pytest.mark.parametrize("page_size", [16, 256])
def test_pdl_and_page_sizes(op, page_size: int) -> None:
    """As a programmatic dependent (the decode graph's way) the output is bit-equal to a plain launch."""
    args = make_args(_case(64, 32, 8, (256, 100, 7), torch.float16, page_size), DEV, seed=page_size)
    call = (args.q, args.k_cache, args.v_cache, args.page_table, args.cu_seqlens_q, args.seq_lens_k, args.scale)
    plain = op(*call, False)
    _check(plain, args, f"page_size={page_size}")
    torch.testing.assert_close(op(*call, True), plain, atol=0, rtol=0)


def test_sequences_without_a_query(op) -> None:
    """A padded row (no query this step) reads and writes nothing; its neighbours are right."""
    args = make_args(_case(128, 32, 8, (40, 90, 300), torch.float16, q_lens=(1, 0, 1)), DEV, seed=3)
    out = op(args.q, args.k_cache, args.v_cache, args.page_table, args.cu_seqlens_q, args.seq_lens_k,
             args.scale, False)
    _check(out, args, "padded row")


def test_graph_replay_at_other_lengths() -> None:
    """Captured once at the bound through the backend, replayed with new lengths and queries, as the decode
    graphs run it (pre-wait copies of earlier rows, the newest row after the wait)."""
    from exl3_attn_backends.cuda_decode import MAX_KEYS, CudaDecodeAttention

    args = make_args(_case(64, 32, 8, (480, 100), torch.float16), DEV, seed=1)
    table = args.page_table.clone()
    table[1] = table[0]  # both rows may grow to 481 keys over the fully written pages
    bound = min(table.shape[1] * 16, MAX_KEYS[64])
    assert bound >= 481
    static = args._replace(max_seqlen_k=bound, seq_lens_k=args.seq_lens_k.clone(), q=args.q.clone(),
                           page_table=table)
    b = CudaDecodeAttention()
    assert b.unsupported_reasons(static.spec) == []
    g, out = captured(lambda: b.forward(static))  # the smem attribute and the first launch off the capture
    for lens in ((481, 101), (17, 1), (64, 481), (129, 128)):
        static.seq_lens_k.copy_(torch.tensor(lens, dtype=torch.int32))
        static.q.copy_(torch.randn_like(static.q))
        g.replay()
        torch.cuda.synchronize()
        _check(out, static._replace(max_seqlen_k=max(lens)), f"replay {lens}")


def test_dispatcher_routes_what_the_backend_declines_to_triton() -> None:
    """The route is the dispatcher's: within its key bound and batch a decode step goes to cuda_decode; past
    the bound, past one block per SM, or with several queries per sequence cuda_decode declines with its
    reasons and Triton takes the spec. Whichever is chosen equals the reference; cuda_decode itself refuses
    a call outside its spec (a bound past it, q rows off 16-byte alignment) instead of computing it."""
    from exl3_attn_backends.cuda_decode import BLOCKS_PER_SM, MAX_KEYS, CudaDecodeAttention

    from exl3_core.attention import get_dispatcher
    from exl3_core.plugins import load_plugins

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("compute capability < 9.0: the backend declines")
    d = get_dispatcher(load_plugins())
    within = _case(128, 32, 8, (200,), torch.float16)
    assert d.select(within.spec).name == "cuda_decode"
    args = make_args(within, DEV, seed=10)
    _check(d.select(within.spec).forward(args), args, "within the bound")
    hkv = 8
    many = BLOCKS_PER_SM * sm_count(torch.device(DEV)) // hkv + 1  # sequences x kv heads past the block limit
    declined = {
        "past one pass of shared memory": _case(128, 32, hkv, (MAX_KEYS[128] + 10,), torch.float16),
        "more than": _case(128, 32, hkv, tuple(range(20, 20 + many)), torch.float16),
        "one query per sequence": _case(128, 32, hkv, (40, 90), torch.float16, q_lens=(3, 3)),
    }
    for why, case in declined.items():
        reasons = " | ".join(CudaDecodeAttention().unsupported_reasons(case.spec))
        assert why in reasons, (why, reasons)
        chosen = d.select(case.spec)
        assert chosen.name == "triton_paged", (why, chosen.name)
        args = make_args(case, DEV, seed=len(why))
        _check(chosen.forward(args), args, why)
    long = make_args(declined["past one pass of shared memory"], DEV, seed=9)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        CudaDecodeAttention().forward(long)
    args = make_args(within, DEV, seed=11)
    q = torch.empty(args.q.numel() + 4, dtype=args.q.dtype, device=DEV)[4:].view(args.q.shape)  # 8-byte aligned
    q.copy_(args.q)
    with pytest.raises(ValueError, match="q rows must be contiguous and 16-byte aligned"):
        CudaDecodeAttention().forward(args._replace(q=q))
    _check(CudaDecodeAttention().forward(args), args, "after the refusals")


def test_refuses_bad_input_and_keeps_working(op) -> None:
    """The checked entry point names the bad tensor and launches nothing; the kernel still works after."""
    from exl3_attn_backends.cuda_decode import decode_attention

    args = make_args(_case(64, 32, 8, (20,), torch.float16), DEV, seed=4)
    base = {"q": args.q, "k_cache": args.k_cache, "v_cache": args.v_cache, "page_table": args.page_table,
            "cu_seqlens_q": args.cu_seqlens_q, "seq_lens_k": args.seq_lens_k}
    for over, match in (({"q": args.q.float()}, "float16 or bfloat16"),
                        ({"k_cache": args.k_cache.to(torch.bfloat16)}, "q's dtype"),
                        ({"q": torch.zeros(1, 32, 96, dtype=torch.float16, device=DEV)}, "head dim must be 64 or 128"),
                        ({"q": torch.zeros(1, 72, 64, dtype=torch.float16, device=DEV)}, "at most 8"),
                        ({"page_table": args.page_table.long()}, "page_table must be int32"),
                        ({"seq_lens_k": args.seq_lens_k.cpu()}, "on the GPU")):
        with pytest.raises(ValueError, match=match):
            decode_attention(**{**base, **over}, scale=args.scale)
    _check(decode_attention(**base, scale=args.scale), args, "after refusals")
