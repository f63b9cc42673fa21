"""Filter.mask normalises bool masks and packed bitmasks alike, including short ones."""
from __future__ import annotations

import pytest
import torch

from exl3_core.filters import Filter


class _Fixed(Filter):
    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.m = mask

    def reset(self) -> None: ...

    def accept_token(self, token: int) -> None: ...

    def get_next_logit_mask(self) -> torch.Tensor | None:
        return self.m

    def is_completed(self) -> bool:
        return False


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    n = (allowed.numel() + 31) // 32
    bits = torch.zeros(n * 32, dtype=torch.int64)
    bits[: allowed.numel()] = allowed.long()
    words = (bits.view(n, 32) << torch.arange(32)).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("tok_vocab, model_vocab", [(70, 70), (70, 128), (64, 100)])
def test_bitmask_and_bool_agree_and_pad(tok_vocab: int, model_vocab: int) -> None:
    allowed = torch.rand(tok_vocab) < 0.4
    from_bits = _Fixed(_pack(allowed)).mask(model_vocab)
    from_bool = _Fixed(allowed).mask(model_vocab)
    assert from_bits.shape == (model_vocab,) and torch.equal(from_bits, from_bool)
    assert torch.equal(from_bits[:tok_vocab], allowed) and not from_bits[tok_vocab:].any()


def test_bad_mask_dtype_is_named() -> None:
    with pytest.raises(TypeError, match="_Fixed.get_next_logit_mask returned torch.float32"):
        _Fixed(torch.zeros(10)).mask(10)
