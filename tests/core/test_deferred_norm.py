"""The deferred-norm decoder chain (``StandardDecoder._forward_deferred``) on CPU: its fallbacks
(norm computed from the stream, residual add with torch) give the plain forward exactly, and the row
sums of squares it hands on are the stream's. The fused CUDA ops are tested in tests/gpu."""
from __future__ import annotations

import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.archkit.decoder import _residual_capable
from exl3_core.bench.models import build_model, parse_shape
from exl3_core.nn.attention import Attention
from exl3_core.nn.module import ForwardState
from exl3_core.nn.norm import DeferredNorm, add_residual_ss


def _model():
    model, _ = build_model(parse_shape("custom(256,512,2,4,2,500)"), device="cpu", dtype=torch.float16, seed=3)
    return model


def test_deferred_chain_equals_plain_forward() -> None:
    model = _model()
    ids = torch.randint(0, 500, (3,))
    meta = BatchMeta.full(ids.view(1, -1))
    ref = model.forward_batch(meta)
    state = ForwardState(meta, None, model.allowed_backends, model.plugins)
    out = model._forward_deferred(model.embed(meta.input_ids), meta, state)
    assert out.shape == ref.shape == (3, 500)
    assert torch.equal(out, ref)


def test_deferred_first_norm_from_the_lookups_sums() -> None:
    """With the sums from the embedding lookup (``ops.embed_ss``) the first block's norm is deferred
    too; its fallback still gives the plain forward exactly."""
    from exl3_core import ops

    model = _model()
    ids = torch.randint(0, 500, (2,))
    meta = BatchMeta.full(ids.view(1, -1))
    ref = model.forward_batch(meta)
    h, ss = ops.embed_ss(meta.input_ids, model.embed.weight, model.embed.scale, 2 * len(model.layers) + 1,
                         impl="torch")
    torch.testing.assert_close(ss[0], h.float().pow(2).sum(-1))
    state = ForwardState(meta, None, model.allowed_backends, model.plugins)
    out = model._forward_deferred(h, meta, state, ss)
    assert torch.equal(out, ref)
    assert (ss[1:] > 0).all(), "every residual producer adds its rows' sums into its own slot"


def test_block_hands_on_the_streams_sums_of_squares() -> None:
    model = _model()
    meta = BatchMeta.full(torch.tensor([[4, 9]]))
    state = ForwardState(meta, None, model.allowed_backends, model.plugins)
    h = model.embed(meta.input_ids)
    ss = torch.zeros(2, 2)
    out = model.layers[0].forward_deferred(h, None, state, ss[0], ss[1])
    torch.testing.assert_close(ss[1], out.float().pow(2).sum(-1))
    assert (ss[0] > 0).all() and not torch.equal(ss[0], ss[1])
    # a deferred input is the norm of the stream when materialised
    d = DeferredNorm(out, model.layers[1].attn_norm, ss[1])
    assert torch.equal(d.materialize(), model.layers[1].attn_norm(out))


def test_add_residual_ss_accumulates() -> None:
    r, y = torch.randn(2, 8).half(), torch.randn(2, 8).half()
    ss = torch.tensor([1.0, 2.0, 7.0])
    h = add_residual_ss(r, y, ss)
    assert torch.equal(h, (r.float() + y.float()).half())
    torch.testing.assert_close(ss[:2], torch.tensor([1.0, 2.0]) + h.float().pow(2).sum(-1))
    assert ss[2] == 7.0


def test_overridden_forward_is_not_deferred() -> None:
    """A plugin subclass that changes ``forward`` alone keeps its forward: no residual path."""
    class Quirky(Attention):
        def forward(self, x, state):  # type: ignore[override]
            return super().forward(x, state) * 2

    model = _model()
    attn = model.layers[0].attn
    assert _residual_capable(attn)
    attn.__class__ = Quirky
    try:
        assert not _residual_capable(attn) and not model.layers[0].deferrable()
    finally:
        attn.__class__ = Attention


def test_forward_applies_the_carried_ids() -> None:
    """``meta.carry`` (the decode graphs' device-side ids): the forward takes row i's id from
    ``src[carry[i]]`` where that index is valid, writes it into ``meta.input_ids`` as ``ops.carry_ids`` does,
    and gives the logits of a batch built with those ids; a subclass with its own forward does not claim it."""
    from exl3_core.archkit.decoder import StandardDecoder
    from exl3_core.archkit.model import Model

    model = _model()
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 500, (4,), generator=g)
    src = torch.randint(0, 500, (6,), generator=g).double()
    carry = torch.tensor([3, -1, 0, 9], dtype=torch.int32)  # row 3's index is past src: kept
    want = ids.clone()
    want[0], want[2] = int(src[3]), int(src[0])
    ref = model.forward_batch(BatchMeta.full(want.view(-1, 1)))
    meta = BatchMeta.full(ids.clone().view(-1, 1))
    meta.carry = (carry, src)
    assert model.folds_carry
    out = model.forward_batch(meta)
    assert torch.equal(meta.input_ids, want)
    assert torch.equal(out, ref)

    cls = type(model)
    assert issubclass(cls, StandardDecoder)

    class OwnForward(cls):  # type: ignore[misc, valid-type]
        def forward_batch(self, meta, cache=None, *, fp32_logits=True):  # type: ignore[override]
            return super().forward_batch(meta, cache, fp32_logits=fp32_logits)

    model.__class__ = OwnForward
    try:
        assert not model.folds_carry
    finally:
        model.__class__ = cls
    assert model.folds_carry and not Model.folds_carry.fget(model)  # type: ignore[attr-defined]
