"""Recent rows of a quantized cache (:mod:`exl3_core.reference.kv_recent`): the split of 8-bit codes into the
pages' codes and low bits, and the reference attention reading each query's window at 8 bits."""
from __future__ import annotations

import pytest
import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.attention.spec import AttnArgs, AttnSpec, QuantPages, RecentRows
from exl3_core.cache.kv_quant import KVQuantLayer
from exl3_core.cache.layer import CacheStep
from exl3_core.reference import kv_quant as ref
from exl3_core.reference import kv_recent
from exl3_core.reference.attention import attention


@pytest.mark.parametrize("bits", range(2, 8))
def test_split_codes_are_the_top_bits_of_8_bit_codes(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(40, 3, 64, generator=g) * torch.rand(40, 3, 1, generator=g) * 5
    x[0] = 0.0
    x[1, 0, 0] = 6e4  # a scale at fp16's limit
    x = x.reshape(40, -1)
    words, scales = ref.quantize(x, bits)
    hi, low, s = kv_recent.quantize_split(x, bits)
    assert torch.equal(hi, words) and torch.equal(s, scales)
    w8, s8 = ref.quantize(x, 8)
    extra = kv_recent.extra_bits(bits)
    assert torch.equal(kv_recent.unpack_low(low, extra), ref.unpack(w8, 8) & ((1 << extra) - 1))
    assert torch.equal(kv_recent.dequantize_refined_rotated(hi, low, s, bits), ref.dequantize_rotated(w8, s8, 8))


def test_split_refuses_an_8_bit_side() -> None:
    with pytest.raises(ValueError, match="8-bit side"):
        kv_recent.quantize_split(torch.zeros(1, 32), 8)
    with pytest.raises(ValueError, match="bits=9"):
        kv_recent.extra_bits(9)


@pytest.mark.parametrize("bits", [(4, 4), (8, 3), (3, 8)])
@pytest.mark.parametrize("q_lens,past", [((1, 1), (40, 9)), ((3, 2), (30, 70)), ((37, 5), (20, 0))])
def test_reference_reads_each_querys_window_at_8_bits(bits: tuple[int, int], q_lens: tuple[int, ...],
                                                      past: tuple[int, ...]) -> None:
    """Against a direct form: key j of query p at 8 bits iff p - W < j and j is a forward row or its ring row is
    tagged j (one ring row per sequence tagged stale here), else at the pages' width."""
    g = torch.Generator().manual_seed(sum(q_lens) + sum(past) + bits[0])
    hkv, hq, d, ps, window = 2, 4, 64, 16, 16
    lens = [p + n for p, n in zip(past, q_lens)]
    keys = [torch.randn(n, hkv, d, generator=g) for n in lens]
    vals = [torch.randn(n, hkv, d, generator=g) for n in lens]
    need = [-(-n // ps) for n in lens]
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    pages = torch.randperm(sum(need), generator=g)
    i = 0
    for b, n in enumerate(need):
        table[b, :n] = pages[i:i + n].to(torch.int32)
        i += n
    sides = []
    for xs, nb in ((keys, bits[0]), (vals, bits[1])):
        codes = torch.zeros(sum(need), ps, hkv * d // 32 * nb, dtype=torch.int32)
        scales = torch.zeros(sum(need), ps, hkv * d // 32, dtype=torch.float16)
        extra = kv_recent.extra_bits(nb)
        ring = torch.zeros(len(lens), window, hkv * d // 32 * extra, dtype=torch.int32) if extra else None
        rows = torch.zeros(sum(q_lens), hkv * d // 32 * extra, dtype=torch.int32) if extra else None
        sides.append((codes, scales, ring, rows, xs, nb))
    tags = torch.full((len(lens), window), -1, dtype=torch.int32)
    stale = {(b, past[b] - 1 - b) for b in range(len(lens)) if past[b] - 1 - b >= 0}
    t0 = 0
    for b, n in enumerate(lens):
        for j in range(n):
            page, off = int(table[b, j // ps]), j % ps
            for codes, scales, ring, rows, xs, nb in sides:
                x = xs[b][j].reshape(1, -1)
                if ring is None:
                    w, s = ref.quantize(x, nb)
                    low = None
                else:
                    w, low, s = kv_recent.quantize_split(x, nb)
                codes[page, off], scales[page, off] = w[0], s[0]
                if low is not None and j >= past[b]:
                    rows[t0 + j - past[b]] = low[0]
                if low is not None and past[b] - window <= j < past[b]:
                    ring[b, j % window] = low[0]
            if past[b] - window <= j < past[b]:
                tags[b, j % window] = j + window if (b, j) in stale else j
        t0 += q_lens[b]
    (kc, ks, kr, krows, _, _), (vc, vs, vr, vrows, _, _) = sides
    recent = RecentRows(kr, vr, tags, krows, vrows, torch.arange(len(lens), dtype=torch.int32), window)
    spec = AttnSpec(head_dim=d, num_q_heads=hq, num_kv_heads=hkv, dtype=torch.float32, cache="kv/quant",
                    page_size=ps, kv_bits=bits, recent=window)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    args = AttnArgs(spec=spec, q=q, cu_seqlens_q=cu, seq_lens_k=torch.tensor(lens, dtype=torch.int32),
                    max_seqlen_q=max(q_lens), max_seqlen_k=max(lens), scale=d ** -0.5, k_cache=kc, v_cache=vc,
                    page_table=table, quant=QuantPages(ks, vs, bits[0], bits[1], recent=recent))
    out = attention(args)

    def deq(x: torch.Tensor, nb: int) -> torch.Tensor:
        return ref.dequantize(*ref.quantize(x.reshape(x.shape[0], -1), nb), nb).view(x.shape)

    for b, n in enumerate(lens):
        k8, v8 = deq(keys[b], 8), deq(vals[b], 8)
        kq, vq = deq(keys[b], bits[0]), deq(vals[b], bits[1])
        for i in range(q_lens[b]):
            p = past[b] + i
            j = torch.arange(p + 1)
            fine = (j > p - window) & ((j >= past[b]) | torch.tensor([(b, int(x)) not in stale for x in j]))
            kk = torch.where(fine[:, None, None], k8[:p + 1], kq[:p + 1]).repeat_interleave(hq // hkv, 1)
            vv = torch.where(fine[:, None, None], v8[:p + 1], vq[:p + 1]).repeat_interleave(hq // hkv, 1)
            w = torch.softmax(torch.einsum("hd,khd->hk", q[cu[b] + i], kk) * d ** -0.5, -1)
            want = torch.einsum("hk,khd->hd", w, vv)
            torch.testing.assert_close(out[cu[b] + i], want, atol=2e-5, rtol=1e-5)


# -- the layer's store, the ring update and a model's forwards -------------------------------------------------------
def _layer(k_bits: int = 4, v_bits: int = 3) -> KVQuantLayer:
    return KVQuantLayer(num_pages=5, page_size=16, num_kv_heads=2, head_dim=64, head_dim_v=32, dtype=torch.float32,
                        device="cpu", k_bits=k_bits, v_bits=v_bits, recent=16, recent_seqs=4)


def _step(one_row: bool) -> tuple[CacheStep, torch.Tensor]:
    if one_row:  # three sequences, one row each, as a decode step
        pos = torch.tensor([5, 20, 33])
        return CacheStep(pos, torch.arange(4, dtype=torch.int32), (pos + 1).to(torch.int32),
                         torch.tensor([2, 1, 3], dtype=torch.int32), 1), torch.tensor([7, 40, 61])
    pos = torch.cat([torch.arange(10, 17), torch.arange(0, 3)])  # a chunk of 7 after 10 cached, and a fresh 3
    return CacheStep(pos, torch.tensor([0, 7, 10], dtype=torch.int32), torch.tensor([17, 3], dtype=torch.int32),
                     torch.tensor([3, 1], dtype=torch.int32), 0), torch.arange(20, 30)


@pytest.mark.parametrize("one_row", [True, False])
@pytest.mark.parametrize("rotated", [False, True])
def test_store_writes_pages_rows_and_ring(one_row: bool, rotated: bool) -> None:
    """The Triton store (interpreted) and the torch one write the same pages, rows, ring rows and tags, as the
    reference splits them; a one-row step writes its ring at once."""
    step, slots = _step(one_row)
    g = torch.Generator().manual_seed(int(one_row) + 2 * int(rotated))
    T = step.positions.shape[0]
    k = torch.randn(T, 2, 64, generator=g) * 3
    v = torch.randn(T, 2, 32, generator=g)
    q = torch.randn(T, 4, 64, generator=g)
    ang = step.positions[:, None].float() * torch.rand(1, 32, generator=g)
    cos, sin = ang.cos(), ang.sin()
    out = []
    for impl in ("torch", "triton"):
        layer = _layer()
        layer.bind_step(step)
        qi, ki = q.clone(), k.clone()
        if rotated:
            layer.write_rotated(qi, ki, v, slots, cos, sin, 64, False, impl=impl)  # type: ignore[arg-type]
        else:
            layer.write(ki, v, slots, impl=impl)  # type: ignore[arg-type]
        rows = layer._rows_for(T)
        out.append((ki, layer.k_codes, layer.k_scales, layer.v_codes, layer.v_scales, rows[0][:T], rows[1][:T],
                    layer.k_ring, layer.v_ring, layer.tags))
    for a, b in zip(*out):
        assert torch.equal(a, b)
    ki, kc, ks, vc, vs, krows, vrows, kring, vring, tags = out[0]
    for x, codes, scales, rows, ring, bits in ((ki, kc, ks, krows, kring, 4), (v, vc, vs, vrows, vring, 3)):
        w, low, s = kv_recent.quantize_split(x.reshape(T, -1), bits)
        assert torch.equal(codes.view(-1, codes.shape[-1])[slots], w)
        assert torch.equal(scales.view(-1, scales.shape[-1])[slots], s)
        assert torch.equal(rows, low)
        if one_row:
            at = step.ring_slots.long() * 16 + step.positions % 16  # type: ignore[union-attr]
            assert torch.equal(ring.view(-1, ring.shape[-1])[at], low)
            assert torch.equal(tags.view(-1)[at], step.positions.to(torch.int32))
        else:  # written after the attention (ring_update), not by the store
            assert (tags == -1).all()


def test_ring_update_kernel_equals_reference() -> None:
    from exl3_core.kernels import kv_quant as kernels

    g = torch.Generator().manual_seed(5)
    lens_q = [40, 3, 1, 16]
    past = [7, 30, 90, 0]
    pos = torch.cat([torch.arange(p, p + n) for p, n in zip(past, lens_q)])
    cu = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor([p + n for p, n in zip(past, lens_q)], dtype=torch.int32)

    def recent() -> RecentRows:
        g2 = torch.Generator().manual_seed(6)
        ints = lambda *s: torch.randint(-2 ** 31, 2 ** 31 - 1, s, generator=g2, dtype=torch.int32)  # noqa: E731
        return RecentRows(ints(6, 16, 8), ints(6, 16, 4), ints(6, 16), ints(sum(lens_q), 8), ints(sum(lens_q), 4),
                          torch.tensor([4, 1, 5, 2], dtype=torch.int32), 16)

    want, got = recent(), recent()
    kv_recent.ring_update(want, pos, cu, lens)
    kernels.ring_update(got, pos, cu, lens)
    for a, b in zip(want[:5], got[:5]):
        assert torch.equal(a, b)
    assert int((want.tags == pos[39]).sum()) == 1  # the long chunk's last row went in
    del g


def _forwards(cache_kwargs: dict, plan_chunks: list[int], decode: int) -> list[torch.Tensor]:
    from exl3_core.bench.models import build_model, parse_shape
    from exl3_core.plan import ExecutionPlan

    model, cache = build_model(parse_shape("custom(128,256,2,4,2,300)"), device="cpu", dtype=torch.float32, seed=4,
                               cache_tokens=8 * 16, page_size=16, cache_kwargs=cache_kwargs)
    plan = ExecutionPlan(model)
    ids = torch.randint(0, 300, (sum(plan_chunks) + decode,), generator=torch.Generator().manual_seed(9)).tolist()
    table = torch.tensor([cache.allocator.allocate(8)], dtype=torch.int32)
    ring = [1] if cache.ring_slots else None
    logits, past = [], 0
    for n in plan_chunks + [1] * decode:
        meta = BatchMeta.from_lists([ids[past:past + n]], [past], page_table=table, page_size=16, ring_slots=ring,
                                    logits_indices=torch.tensor([n - 1]))
        logits.append(plan.forward(meta, cache)[0].float())
        past += n
    return logits[-decode - 1:]


def test_forwards_read_recent_rows_whatever_the_chunking() -> None:
    """A prompt prefilled in one chunk, in chunks that cross the window, or token by token, then decoded: the same
    logits (each query reads its own window at 8 bits however the rows arrived), and not those of the pages alone."""
    opts = {"variant": "quant", "k_bits": 3, "v_bits": 3, "recent": 16}
    one = _forwards(opts, [50], 6)
    for chunks in ([13, 13, 13, 11], [1] * 50):
        for a, b in zip(one, _forwards(opts, chunks, 6)):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    plain = _forwards(opts | {"recent": 0}, [50], 6)
    assert max((a - b).abs().max().item() for a, b in zip(one, plain)) > 1e-2


def test_a_reused_ring_slot_starts_empty() -> None:
    """A job that takes the ring slot a longer job left finds no row of that job's positions there: the generator
    clears the slot's tags when it hands the slot out (a reused prefix's positions, never written by the new job,
    would otherwise read the earlier job's low bits)."""
    from exl3_core.bench.models import build_model, parse_shape
    from exl3_core.generator import Generator, Job

    model, cache = build_model(parse_shape("custom(128,256,2,4,2,300)"), device="cpu", dtype=torch.float32, seed=4,
                               cache_tokens=16 * 16, page_size=16,
                               cache_kwargs={"variant": "quant", "k_bits": 4, "v_bits": 4, "recent": 16})
    gen = Generator(model=model, cache=cache, tokenizer=None, max_batch_size=1)
    g = torch.Generator().manual_seed(2)
    long_job = Job(torch.randint(0, 300, (1, 70), generator=g), max_new_tokens=4, stop_at_eos=False)
    gen.enqueue(long_job)
    while gen.num_remaining():
        gen.iterate()
    layers = [layer for layer in cache.layers if isinstance(layer, KVQuantLayer)]
    slot = 1 + max(range(cache.ring_slots - 1), key=lambda s: int((layers[0].tags[1 + s] >= 0).sum()))
    assert all(int(layer.tags[slot].max()) >= 70 for layer in layers), "the long job kept no recent rows"
    short = Job(torch.randint(0, 300, (1, 5), generator=g), max_new_tokens=3, stop_at_eos=False)
    gen.enqueue(short)
    gen.iterate()
    assert short.ring_slot == slot
    for layer in layers:  # only the short job's own positions, or nothing
        assert int(layer.tags[slot].max()) < 6, layer.tags[slot].tolist()
