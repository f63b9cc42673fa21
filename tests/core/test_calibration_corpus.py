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


@pytest.mark.parametrize("random_fraction", [cal.RANDOM_FRACTION, 1.0])
@pytest.mark.parametrize("adds_bos", [True, False])
def test_rows_begin_as_the_tokenizer_begins_an_input(tmp_path, adds_bos: bool, random_fraction: float) -> None:
    """Where the tokenizer prepends BOS to what it encodes, every calibration row (text and random) starts with
    BOS and is otherwise the plain row; where it does not, the rows are the plain ones."""
    import json
    import shutil
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "data" / "exl3-golden" / "hf" / "model_a"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, tmp_path / name)
    conf = json.loads((tmp_path / "tokenizer_config.json").read_text())
    conf["add_bos_token"] = adds_bos
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(conf))
    rows, cols, vocab = 14, 16, 1024
    text = cal.builtin_text("calibration")[:20000]  # the rows' first token is the point, not the corpus
    ids = cal.calibration_ids(tmp_path, vocab, rows, cols, seed=3, text=text, random_fraction=random_fraction)
    tok = cal.load_tokenizer(tmp_path)
    assert tok is not None and tok.bos_token_id == 1
    n_random = rows if random_fraction == 1.0 else round(rows * random_fraction)
    plain = cal.random_rows(n_random, cols, vocab, 3)
    if n_random < rows:
        plain = torch.cat([cal.text_windows(cal.tokenize_text(tok, text, vocab), rows - n_random, cols), plain])
    assert ids.shape == (rows, cols) and torch.equal(ids[:, 1:], plain[:, 1:])
    assert torch.equal(ids[:, 0], torch.full((rows,), 1) if adds_bos else plain[:, 0])
