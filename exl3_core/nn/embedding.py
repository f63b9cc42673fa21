"""Token embedding (always unquantized in EXL3 checkpoints, format spec 1.6)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from exl3_core.nn.module import LoadContext, Module


class Embedding(Module):
    """``weight[input_ids] * scale``.

    :param key: checkpoint key; the table is ``{key}.weight [vocab_size, hidden_size]``.
    :param scale: multiplier applied to the looked-up rows (some families scale by sqrt(hidden)).
    """

    weight: torch.Tensor | None

    def __init__(self, key: str, vocab_size: int, hidden_size: int, *, scale: float | None = None) -> None:
        super().__init__()
        self.key = key
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.scale = scale
        self.register_buffer("weight", None, persistent=False)

    def load_weights(self, ctx: LoadContext) -> None:
        self.weight = ctx.tensor(f"{self.key}.weight", shape=(self.vocab_size, self.hidden_size), dtype=ctx.dtype,
                                 what="embedding table")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None, f"{self.key}: model is not loaded"
        x = F.embedding(input_ids, self.weight)
        if self.scale is not None:
            x = x * self.scale  # a Python scalar: no tensor creation, graph-capturable
        return x

    def extra_repr(self) -> str:
        return f"{self.key}: {self.vocab_size} x {self.hidden_size}"
