"""Triton paged attention vs the torch reference (CPU interpreter in CI, CUDA on a GPU)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from exl3_attn_backends.triton_paged import TritonPagedAttention

from exl3_core.attention import AttnSpec
from exl3_core.attention.spec import AttnArgs, device_cc
from exl3_core.testing.attention import Case, check_backend, default_cases, make_args

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


CASES = default_cases(DEVICE, torch.float32)


def test_takes_every_conformance_case() -> None:
    b = TritonPagedAttention()
    assert {c.id: b.unsupported_reasons(c.spec) for c in CASES} == {c.id: [] for c in CASES}


# every case against the reference runs in tests/contract (where this plugin is installed); here every third one,
# with another seed, so that the plugin's own tests check its kernels alone
@pytest.mark.parametrize("case", CASES[::3] if DEVICE == "cpu" else CASES, ids=lambda c: c.id)
def test_matches_reference(case: Case) -> None:
    check_backend(TritonPagedAttention(), case, DEVICE, seed=7)


def test_declines_with_reasons() -> None:
    b = TritonPagedAttention()
    spec = AttnSpec(head_dim=64, num_q_heads=6, num_kv_heads=4, dtype=torch.float16, cache="kv/toy",
                    has_sinks=True, device_type="cuda", device_cc=(7, 5))
    reasons = " | ".join(b.unsupported_reasons(spec))
    for part in ("compute capability", "multiple of num_kv_heads", "sinks", "kv/toy"):
        assert part in reasons


def test_never_preferred_on_cpu() -> None:
    spec = AttnSpec(head_dim=64, num_q_heads=4, num_kv_heads=4, dtype=torch.float32)
    assert TritonPagedAttention().priority(spec) < 0


# -- split-KV decode ------------------------------------------------------------------------------
# Long paged contexts (page_size 16, shuffled pages, NaN-poisoned free slots from make_args),
# lengths that are not multiples of a split's share, and a sequence of length 1.

def _decode_case(hd: int, hq: int, hkv: int, past: tuple[int, ...], dtype: torch.dtype = torch.float32,
                 **kw: object) -> Case:
    dev = torch.device(DEVICE)
    spec = AttnSpec(head_dim=hd, num_q_heads=hq, num_kv_heads=hkv, dtype=dtype, cache=kw.pop("cache", "kv/fp16"),
                    phase="decode", page_size=16, device_type=dev.type, device_cc=device_cc(dev), **kw)  # type: ignore[arg-type]
    return Case(spec, (1,) * len(past), past)


DECODE_CASES = [
    _decode_case(128, 8, 2, (0, 300, 517)),  # lengths 1, 301, 518
    _decode_case(64, 4, 4, (410, 0)),
    _decode_case(80, 6, 1, (257, 33, 0)),  # MQA, head dim not a power of two
    _decode_case(128, 32, 8, (700,), torch.float16),  # the 8B-shape head layout
    _decode_case(64, 4, 2, (389, 0, 150), window=100),
    _decode_case(64, 2, 1, (333, 0), softcap=20.0),
    _decode_case(96, 4, 1, (0, 450), head_dim_v=64, cache="mla/fp16"),  # latent: values lead the keys
    _decode_case(96, 20, 1, (345,), torch.float16, head_dim_v=64, cache="mla/fp16"),  # > 16 heads: 2 head blocks
]
BIG = 3  # the 8B layout: seconds per call in Triton's CPU interpreter, so with -m slow there


def _marks(case: Case) -> list[pytest.MarkDecorator]:
    return [pytest.mark.slow] if case is DECODE_CASES[BIG] and DEVICE == "cpu" else []


def _params(cases: list[Case]) -> list[object]:
    return [pytest.param(c, marks=_marks(c)) for c in cases]


def _split_param(case: Case, splits: int | None, short_chunk: int) -> object:
    return pytest.param(case, splits, short_chunk, marks=_marks(case),
                        id=f"{case.id}-splits{splits}-chunk{short_chunk or 64}")


# each case with the heuristic's split count (None) on the long bounds' 64-key chunks and with 7 splits on the
# short bounds' 32-key chunks; 40 splits: many empty
@pytest.mark.parametrize("case,splits,short_chunk",
                         [_split_param(c, n, chunk) for c in DECODE_CASES for n, chunk in ((None, 0), (7, 32))]
                         + [_split_param(DECODE_CASES[0], 3, 32), _split_param(DECODE_CASES[4], 3, 0),
                            _split_param(DECODE_CASES[6], 40, 0)])
def test_split_kv_decode_matches_reference(case: Case, splits: int | None, short_chunk: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The split kernel against the reference: one key chunk loaded before the wait, most lengths taking
    several splits and the merge; 32-key chunks for these short bounds (SHORT_BOUND_BLOCK_N), or the
    long bounds' 64 (the rule off)."""
    import exl3_attn_backends.triton_paged as tp

    used: list[int] = []
    real = tp.decode_split_kv
    monkeypatch.setattr(tp, "SHORT_BOUND_BLOCK_N", short_chunk)
    monkeypatch.setattr(tp, "decode_split_kv", lambda a, n: used.append(n) or real(a, n))
    b = TritonPagedAttention()
    b.decode_num_splits = splits
    assert b.unsupported_reasons(case.spec) == []
    check_backend(b, case, DEVICE, seed=11)
    assert used, "a paged decode call did not take the split kernel"
    if splits is not None:
        assert used[0] == splits


def test_split_kv_short_sequence_needs_no_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lengths within one least share (a split's key chunk) take no merge: the arrival counters stay
    untouched and the partials unwritten, the output is the reference's; one key more than the share
    takes the merge, with the same result."""
    import exl3_attn_backends.triton_paged as tp

    import exl3_core.kernels.counters as kc
    from exl3_core.reference.attention import attention as reference_attention

    case = _decode_case(64, 8, 2, (31, 0, 20), torch.float16)  # fp16 out: the fp32 tensors are the partials
    args = make_args(case, DEVICE, seed=21)
    share = tp._decode_block_n(case.spec, args.max_seqlen_k)
    assert share == 32  # a short bound: 32-key chunks, the longest sequence one of them
    parts: list[torch.Tensor] = []
    real_empty = torch.empty

    def spy(*a: object, **kw: object) -> torch.Tensor:  # the partial buffers, poisoned
        t = real_empty(*a, **kw)  # type: ignore[arg-type]
        if t.dtype == torch.float32:
            t.fill_(float("nan"))
            parts.append(t)
        return t

    def decode_spied(a: AttnArgs) -> torch.Tensor:  # parts: this call's partial buffers
        parts.clear()
        with monkeypatch.context() as m:
            m.setattr(tp.torch, "empty", spy)
            return tp.decode_split_kv(a, 4)

    out = decode_spied(args)
    torch.testing.assert_close(out, reference_attention(args), atol=2e-3, rtol=2e-3)
    assert len(parts) == 3 and all(bool(p.isnan().all()) for p in parts), "a one-split sequence stored partials"
    dev = args.q.device
    counts = kc._cache[("decode_split", dev.type, dev.index)]
    assert int(counts.abs().sum()) == 0
    longer = make_args(_decode_case(64, 8, 2, (share, 3), torch.float16), DEVICE, seed=22)  # share + 1 keys
    out = decode_spied(longer)
    torch.testing.assert_close(out, reference_attention(longer), atol=2e-3, rtol=2e-3)
    assert not bool(parts[0].isnan().all()), "a sequence of two shares was not merged"
    assert int(kc._cache[("decode_split", dev.type, dev.index)].abs().sum()) == 0


@pytest.mark.parametrize("case", DECODE_CASES[:5] + DECODE_CASES[6:7], ids=lambda c: c.id)
def test_split_kv_reload_of_the_newest_row(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """The split kernel's first chunk is loaded before its wait (as a programmatic dependent); the
    reload of the newest key/value after the wait, merged into that chunk, gives the same result."""
    import exl3_attn_backends.triton_paged as tp

    real = tp.decode_split_kv
    forced: list[bool] = []
    monkeypatch.setattr(tp, "decode_split_kv", lambda a, n: forced.append(True) or real(a, n, reload_fresh=True))
    check_backend(TritonPagedAttention(), case, DEVICE, seed=12)
    assert forced


@pytest.mark.parametrize("case", _params([DECODE_CASES[i] for i in (3, 4, 6)]), ids=lambda c: c.id)
def test_split_kv_merge_rounds_and_counters(case: Case) -> None:
    """Each head block's last split program merges the splits: 40 splits exceed one merge round (running
    max across rounds); lengths leave trailing splits empty. The arrival counters are left at zero, so a
    second call (a graph replay) is identical."""
    import exl3_attn_backends.triton_paged as tp

    import exl3_core.kernels.counters as kc
    from exl3_core.reference.attention import attention as reference_attention

    args = make_args(case, DEVICE, seed=5)
    out = tp.decode_split_kv(args, 40)
    ref = reference_attention(args)
    tol = 2e-5 if case.spec.dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    dev = args.q.device  # "cuda:N": the counters are cached per device index
    counts = kc._cache[("decode_split", dev.type, dev.index)]
    assert int(counts.abs().sum()) == 0, "a head block's counter was not reset by its last program"
    again = tp.decode_split_kv(args, 40)
    torch.testing.assert_close(again, out, atol=0, rtol=0)


def test_split_kv_graph_bound_reads_nothing_past_lengths() -> None:
    """As in a CUDA-graph replay: max_seqlen_k is the cache capacity and the page table is wider
    than the sequences need, its extra columns pointing at a NaN page; the split count comes from
    the bound, the key ranges from the real lengths."""
    import exl3_attn_backends.triton_paged as tp

    from exl3_core.reference.attention import attention as reference_attention

    case = _decode_case(64, 8, 2, (0, 200, 95))
    args = make_args(case, DEVICE, seed=3)
    num_pages = args.k_cache.shape[0]
    nan_page = torch.full_like(args.k_cache[:1], float("nan"))
    k_cache = torch.cat([args.k_cache, nan_page])
    v_cache = torch.cat([args.v_cache, nan_page])
    width = 64  # 1024 tokens of capacity
    table = torch.full((3, width), num_pages, dtype=torch.int32, device=args.page_table.device)
    table[:, :args.page_table.shape[1]] = args.page_table
    # make_args fills unused table entries with page 0: point them at the NaN page too
    for i, n in enumerate(int(x) for x in args.seq_lens_k):
        table[i, -(-n // 16):] = num_pages
    g = args._replace(k_cache=k_cache, v_cache=v_cache, page_table=table, max_seqlen_k=width * 16)
    splits = tp.choose_num_splits(g)
    assert splits > 1
    out = tp.decode_split_kv(g, splits)
    ref = reference_attention(args)
    assert torch.isfinite(out).all(), "a split read a slot past its sequence's length"
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_num_splits_from_static_values_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import exl3_attn_backends.triton_paged as tp

    case = _decode_case(128, 32, 8, (700,), torch.float16)
    args = make_args(case, DEVICE, seed=0)
    # same bound, different real lengths: same split count (a graph captured once stays valid)
    short = args._replace(seq_lens_k=torch.ones_like(args.seq_lens_k))
    assert tp.choose_num_splits(args) == tp.choose_num_splits(short)
    assert tp.choose_num_splits(args._replace(max_seqlen_k=16)) == 1  # one chunk: nothing to split
    # the key chunk: 32 while the bound holds at most MAX_SPLITS of them (the short-bound rule, on by
    # default), else the single-pass kernel's 64; with the rule off, 64 for every bound
    assert tp._decode_block_n(case.spec, 32 * tp.MAX_SPLITS) == 32
    assert tp._decode_block_n(case.spec, 32 * tp.MAX_SPLITS + 1) == 64
    # a split's least share is one chunk: a bound of one chunk is one split, one key more two
    assert tp.choose_num_splits(args._replace(max_seqlen_k=32)) == 1
    assert tp.choose_num_splits(args._replace(max_seqlen_k=33)) == 2
    assert tp.choose_num_splits(args._replace(max_seqlen_k=1 << 20)) <= tp.MAX_SPLITS
    monkeypatch.setattr(tp, "SHORT_BOUND_BLOCK_N", 0)
    assert tp._decode_block_n(case.spec, 32 * tp.MAX_SPLITS) == 64


# -- split-KV decode of several queries per sequence (speculative verification) --------------------------------

def _rows_case(hd: int, hq: int, hkv: int, past: tuple[int, ...], q_lens: tuple[int, ...],
               dtype: torch.dtype = torch.float32, **kw: object) -> Case:
    dev = torch.device(DEVICE)
    bits = kw.pop("bits", ())
    spec = AttnSpec(head_dim=hd, num_q_heads=hq, num_kv_heads=hkv, dtype=dtype, cache=kw.pop("cache", "kv/fp16"),
                    phase="decode", page_size=16, device_type=dev.type, device_cc=device_cc(dev),
                    q_per_seq=max(q_lens), **kw)  # type: ignore[arg-type]
    return Case(spec, q_lens, past, bits)  # type: ignore[arg-type]


ROWS_CASES = [
    # 4 queries x a group of 4: one head block; the step's keys straddle 32/64-key chunks and split bounds
    _rows_case(64, 8, 2, (0, 28, 60, 300), (4, 4, 4, 4)),
    # fewer queries in some sequences (and none in one): rows past a sequence's count are left out
    _rows_case(128, 8, 2, (5, 200, 97), (3, 1, 0)),
    # 6 queries x a group of 4 = 24 rows: two head blocks
    _rows_case(64, 12, 3, (130, 17), (6, 6)),
    _rows_case(64, 2, 1, (250, 3), (5, 5), softcap=20.0),
    _rows_case(96, 4, 1, (40, 333), (3, 3), head_dim_v=64, cache="mla/fp16"),
    _rows_case(64, 8, 2, (90, 31, 0), (4, 4, 4), cache="kv/quant", bits=(4, 3)),
]


@pytest.mark.parametrize("splits", [None, 7], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("case", ROWS_CASES, ids=lambda c: c.id)
def test_split_kv_several_queries_match_reference(case: Case, splits: int | None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A multi-token decode step takes the split kernel: each query sees the keys up to its own position, the
    merge weighs each (query, head) row's splits; with the newest keys reloaded after the wait as well."""
    import exl3_attn_backends.triton_paged as tp

    used: list[int] = []
    real = tp.decode_split_kv
    monkeypatch.setattr(tp, "decode_split_kv", lambda a, n: used.append(n) or real(a, n))
    b = TritonPagedAttention()
    b.decode_num_splits = splits
    assert b.unsupported_reasons(case.spec) == []
    assert b.route(case.spec).startswith("split-KV")
    check_backend(b, case, DEVICE, seed=13)
    assert used and (splits is None or used[0] == splits)
    if splits is not None or DEVICE != "cpu":  # in the CPU interpreter, the reload with 7 splits only
        monkeypatch.setattr(tp, "decode_split_kv", lambda a, n: real(a, n, reload_fresh=True))
        check_backend(b, case, DEVICE, seed=14)


def test_split_kv_several_queries_route() -> None:
    """Only uniform, causal, windowless multi-token steps take the split kernel; the rest the single pass."""
    b = TritonPagedAttention()
    base = ROWS_CASES[0].spec
    assert b.route(base).startswith("split-KV")
    for other in (base._replace(q_per_seq=0), base._replace(window=8), base._replace(causal=False)):
        assert b.route(other) == "single-pass varlen kernel", other


def test_speculative_generation_through_the_split_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine end to end on Triton attention alone: greedy speculative decoding (a draft that is the model
    itself) gives the plain generator's tokens, its verification and two-token draft steps through the split
    kernel with several queries per sequence."""
    import exl3_attn_backends.triton_paged as tp

    from exl3_core.bench.models import build_model, parse_shape
    from exl3_core.generator import Generator, Job

    shape = parse_shape("custom(64,128,1,4,2,256)")
    kw = {"device": DEVICE, "cache_tokens": 2048, "attention": ["triton_paged"], "dtype": torch.float32,
          "page_size": 16}
    model, cache = build_model(shape, **kw)
    _, draft_cache = build_model(shape, **kw)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, shape.vocab, (n,), generator=g).tolist() for n in (21, 6)]  # a batch of two

    def tokens(**spec: object) -> list[list[int]]:
        gen = Generator(model, cache, None, max_batch_size=2, **spec)  # type: ignore[arg-type]
        jobs = [Job(p, max_new_tokens=6, stop_at_eos=False) for p in prompts]
        gen.enqueue(jobs)
        while gen.num_remaining():
            gen.iterate()
        return [j.seq[len(j.prompt):] for j in jobs]

    plain = tokens()
    rows: list[int] = []
    real = tp.decode_split_kv
    monkeypatch.setattr(tp, "decode_split_kv", lambda a, n, **k: rows.append(a.spec.q_per_seq) or real(a, n, **k))
    assert tokens(draft_model=model, draft_cache=draft_cache, num_draft_tokens=3, dynamic_draft=False) == plain
    assert 4 in rows and 2 in rows, sorted(set(rows))  # verification (k + 1 rows) and the draft's first step



# -- recent rows: each sequence's newest positions read at 8 bits from a "kv/quant" view ----------------------------

def _recent_case(hd: int, hq: int, hkv: int, past: tuple[int, ...], q_lens: tuple[int, ...], bits: tuple[int, int],
                 phase: str = "decode", window: int = 16) -> Case:
    dev = torch.device(DEVICE)
    spec = AttnSpec(head_dim=hd, num_q_heads=hq, num_kv_heads=hkv, dtype=torch.float32, cache="kv/quant",
                    phase=phase, page_size=16, device_type=dev.type, device_cc=device_cc(dev),  # type: ignore[arg-type]
                    q_per_seq=max(q_lens) if phase == "decode" else 0, recent=window)
    return Case(spec, q_lens, past, bits)


def _without_recent(args: AttnArgs) -> AttnArgs:
    """The same call read at the pages' bits alone."""
    assert args.quant is not None
    return args._replace(spec=args.spec._replace(recent=0), quant=args.quant._replace(recent=None))


RECENT_CASES = [
    # prefill over a cache: a forward longer than the window, chunks crossing it, one-row and fresh sequences
    (_recent_case(64, 4, 2, (0, 37, 90, 12), (40, 5, 1, 20), (2, 3), "prefill"), None),
    # a decode step (the split kernel, and the single-pass one at 1 split); an 8-bit key side (no ring) beside
    # 2-bit values
    *((_recent_case(64, 8, 2, (40, 3, 0), (1, 1, 1), (8, 2)), n) for n in (None, 1)),
    # several queries per sequence, one with fewer and one with none; 8-bit values beside 3-bit keys
    *((_recent_case(64, 8, 2, (45, 20, 9), (4, 1, 0), (3, 8)), n) for n in (None, 1)),
]


@pytest.mark.parametrize("case,splits", RECENT_CASES, ids=lambda x: x.id if isinstance(x, Case) else f"splits{x}")
def test_recent_rows_are_read_at_8_bits(case: Case, splits: int | None) -> None:
    """The reference with recent rows and without them differ far beyond the tolerance; the backend gives the
    former: it reads the low bits of the forward's rows and of the ring rows whose tags hold their positions (the
    others stale or garbage), each query's window at 8 bits and older keys at the pages' bits."""
    from exl3_core.reference.attention import attention as reference_attention

    args = make_args(case, DEVICE, seed=31)
    want, coarse = reference_attention(args), reference_attention(_without_recent(args))
    b = TritonPagedAttention()
    b.decode_num_splits = splits
    assert b.unsupported_reasons(case.spec) == []
    out = b.forward(args)
    assert (want - coarse).abs().max().item() > 1e-2  # 500x the fp32 tolerance
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(b.forward(_without_recent(args)), coarse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case,splits", [
    # 3 splits of 192 keys: 454..517 straddles two chunks of a split's loop; 237..300 starts in a split's first
    # chunk (read again after the wait for this step's rows) and ends in its loop; 0..40 is all one sequence's
    (_recent_case(64, 8, 2, (517, 300, 0, 40), (1, 1, 1, 1), (4, 3), window=64), 3),
    # 3 queries per sequence, 2 splits: 234..299 from a split's first chunk into its loop, the windows of a row's
    # earlier keys ending where a later row's begins
    (_recent_case(64, 8, 2, (297, 97), (3, 3), (2, 5), window=64), 2),
], ids=lambda x: x.id if isinstance(x, Case) else f"splits{x}")
def test_split_kv_reads_recent_rows_over_long_contexts(case: Case, splits: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The split kernel over several 64-key chunks per split (the short-bound chunk off, as for long bounds): recent
    rows read in the chunks of a split's loop and in its first, one query per sequence and several."""
    import exl3_attn_backends.triton_paged as tp

    from exl3_core.reference.attention import attention as reference_attention

    monkeypatch.setattr(tp, "SHORT_BOUND_BLOCK_N", 0)
    args = make_args(case, DEVICE, seed=41)
    assert tp._decode_block_n(case.spec, args.max_seqlen_k) == 64
    want = reference_attention(args)
    assert (want - reference_attention(_without_recent(args))).abs().max().item() > 1e-2
    torch.testing.assert_close(tp.decode_split_kv(args, splits), want, atol=2e-5, rtol=2e-5)
