"""The built-in corpus split and the default calibration size."""
from __future__ import annotations

import itertools

import pytest
import torch

from exl3_core.convert import calibration as cal


def test_split_is_disjoint_and_covers_the_corpus() -> None:
    c, e, a = cal.documents("calibration"), cal.documents("eval"), cal.documents("all")
    assert {d.id for d in c}.isdisjoint({d.id for d in e})
    assert len(c) + len(e) == len(a) == len(cal.corpus())
    # no unit (a document, or every translation of one chapter) is on both sides
    assert {d.unit for d in c}.isdisjoint({d.unit for d in e})
    for coll in {d.collection for d in a}:
        units = sorted({d.unit for d in a if d.collection == coll})
        held = {d.unit for d in e if d.collection == coll}
        assert held == {u for i, u in enumerate(units) if i % cal.EVAL_EVERY == cal.EVAL_EVERY - 1}, coll
    assert {d.lang for d in c} >= {"en", "de", "fr", "es", "it", "ja", "zh-cn", "python"}


def test_builtin_text_and_collections() -> None:
    ref = cal.builtin_text("eval", ("python-reference",))
    assert ref and ref in cal.builtin_text("eval") and ref not in cal.builtin_text("calibration")
    with pytest.raises(ValueError, match="unknown text collection"):
        cal.documents("eval", ("no-such-collection",))


@pytest.mark.parametrize("widest", [1, 64, 480, 1536, 14336, 10**6])
def test_default_size_follows_the_widest_input(widest: int) -> None:
    rows, cols = cal.default_size(widest)
    tokens = rows * cols
    assert cols == cal.DEFAULT_COLS
    assert cal.MIN_TOKENS <= tokens < max(cal.MIN_TOKENS, min(cal.MAX_TOKENS, cal.TOKENS_PER_INPUT * widest)) + cols
    assert cal.default_size(widest, rows=7) == (7, cols) and cal.default_size(widest, cols=512)[1] == 512


@pytest.mark.parametrize("widest", [64, 1536, 14336])
def test_postpass_rows_are_an_even_subset_keeping_the_random_share(widest: int) -> None:
    rows, cols = cal.default_size(widest)
    n_text = rows - round(rows * cal.RANDOM_FRACTION)
    ids = torch.arange(rows)[:, None].expand(rows, cols)  # row i holds i: text rows first, then random ones
    sub = cal.postpass_rows(ids, widest)
    want = max(cal.POSTPASS_MIN_TOKENS, cal.POSTPASS_TOKENS_PER_INPUT * widest)
    picked = sub[:, 0].tolist()
    assert sub.shape[1] == cols and picked == sorted(set(picked))  # distinct rows, in order
    if want >= rows * cols:
        assert picked == list(range(rows))
    else:
        assert want <= sub.numel() < want + cols
        share = sum(i >= n_text for i in picked) / len(picked)
        assert abs(share - (rows - n_text) / rows) < 2 / len(picked) + 1e-9
        gaps = [b - a for a, b in itertools.pairwise(picked)]
        assert max(gaps) - min(gaps) <= 1  # evenly spread over the whole set
