"""Linear adapters: side computations whose outputs are added to a linear's (LoRA is one).

A linear computes ``y = x W + b + sum(a.delta(x) for a in linear.adapters)``. The adapters ride on
the linear itself, so every path that runs the linear (the reference forward and the execution
plan's fused kernels) sees them; the plan adds their deltas around the fused kernel (into its
output, or into the residual it adds), and declines only the fusions an adapter's delta cannot
join (a q/k/v epilogue that rotates and stores keys inside the projection kernel), saying so.

``delta`` must be graph-capturable: no host syncs; per-step choices (which rows use which weights)
live in device buffers the adapter owns.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class LinearAdapter(Protocol):
    """A side computation added to one linear's output."""

    #: unique per linear (attaching a second adapter of the same name is an error)
    name: str

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The addend for input ``x [..., in_features]``: ``[..., out_features]``, any float dtype
        (the linear casts the sum to its output dtype)."""
        ...


def adapted(y: torch.Tensor, x: torch.Tensor, adapters: tuple[LinearAdapter, ...]) -> torch.Tensor:
    """``y`` plus every adapter's delta of ``x`` (``y`` itself when there are none), in ``y``'s dtype."""
    if not adapters:
        return y
    acc = y.float()
    for a in adapters:
        acc = acc + a.delta(x).float()
    return acc.to(y.dtype)


def attach_adapter(linear: torch.nn.Module, adapter: LinearAdapter) -> None:
    """Add ``adapter`` to ``linear`` (a :class:`~exl3_core.nn.linear.LinearBase`).

    :raises ValueError: when the linear already carries an adapter of that name.
    """
    current: tuple[LinearAdapter, ...] = getattr(linear, "adapters", ())
    if any(a.name == adapter.name for a in current):
        raise ValueError(f"{getattr(linear, 'key', type(linear).__name__)} already has an adapter named "
                         f"{adapter.name!r}; detach it first")
    linear.adapters = (*current, adapter)  # type: ignore[assignment]


def detach_adapter(linear: torch.nn.Module, name: str) -> LinearAdapter:
    """Remove and return the adapter ``name`` of ``linear``.

    :raises KeyError: naming the adapters the linear does carry.
    """
    current: tuple[LinearAdapter, ...] = getattr(linear, "adapters", ())
    keep = tuple(a for a in current if a.name != name)
    if len(keep) == len(current):
        raise KeyError(f"{getattr(linear, 'key', type(linear).__name__)} has no adapter {name!r} "
                       f"(it has: {', '.join(a.name for a in current) or 'none'})")
    linear.adapters = keep  # type: ignore[assignment]
    return next(a for a in current if a.name == name)
