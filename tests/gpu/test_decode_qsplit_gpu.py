"""On CUDA (compute capability >= 9.0): the split-KV decode attention over 4/8-bit quantized caches
(torch.ops.exl3.decode_attention_qsplit, csrc/attn/decode_attn_qsplit.cu) and its backend against the torch reference
on fresh random paged caches (keys and values quantized by the reference), with and without PDL, at forced and
chosen split counts, replayed from a CUDA graph at other lengths, and the dispatcher's choice; with recent rows
(each sequence's newest positions read at 8 bits, exl3_core/reference/kv_recent.py) against the reference reading
them, on queries aimed at keys in and around the window so that the 8-bit reads matter far beyond the tolerance."""
from __future__ import annotations


import pytest
import torch

from exl3_core.attention import AttnSpec
from exl3_core.attention.spec import AttnArgs, device_cc
from exl3_core.reference.attention import attention as reference_attention
from exl3_core.testing.attention import Case, make_args, tolerance
from exl3_core.testing.attention import focus_recent as _focus
from exl3_core.testing.kernels import captured

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
          q_lens: tuple[int, ...] | None = None, recent: int = 0) -> Case:
    """A decode case; ``recent``: the recent rows' window (make_args then fills rings, some tags stale)."""
    spec = AttnSpec(head_dim=hd, num_q_heads=hq, num_kv_heads=hkv, dtype=torch.float16, cache="kv/quant",
                    phase="decode", page_size=page_size, q_per_seq=1, device_type="cuda",
                    device_cc=device_cc(torch.device(DEV)), recent=recent)
    return Case(spec, q_lens or (1,) * len(past), past, bits)


def _check(out: torch.Tensor, args, what: str) -> torch.Tensor:
    """Asserts ``out`` matches the reference on the rows with a query; returns the reference."""
    ref = reference_attention(args)
    rows = (args.cu_seqlens_q[1:] > args.cu_seqlens_q[:-1]).nonzero().flatten().tolist()
    tok = [int(args.cu_seqlens_q[b]) for b in rows]
    assert out.shape == ref.shape and out.dtype == ref.dtype
    got, want = out[tok].float(), ref[tok].float()
    assert torch.isfinite(got).all(), f"{what}: non-finite output (a poisoned slot read?)"
    tol = tolerance(torch.float16) * max(1.0, want.abs().max().item())
    err = (got - want).abs().max().item()
    assert err <= tol, f"{what}: max err {err:.3g} > {tol:.3g}"
    return ref


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


def _graph_inputs(args: AttnArgs, bound: int = 4096) -> AttnArgs:
    """Two sequences' decode inputs as a graph captured at ``bound`` holds them: both rows may grow to 2001 keys over
    row 0's written pages, and their lengths and queries are copies a replay refreshes."""
    table = args.page_table.clone()
    table[1] = table[0]
    spec = args.spec._replace(max_keys=bound, num_seqs=2)
    return args._replace(spec=spec, max_seqlen_k=bound, seq_lens_k=args.seq_lens_k.clone(), q=args.q.clone(),
                         page_table=table)


def test_graph_replay_at_other_lengths(qsplit) -> None:
    """Captured once through the backend at a bound, replayed with new lengths and queries as the decode graphs run
    it: the splits follow each replay's lengths on the device, the arrival counters are clean after every call."""
    from exl3_attn_backends.cuda_qsplit import CudaQuantSplitAttention

    static = _graph_inputs(make_args(_case(128, 32, 8, (2000, 600), (4, 4)), DEV, seed=5))
    b = CudaQuantSplitAttention()
    assert b.unsupported_reasons(static.spec) == []
    g, out = captured(lambda: b.forward(static))
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
    # with recent rows (a 4-bit side's window at 8 bits) both CUDA kernels read them
    assert d.select(base._replace(recent=64)).name == "cuda_qsplit"
    assert d.select(base._replace(recent=64, kv_bits=(8, 4))).name == "cuda_qsplit"
    assert d.select(base._replace(recent=64, max_keys=256)).name == "cuda_decode"
    assert d.select(base._replace(max_keys=1024)).name == "triton_paged"


# -- recent rows ------------------------------------------------------------------------------------------------------
def _check_recent(out: torch.Tensor, args: AttnArgs, what: str) -> None:
    """``out`` matches the reference reading the recent rows at 8 bits, and that reference differs from the one
    reading every key at the pages' width by far more than the tolerance (the 8-bit reads are what is checked), or by
    less than it where both sides are 8-bit (nothing to refine)."""
    assert args.quant is not None and args.quant.recent is not None
    fine = _check(out, args, what).float()
    coarse = reference_attention(args._replace(quant=args.quant._replace(recent=None))).float()
    tok = [int(args.cu_seqlens_q[b]) for b in range(len(args.seq_lens_k))
           if int(args.cu_seqlens_q[b + 1]) > int(args.cu_seqlens_q[b])]
    tol = tolerance(torch.float16) * max(1.0, fine[tok].abs().max().item())
    gap = (fine[tok] - coarse[tok]).abs().max().item()
    if args.quant.k_bits == 8 and args.quant.v_bits == 8:
        assert gap <= tol, f"{what}: 8-bit sides have nothing to refine, yet the references differ by {gap:.3g}"
    else:
        assert gap >= 10 * tol, f"{what}: the recent rows move the reference by {gap:.3g} only (tolerance {tol:.3g})"


def _run(qsplit, args: AttnArgs, bound: int, **kw) -> torch.Tensor:
    assert args.quant is not None
    return qsplit(args.q, args.k_cache, args.v_cache, args.quant, args.page_table, args.cu_seqlens_q,
                  args.seq_lens_k, args.scale, bound, **kw)


@pytest.mark.parametrize("window", [16, 64, 300])
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b[0]}v{b[1]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"d{s[0]}-h{s[1]}x{s[2]}")
def test_recent_rows_match_reference(qsplit, shape: tuple[int, int, int], bits: tuple[int, int], window: int) -> None:
    """Lengths 1-2049 with windows of 16 (inside a tile), 64 and 300 (several tiles a warp, across splits at 64
    splits), the window covering short sequences whole, at the chosen and forced split counts."""
    hd, hq, hkv = shape
    args = _focus(make_args(_case(hd, hq, hkv, (0, 15, 16, 300, 1023, 2048), bits, recent=window), DEV,
                            seed=hd + hq + bits[0] + window))
    for splits in (None, 3, 64):
        _check_recent(_run(qsplit, args, 4096, splits=splits), args, f"window={window} splits={splits}")


@pytest.mark.parametrize("bits", [(4, 4), (4, 8), (8, 4)], ids=lambda b: f"k{b[0]}v{b[1]}")
@pytest.mark.parametrize("page_size", [16, 256])
def test_recent_rows_long_context(qsplit, bits: tuple[int, int], page_size: int) -> None:
    """Thousands of keys over many splits, three sequences (one without a query), windows of 64 at the end of the
    last split (and across two at 47 splits: 5898 keys, 128 a split); as a programmatic dependent the output is
    bit-equal, and one split alone is right."""
    args = _focus(make_args(_case(128, 32, 8, (5897, 3070, 4095), bits, page_size, q_lens=(1, 1, 0), recent=64),
                            DEV, seed=page_size + bits[0]))
    outs = [_run(qsplit, args, 8192, pdl=pdl) for pdl in (False, True)]
    _check_recent(outs[0], args, "long")
    assert torch.equal(outs[0], outs[1])
    _check_recent(_run(qsplit, args, 8192, splits=1), args, "one split")
    _check_recent(_run(qsplit, args, 8192, splits=47), args, "47 splits")


def test_recent_rows_without_rings_or_window() -> None:
    """8-bit sides keep no rings: a call with recent rows but none is the plain call; a window of 0 reads nothing."""
    from exl3_attn_backends.cuda_decode import recent_args

    args = make_args(_case(64, 8, 2, (40, 7), (8, 8), recent=16), "cpu", seed=1)
    assert args.quant is not None and args.quant.recent is not None
    assert args.quant.recent.k_ring is None and recent_args(args.quant) == (None, None, None, None, 0)
    four = make_args(_case(64, 8, 2, (40, 7), (4, 8), recent=16), "cpu", seed=1).quant
    assert four is not None and four.recent is not None
    assert recent_args(four)[2] is four.recent.tags
    assert recent_args(four._replace(recent=four.recent._replace(window=0))) == (None, None, None, None, 0)


def test_recent_rows_checked(qsplit) -> None:
    """Rings that do not fit are refused before any launch, naming the tensor."""
    args = make_args(_case(128, 32, 8, (100,), (4, 4), recent=16), DEV, seed=2)
    assert args.quant is not None and args.quant.recent is not None
    recent = args.quant.recent
    bad = [("k_ring", recent._replace(k_ring=recent.k_ring[..., :-4])), ("v_ring", recent._replace(v_ring=None)),
           ("slots", recent._replace(slots=recent.slots.long())), ("tags", recent._replace(tags=recent.tags.t())),
           ("window", recent._replace(window=-1)), ("window 17 exceeds", recent._replace(window=17))]
    for name, r in bad:
        with pytest.raises(ValueError, match=name):
            _run(qsplit, args._replace(quant=args.quant._replace(recent=r)), 4096)
    ring = torch.zeros(recent.k_ring.numel() + 1, dtype=torch.int32, device=DEV)[1:].view(recent.k_ring.shape)
    with pytest.raises(ValueError, match="k_ring rows must start 16-byte aligned"):
        _run(qsplit, args._replace(quant=args.quant._replace(recent=recent._replace(k_ring=ring))), 4096)


def _fill_recent(args: AttnArgs, low: tuple[torch.Tensor | None, torch.Tensor | None], stale: int) -> None:
    """Each sequence's window as a one-row step's store leaves it, in place: ring rows of its positions in
    ``[n - window, n)`` from ``low`` (per page slot: ``[pages, page_size, words]`` a side), tagged with their position
    except every ``stale``-th (a rolled-back draft's), the newest row in the forward's rows too; other tags -1."""
    assert args.quant is not None and args.quant.recent is not None
    recent, ps = args.quant.recent, args.k_cache.shape[1]
    tags = torch.full_like(recent.tags, -1)
    for b, n in enumerate(args.seq_lens_k.tolist()):
        slot = int(recent.slots[b])
        for j in range(max(0, n - recent.window), n):
            page, off = int(args.page_table[b, j // ps]), j % ps
            for ring, rows, words in ((recent.k_ring, recent.k_rows, low[0]), (recent.v_ring, recent.v_rows, low[1])):
                if ring is not None and rows is not None and words is not None:
                    ring[slot, j % recent.size] = words[page, off]
                    if j == n - 1:
                        rows[int(args.cu_seqlens_q[b])] = words[page, off]
            tags[slot, j % recent.size] = j if j == n - 1 or j % stale else j + recent.size
    recent.tags.copy_(tags)


def test_recent_rows_graph_replay(qsplit) -> None:
    """Captured once through the backend with recent rows, replayed at other lengths with the rings and tags a
    store would leave for them: the ring slots, tags and rings are device tensors read on each replay."""
    from exl3_attn_backends.cuda_qsplit import CudaQuantSplitAttention

    args = make_args(_case(128, 32, 8, (2000, 600), (4, 4), recent=64), DEV, seed=6)
    assert args.quant is not None and args.quant.recent is not None
    g = torch.Generator().manual_seed(6)
    words = args.quant.k_scales.shape[2] * 4
    low = tuple(torch.randint(-2 ** 31, 2 ** 31 - 1, (*args.k_cache.shape[:2], words), generator=g,
                              dtype=torch.int32).to(DEV) for _ in range(2))
    static = _graph_inputs(args)
    b = CudaQuantSplitAttention()
    assert b.unsupported_reasons(static.spec) == []
    graph, out = captured(lambda: b.forward(static))
    for lens in ((2001, 601), (17, 1), (64, 2001), (129, 1500), (65, 66)):
        static.seq_lens_k.copy_(torch.tensor(lens, dtype=torch.int32))
        _fill_recent(static, low, stale=3 + lens[0] % 4)
        static.q.copy_(_focus(static).q)
        graph.replay()
        torch.cuda.synchronize()
        _check_recent(out, static._replace(max_seqlen_k=max(lens)), f"replay {lens}")
