"""The last block runs o_proj, its MLP, the final norm and the head only on the rows whose logits are
asked for (``BatchMeta.logits_indices``, e.g. a prefill's last token): the logits and the cache equal
the full forward's, and the last MLP sees only those rows. GPU: tests/gpu/test_last_rows_gpu.py."""
from __future__ import annotations

import pytest
import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.archkit.decoder import DecoderBlock, attend_rows
from exl3_core.bench.models import build_model, parse_shape

PAGE = 16


def _model(device: str = "cpu", dtype: torch.dtype = torch.float32):
    return build_model(parse_shape("custom(128,256,3,4,2,300)"), device=device, dtype=dtype, seed=5,
                       cache_tokens=8 * PAGE, page_size=PAGE)


def _rows_seen(model) -> list[list[int]]:
    """Per block, the row counts its MLP was called with (a forward hook each)."""
    seen: list[list[int]] = [[] for _ in model.layers]
    for i, block in enumerate(model.layers):
        block.mlp.register_forward_hook(lambda m, a, o, i=i: seen[i].append(a[0].shape[0]))
    return seen


def _forward(model, cache, lens: list[int], pages: list[list[int]], idx: list[int] | None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    toks = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lens]
    table = torch.tensor(pages, dtype=torch.int32)
    li = None if idx is None else torch.tensor(idx, dtype=torch.int64, device=model.device)
    meta = BatchMeta.from_lists(toks, [0] * len(lens), device=model.device, page_table=table, page_size=PAGE,
                                logits_indices=li)
    return model.forward_batch(meta, cache)


def _kv(cache) -> list[torch.Tensor]:
    return [t.clone() for layer in cache.layers for t in layer.attn_tensors() if t is not None]


def test_last_block_keeps_only_the_asked_rows() -> None:
    model, cache = _model()
    seen = _rows_seen(model)
    lens = [37, 21]
    pages = [cache.allocator.allocate(3), cache.allocator.allocate(3)]
    full = _forward(model, cache, lens, pages, None)
    kv_full = _kv(cache)
    assert [s[-1] for s in seen] == [58, 58, 58]
    last = [36, 57]
    pruned = _forward(model, cache, lens, pages, last)
    assert [s[-1] for s in seen] == [58, 58, 2], "the last block's MLP ran on the two asked rows only"
    assert pruned.shape == (2, 300)
    torch.testing.assert_close(pruned, full[last], rtol=1e-5, atol=1e-5)
    for a, b in zip(kv_full, _kv(cache)):  # every row's keys and values, the last layer's too
        assert torch.equal(a, b)


def test_no_asked_row_keeps_one_and_returns_none() -> None:
    """A prompt's middle chunk wants no logits: the last block runs on one row, none comes back."""
    model, cache = _model()
    seen = _rows_seen(model)
    pages = [cache.allocator.allocate(2)]
    out = _forward(model, cache, [20], pages, [])
    assert out.shape == (0, 300)
    assert [s[-1] for s in seen] == [20, 20, 1]


def test_every_row_asked_runs_the_plain_forward() -> None:
    model, cache = _model()
    seen = _rows_seen(model)
    pages = [cache.allocator.allocate(1)]
    a = _forward(model, cache, [5], pages, [0, 1, 2, 3, 4])
    b = _forward(model, cache, [5], pages, None)
    assert [s[-1] for s in seen] == [5, 5, 5]
    assert torch.equal(a, b)


def test_a_replaced_block_forward_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block class that overrides forward may not take ``rows``: the stack then runs as before and
    the rows are picked after it."""
    model, cache = _model()

    class Plain(DecoderBlock):
        def forward(self, x, state):  # type: ignore[override]
            x = x + self.attn(self.attn_norm(x), state)
            return x + self.mlp(self.mlp_norm(x))

    model.layers[-1].__class__ = Plain
    seen = _rows_seen(model)
    pages = [cache.allocator.allocate(2)]
    out = _forward(model, cache, [19], pages, [18])
    assert out.shape == (1, 300) and seen[-1][-1] == 19


def test_attend_rows_falls_back_for_modules_without_rows() -> None:
    class NoRows(torch.nn.Module):
        def forward(self, x, state):
            return x * 2

    x = torch.arange(12.0).view(6, 2)
    rows = torch.tensor([4, 1])
    assert torch.equal(attend_rows(NoRows(), x, None, rows), (x * 2)[rows])  # type: ignore[arg-type]
