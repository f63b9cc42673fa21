"""On CUDA (compute capability >= 9.0): the split-KV decode attention over 4/8-bit quantized caches
(torch.ops.exl3.decode_attention_qsplit, csrc/attn/decode_attn_qsplit.cu) and its backend against the torch reference
on fresh random paged caches (keys and values quantized by the reference), with and without PDL, at forced and
chosen split counts, replayed from a CUDA graph at other lengths, and the dispatcher's choice."""
from __future__ import annotations

import pytest
import torch

from exl3_core.attention import AttnSpec
from exl3_core.attention.spec import device_cc
from exl3_core.reference.attention import attention as reference_attention
from exl3_core.testing.attention import Case, make_args, tolerance

pytestmark = pytest.mark.cuda
DEV = "cuda"


@pytest.fixture(scope="module")
def qsplit(exl3_ops):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the kernel needs compute capability >= 9.0")
    if not hasattr(exl3_ops, "decode_attention_qsplit"):
        pytest.fail("exl3_core._C predates decode_attention_qsplit; rebuild it")
    from exl3_attn_backends.cuda_qsplit import decode_attention_qsplit

    return decode_attention_qsplit


def _case(hd: int, hq: int, hkv: int, past: tuple[int, ...], bits: tuple[int, int], page_size: int = 16,
          q_lens: tuple[int, ...] | None = None) -> Case:
    spec = AttnSpec(head_dim=hd, num_q_heads=hq, num_kv_heads=hkv, dtype=torch.float16, cache="kv/quant",
                    phase="decode", page_size=page_size, q_per_seq=1, device_type="cuda",
                    device_cc=device_cc(torch.device(DEV)))
    return Case(spec, q_lens or (1,) * len(past), past, bits)


def _check(out: torch.Tensor, args, what: str) -> None:
    ref = reference_attention(args)
    rows = (args.cu_seqlens_q[1:] > args.cu_seqlens_q[:-1]).nonzero().flatten().tolist()
    tok = [int(args.cu_seqlens_q[b]) for b in rows]
    assert out.shape == ref.shape and out.dtype == ref.dtype
    got, want = out[tok].float(), ref[tok].float()
    assert torch.isfinite(got).all(), f"{what}: non-finite output (a poisoned slot read?)"
    tol = tolerance(torch.float16) * max(1.0, want.abs().max().item())
    err = (got - want).abs().max().item()
    assert err <= tol, f"{what}: max err {err:.3g} > {tol:.3g}"


SHAPES = [(128, 32, 8), (64, 32, 8), (128, 28, 4), (64, 8, 8), (128, 16, 2)]  # groups 4, 4, 7, 1, 8
BITS = [(4, 4), (8, 8), (4, 8), (8, 4)]


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b[0]}v{b[1]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"d{s[0]}-h{s[1]}x{s[2]}")
def test_matches_reference(qsplit, shape: tuple[int, int, int], bits: tuple[int, int]) -> None:
    """Lengths 1-2049 in one batch (keys ending inside a tile, on a tile's edge, inside a split), the chosen
    split count for a 4096 bound and a forced one."""
    hd, hq, hkv = shape
    args = make_args(_case(hd, hq, hkv, (0, 15, 16, 300, 1023, 2048), bits), DEV, seed=hd + hq + bits[0])
    assert args.quant is not None
    for splits in (None, 3, 64):
        out = qsplit(args.q, args.k_cache, args.v_cache, args.quant, args.page_table, args.cu_seqlens_q,
                     args.seq_lens_k, args.scale, 4096, splits=splits)
        _check(out, args, f"splits={splits}")


@pytest.mark.parametrize("bits", [(4, 4), (8, 8)], ids=lambda b: f"k{b[0]}v{b[1]}")
@pytest.mark.parametrize("page_size", [16, 256])
def test_one_sequence_pdl_and_pages(qsplit, bits: tuple[int, int], page_size: int) -> None:
    """b=1 as decode runs it (every split arrives), one split alone, long pages; as a programmatic dependent the
    output is bit-equal."""
    args = make_args(_case(128, 32, 8, (3000,), bits, page_size), DEV, seed=page_size + bits[1])
    assert args.quant is not None
    outs = []
    for pdl in (False, True):
        out = qsplit(args.q, args.k_cache, args.v_cache, args.quant, args.page_table, args.cu_seqlens_q,
                     args.seq_lens_k, args.scale, 32768, pdl=pdl)
        _check(out, args, f"pdl={pdl}")
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    one = qsplit(args.q, args.k_cache, args.v_cache, args.quant, args.page_table, args.cu_seqlens_q,
                 args.seq_lens_k, args.scale, 32768, splits=1)
    _check(one, args, "one split")


def test_sequences_without_a_query(qsplit) -> None:
    """Padded rows (no query this step) are skipped; the others are right."""
    args = make_args(_case(128, 32, 8, (40, 700, 5), (4, 4), q_lens=(1, 0, 1)), DEV, seed=3)
    assert args.quant is not None
    out = qsplit(args.q, args.k_cache, args.v_cache, args.quant, args.page_table, args.cu_seqlens_q, args.seq_lens_k,
                 args.scale, 1024)
    _check(out, args, "padded row")


def test_graph_replay_at_other_lengths(qsplit) -> None:
    """Captured once through the backend at a bound, replayed with new lengths and queries as the decode graphs run
    it: the splits follow each replay's lengths on the device, the arrival counters are clean after every call."""
    from exl3_attn_backends.cuda_qsplit import CudaQuantSplitAttention

    args = make_args(_case(128, 32, 8, (2000, 600), (4, 4)), DEV, seed=5)
    table = args.page_table.clone()
    table[1] = table[0]  # both rows may grow to 2001 keys over the written pages
    bound = 4096
    spec = args.spec._replace(max_keys=bound, num_seqs=2)
    static = args._replace(spec=spec, max_seqlen_k=bound, seq_lens_k=args.seq_lens_k.clone(), q=args.q.clone(),
                           page_table=table)
    b = CudaQuantSplitAttention()
    assert b.unsupported_reasons(spec) == []
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        b.forward(static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = b.forward(static)
    for lens in ((2001, 601), (17, 1), (64, 2001), (129, 1500)):
        static.seq_lens_k.copy_(torch.tensor(lens, dtype=torch.int32))
        static.q.copy_(torch.randn_like(static.q))
        g.replay()
        torch.cuda.synchronize()
        _check(out, static._replace(max_seqlen_k=max(lens)), f"replay {lens}")


def test_dispatcher_picks_it_for_long_quantized_decode() -> None:
    """K4V4 past the short-bound kernel's reach goes here; a width without its unpacking path goes to Triton."""
    from exl3_core.attention.dispatch import Dispatcher
    from exl3_core.attention.spec import sm_count
    from exl3_core.plugins import load_plugins

    d = Dispatcher(load_plugins())
    dev = torch.device(DEV)
    base = AttnSpec(head_dim=128, num_q_heads=32, num_kv_heads=8, dtype=torch.float16, cache="kv/quant",
                    phase="decode", page_size=256, device_type="cuda", device_cc=device_cc(dev), max_keys=32768,
                    num_seqs=1, q_per_seq=1, sm_count=sm_count(dev), kv_bits=(4, 4))
    assert d.select(base).name == "cuda_qsplit"
    assert d.select(base._replace(kv_bits=(8, 8))).name == "cuda_qsplit"
    assert d.select(base._replace(kv_bits=(4, 3))).name == "triton_paged"
    assert d.select(base._replace(max_keys=256)).name == "cuda_decode"
    assert d.select(base._replace(max_keys=1024)).name == "triton_paged"
