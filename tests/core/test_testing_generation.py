"""exl3_core.testing.generation.run_to_end: every job's tokens and, when asked, the logits each was taken from."""
from __future__ import annotations

import pytest

from exl3_core.cache import Cache
from exl3_core.generator import Generator
from exl3_core.generator.toy import ByteTokenizer, ToyModel
from exl3_core.testing.generation import run_to_end

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_run_to_end_returns_each_jobs_tokens_and_their_logits(plugins) -> None:
    model = ToyModel(vocab_size=264, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, seed=3)

    def gen() -> Generator:
        return Generator(model, Cache(model, 2048, page_size=16, plugins=plugins), ByteTokenizer(264), plugins=plugins,
                         max_batch_size=2)

    prompts = [[5, 6, 7, 8], [40, 41], [9] * 11]  # more jobs than the batch: one waits
    with_logits = run_to_end(gen(), prompts, 9, logits=True)
    without = run_to_end(gen(), prompts, 9)
    for (toks, lg), (toks2, none) in zip(with_logits, without):
        assert len(toks) == 9 and toks == toks2 and none is None
        assert lg is not None and lg.shape == (9, 264)
        assert lg.argmax(-1).tolist() == toks  # greedy jobs: each token is its row's argmax
