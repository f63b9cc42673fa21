"""``exl3 bench`` machinery on CPU: shapes, the random EXL3 source, and one eager bench run."""
from __future__ import annotations

import json

import pytest
import torch

from exl3_core.bench.models import RandomSource, build_model, layer_bits, named_shapes, parse_shape
from exl3_core.bench.run import combine_ceilings, decode_meta, kv_bytes_per_token, run_bench, weight_bytes_per_token
from exl3_core.quant.exl3.linear import EXL3Linear

TINY = "custom(256,384,2,4,2,700)"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_named_and_custom_shapes() -> None:
    shapes = named_shapes()
    assert {"1b", "8b"} <= set(shapes)
    s8 = parse_shape("8B")
    assert (s8.hidden, s8.layers, s8.dim_head) == (4096, 32, 128)
    s = parse_shape(TINY)
    assert (s.hidden, s.intermediate, s.layers, s.heads, s.kv_heads, s.vocab, s.dim_head) == (256, 384, 2, 4, 2, 700, 64)
    assert parse_shape("custom(256,384,2,4,2,700,32)").dim_head == 32
    with pytest.raises(ValueError, match="custom"):
        parse_shape("huge")
    with pytest.raises(ValueError, match="multiple"):
        parse_shape("custom(256,384,2,4,3,700)")


@pytest.mark.parametrize("bpw", [2.0, 3.25, 4.5, 8.0])
def test_layer_bits_average(bpw: float) -> None:
    ks = layer_bits(bpw, 16)
    assert all(1 <= k <= 8 for k in ks)
    assert abs(sum(ks) / len(ks) - bpw) <= 1 / 16


def test_random_model_is_valid_exl3() -> None:
    shape = parse_shape(TINY)
    model, _ = build_model(shape, bpw=3.0, head_bits=5, codebook="mul1")
    layers = [m for m in model.modules() if isinstance(m, EXL3Linear)]
    assert len(layers) == 7 * shape.layers + 1
    assert {m.K for m in layers} == {3, 5} and {m.codebook for m in layers} == {2}
    # the source's stored bytes are what a checkpoint of this shape holds
    src = model.bench_source
    trellis = sum(m.trellis.numel() * 2 for m in layers)
    assert trellis == sum(src.nbytes(n) for n in src.keys() if n.endswith(".trellis"))  # noqa: SIM118 - a TensorSource, not a dict
    # the reference layer computes spec 4.3 from these tensors: compare with a dense W
    x = torch.randn(3, shape.hidden)
    m = layers[0]
    ref = x @ m.dequantize()
    assert torch.allclose(m(x), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    logits = model.forward(torch.randint(0, shape.vocab, (1, 5)))
    assert logits.shape == (1, 5, shape.vocab) and torch.isfinite(logits).all()
    assert weight_bytes_per_token(model) > trellis


def test_random_source_is_deterministic() -> None:
    a, b = RandomSource(parse_shape(TINY), seed=3), RandomSource(parse_shape(TINY), seed=3)
    name = "model.layers.1.mlp.up_proj.trellis"
    assert torch.equal(a.get_tensor(name), b.get_tensor(name))
    assert not torch.equal(a.get_tensor(name), RandomSource(parse_shape(TINY), seed=4).get_tensor(name))


def test_run_bench_cpu_eager(tmp_path) -> None:
    shape = parse_shape(TINY)
    res = run_bench(shape, bpw=4.0, head_bits=6, device="cpu", contexts=(16, 40), batches=(3,), prefill_tokens=(8, 32),
                    prefill_past=20, new_tokens=4, profile=True, log=lambda s: None)
    dec = {(r["batch"], r["ctx"]): r for r in res["decode"]}
    assert set(dec) == {(1, 16), (1, 40), (3, 16)}
    for (b, ctx), r in dec.items():
        assert r["tok_s"] > 0 and not r["graphs"]
        expect = res["weight_bytes_per_token"] + b * kv_bytes_per_token(shape, ctx, 4)
        assert r["bytes_per_step"] == expect
        assert r["roofline_tok_s"] == pytest.approx(b * res["copy_bandwidth_Bps"] / expect)
    assert res["prefill"]["tok_s"] > 0 and res["decode_ceiling"] is None
    # every length fresh and after the cached prefix; the headline is the longest fresh one; no graphs on CPU
    assert [(p["tokens"], p["past"]) for p in res["prefills"]] == [(8, 0), (8, 20), (32, 0), (32, 20)]
    assert res["prefill"] is res["prefills"][2] and all(p["path"] == "eager" and p["tok_s"] > 0 for p in res["prefills"])
    assert "aten::" in res["profile_b1"]
    assert res["memory"]["planned"]["total"] == res["memory"]["allocated"]["total"]
    json.dumps(res, default=str)


@pytest.mark.parametrize("variant", ["fp16", "quant"])
def test_decode_meta_names_a_ring_slot_per_sequence_where_the_cache_keeps_rings(variant: str) -> None:
    """The bench's decode steps are what the generator's would be: over a cache with recent rows, each
    sequence its own ring slot (decode graphs refuse a step without them); a batch wider than the cache's
    slots is refused with the option that fixes it."""
    model, cache = build_model(parse_shape(TINY), device="cpu", cache_tokens=2048,
                               cache_kwargs={"variant": variant, "recent_seqs": 3} if variant == "quant" else None)
    meta, pages = decode_meta(model, cache, batch=3, ctx=20, rows=2)
    cache.allocator.release(pages)
    assert meta.input_ids.shape[0] >= 6
    if variant == "fp16":
        assert cache.ring_slots == 0 and meta.ring_slots is None
        return
    assert meta.ring_slots is not None and meta.ring_slots[:3].tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="recent_seqs >= 4"):
        decode_meta(model, cache, batch=4, ctx=20)
    assert cache.allocator.num_live() == 0  # the refused step holds no pages


def test_cli_parses(tmp_path) -> None:
    from exl3_core.cli import main

    out = tmp_path / "b.json"
    rc = main(["bench", "--shape", TINY, "--device", "cpu", "--contexts", "8", "--batches", "", "--prefill", "0",
               "--new-tokens", "2", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["shape"]["hidden"] == 256 and len(res["decode"]) == 1


def test_combine_ceilings_takes_the_median_sample_and_keeps_the_fastest() -> None:
    import random

    for n in (1, 2, 5, 6):
        rates = [random.uniform(300, 500) for _ in range(n)]
        samples = [{"tok_s": r, "seconds_per_token": 1 / r, "per_shape": [f"s{i}"]} for i, r in enumerate(rates)]
        lines: list[str] = []
        mid = combine_ceilings(samples, lines.append)
        order = sorted(range(n), key=lambda i: rates[i])
        pick = order[n // 2]  # the faster middle one for an even count
        assert mid["tok_s"] == rates[pick] and mid["per_shape"] == [f"s{pick}"]
        assert mid["samples_tok_s"] == rates and mid["strict_tok_s"] == max(rates)
        assert len(lines) == 1 and f"{n} samples" in lines[0] and f"{rates[pick]:.0f}" in lines[0]
        assert all("samples_tok_s" not in s for s in samples)  # inputs untouched
    with pytest.raises(ValueError, match="at least one"):
        combine_ceilings([])


class _StridedSource(RandomSource):
    """Every matrix as a column-major view, as a source built from transposed tensors may hand it out."""

    def get_tensor(self, name, device="cpu", dtype=None, expect_shape=None):  # type: ignore[no-untyped-def]
        t = super().get_tensor(name, device, dtype, expect_shape)
        return t.t().contiguous().t() if t.dim() == 2 else t


def test_loaded_weights_are_row_major_whatever_the_source_returns() -> None:
    """Kernels read weights in place assuming row-major: a strided view from a source is made contiguous once at
    load (else a kernel copies it on every call), with the same values."""
    from exl3_core.archkit import Config, Model
    from exl3_core.bench.models import bench_plugins

    shape = parse_shape(TINY)
    src = _StridedSource(shape, head_bits=None)
    assert not src.get_tensor("model.embed_tokens.weight").is_contiguous()
    model = Model.from_config(Config(src.directory, shape.hf_config(), plugins=bench_plugins()))
    model.load(device="cpu", source=src)
    tensors = dict(model.named_buffers()) | dict(model.named_parameters())
    strided = [n for n, t in tensors.items() if t is not None and not t.is_contiguous()]
    assert not strided, strided
    f32 = torch.float32
    assert torch.equal(model.embed.weight, src.get_tensor("model.embed_tokens.weight", dtype=f32))
    assert torch.equal(model.head.linear.weight, src.get_tensor("lm_head.weight", dtype=f32))
