"""The bf16 prefill (``StandardDecoder._prefill_dtype``, ``EXL3_PREFILL_BF16``): which forwards take it,
and on CPU with it forced, that the dtypes flow as designed (bf16 activations, keys and values stored in
the cache's fp16, a fresh sequence attending without the cache, other chunks in the cache's dtype, the
head in the model's dtype) and the logits stay within bf16 rounding of the fp16 forward's. The CUDA
path (rebuilt W in bf16, graphs) is tests/gpu/test_prefill_bf16_gpu.py."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from exl3_core import ops, settings
from exl3_core.archkit.batch import BatchMeta
from exl3_core.archkit.decoder import StandardDecoder
from exl3_core.bench.models import build_model, parse_shape
from exl3_core.nn.attention import Attention

PAGE = 16
# bf16 rounds to 8 significant bits where fp16 rounds to 11, so its error is ~8x fp16's: against the same
# model in fp32 the fp16 logits here are 1.3e-3 off, the bf16 ones 1.2e-2 (1.2e-2 from fp16's). A wrong
# path (a missed cast, keys attended in the wrong dtype or place) is off by O(1)
TOL = 3e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture
def model_cache() -> Iterator[tuple]:
    model, cache = build_model(parse_shape("custom(128,256,3,4,2,300)"), device="cpu", dtype=torch.float16, seed=5,
                               cache_tokens=16 * PAGE, page_size=PAGE)
    yield model, cache
    model.unload()


def _meta(lens: list[int], past: list[int], pages: list[list[int]], seed: int = 0) -> BatchMeta:
    g = torch.Generator().manual_seed(seed)
    toks = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lens]
    width = max(len(p) for p in pages)
    table = torch.tensor([p + [p[-1]] * (width - len(p)) for p in pages], dtype=torch.int32)
    ends = torch.tensor(lens).cumsum(0) - 1
    return BatchMeta.from_lists(toks, past, device="cpu", page_table=table, page_size=PAGE, logits_indices=ends)


def test_which_forwards_take_bf16(model_cache, monkeypatch: pytest.MonkeyPatch) -> None:
    model, cache = model_cache
    pages = cache.allocator.allocate(6)

    def dtype(lens: list[int], past: list[int], x_dtype: torch.dtype = torch.float16) -> torch.dtype | None:
        meta = _meta(lens, past, [pages] * len(lens))
        return model._prefill_dtype(torch.zeros(sum(lens), 128, dtype=x_dtype), meta)

    assert dtype([80], [0]) is None  # CPU: no fused path
    monkeypatch.setattr(ops, "fused_enabled", lambda t: True)  # what CUDA would say
    assert dtype([80], [0]) == torch.bfloat16
    assert dtype([65], [0]) == torch.bfloat16
    assert dtype([64], [0]) is None  # below GROUP_GEMM_MIN_ROWS the linears decode on the fly
    assert dtype([80], [16]) is None  # after cached tokens: the keys are in the fp16 cache
    assert dtype([40, 40], [0, 0]) is None  # two sequences
    assert dtype([80], [0], torch.float32) is None  # only an fp16 model
    monkeypatch.setenv("EXL3_PREFILL_BF16", "0")
    settings.reload()
    try:
        assert dtype([80], [0]) is None
    finally:
        monkeypatch.delenv("EXL3_PREFILL_BF16")
        settings.reload()
    assert dtype([80], [0]) == torch.bfloat16
    attn = model.layers[1].attn  # a block whose attention replaces attend keeps the model's dtype
    own = type("OwnAttend", (Attention,), {"attend": lambda self, x, state: Attention.attend(self, x, state)})
    monkeypatch.setattr(attn, "__class__", own)
    assert dtype([80], [0]) is None


def _record_dispatch(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.dtype, bool]]:
    """(q dtype, through the cache) of every attention call."""
    seen: list[tuple[torch.dtype, bool]] = []
    own = Attention._dispatch

    def spy(self, q, k, v, layer, state):
        seen.append((q.dtype, layer is not None))
        return own(self, q, k, v, layer, state)
    monkeypatch.setattr(Attention, "_dispatch", spy)
    return seen


def _kv(cache) -> list[torch.Tensor]:
    return [t.clone() for layer in cache.layers for t in layer.attn_tensors() if t is not None]


def test_forced_bf16_forward_close_to_fp16(model_cache, monkeypatch: pytest.MonkeyPatch) -> None:
    model, cache = model_cache
    pages = [cache.allocator.allocate(8)]
    seen = _record_dispatch(monkeypatch)
    ref = model.forward_batch(_meta([80], [0], pages), cache)
    kv_ref = _kv(cache)
    assert seen == [(torch.float16, True)] * 3
    seen.clear()
    x_dtypes: list[torch.dtype] = []
    model.layers[0].mlp.register_forward_pre_hook(lambda m, a: x_dtypes.append(a[0].dtype))
    monkeypatch.setattr(StandardDecoder, "_prefill_dtype", lambda self, x, meta: torch.bfloat16)
    got = model.forward_batch(_meta([80], [0], pages), cache)
    assert x_dtypes == [torch.bfloat16]
    assert seen == [(torch.bfloat16, False)] * 3  # a fresh sequence attends to its own rows, not the cache
    assert got.dtype == ref.dtype == torch.float32 and got.shape == (1, 300)
    assert _rel(got, ref) < TOL, _rel(got, ref)
    for a, b in zip(_kv(cache), kv_ref):
        assert a.dtype == torch.float16
        assert _rel(a, b) < TOL

    # a chunk after those 80 tokens, forced to bf16 all the same: attention in the cache's fp16
    seen.clear()
    later = model.forward_batch(_meta([30], [80], pages, seed=1), cache)
    assert seen == [(torch.float16, True)] * 3
    monkeypatch.undo()
    model.forward_batch(_meta([80], [0], pages), cache)  # the same prefix, in fp16
    later_ref = model.forward_batch(_meta([30], [80], pages, seed=1), cache)
    assert _rel(later, later_ref) < TOL
