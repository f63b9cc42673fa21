"""Where weights come from, and the error a missing or misshapen checkpoint tensor raises."""
from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Protocol

import torch


class WeightError(ValueError):
    """A checkpoint tensor is missing, misshapen or of the wrong kind; the message names it."""


class TensorSource(Protocol):
    """Where weights come from (``exl3_core.loader.SafetensorsCollection`` implements it). Modules read
    through :func:`fetch`, so a source may return views."""

    directory: Path

    def __contains__(self, name: object) -> bool: ...

    def keys(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get_tensor(self, name: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                   expect_shape: Collection[int | None] | None = None) -> torch.Tensor: ...


def fetch(source: TensorSource, name: str, device: str | torch.device, dtype: torch.dtype | None = None,
          expect_shape: Collection[int | None] | None = None) -> torch.Tensor:
    """``source.get_tensor(...)`` laid out row-major: kernels read weights in place assuming it, so a strided
    view (a transposed table, say) is made contiguous once here rather than copied on every call."""
    t = source.get_tensor(name, device=device, dtype=dtype, expect_shape=expect_shape)
    return t if t.is_contiguous() else t.contiguous()
