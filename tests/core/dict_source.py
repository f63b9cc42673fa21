"""In-memory TensorSource for tests that build modules from random tensors (no files)."""
from __future__ import annotations

from pathlib import Path

import torch


class DictSource:
    """The TensorSource interface the loaders use, over a plain ``{name: tensor}`` dict."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.directory = Path("<memory>")

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def get_tensor(self, name: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                   expect_shape: object = None) -> torch.Tensor:
        t = self.tensors[name].to(device)
        return t.to(dtype) if dtype is not None else t.clone()
