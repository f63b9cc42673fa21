"""Linear adapters: side computations whose outputs are added to a linear's (LoRA is one).

A linear computes ``y = x W + b + sum(a.delta(x) for a in linear.adapters)``. The adapters ride on
the linear itself, so every path that runs the linear (the reference forward and the execution
plan's fused kernels) sees them; the plan adds their deltas around the fused kernel (into its
output, or into the residual it adds), and declines only the fusions an adapter's delta cannot
join (a q/k/v epilogue that rotates and stores keys inside the projection kernel), saying so.

``delta`` must be graph-capturable: no host syncs; per-step choices (which rows use which weights)
live in device buffers the adapter owns. Such per-row choices are indexed by the step's rows; code that
runs a linear on other rows than the step's (the last block on the rows wanting logits, experts on the
rows routed to them) says which ones with :func:`row_map`, and adapters read :func:`current_rows`.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
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


@runtime_checkable
class FusedAdapter(LinearAdapter, Protocol):
    """An adapter that adds its delta into an output itself (one kernel instead of delta, cast and add)."""

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = y + delta(x)`` summed in fp32 and rounded once to ``out``'s dtype, as :func:`adapted`
        does; ``out`` may be ``y`` (in place). Returns ``out``."""
        ...


@runtime_checkable
class GroupAdapter(FusedAdapter, Protocol):
    """An adapter that can add its delta together with those of adapters on other linears reading the same input
    (q/k/v, gate/up) in fewer launches than one by one."""

    def add_group(self, members: Sequence[LinearAdapter], ys: Sequence[torch.Tensor], x: torch.Tensor) -> bool:
        """Add the deltas of ``members`` (one per linear reading ``x``, this adapter among them) into ``ys`` (their
        outputs, owned) in place; False, with nothing done, where it cannot."""
        ...


def adapted_group(ys: list[torch.Tensor], x: torch.Tensor, layers: Sequence[torch.nn.Module]) -> list[torch.Tensor]:
    """``[adapted(y, x, layer.adapters, owned=True)]`` for linears reading the same ``x``, in one group call where
    each linear carries one :class:`GroupAdapter` that takes the group."""
    ads: list[tuple[LinearAdapter, ...]] = [getattr(m, "adapters", ()) for m in layers]
    if len(ys) > 1 and all(len(a) == 1 for a in ads):
        first = ads[0][0]
        if isinstance(first, GroupAdapter) and first.add_group([a[0] for a in ads], ys, x):
            return ys
    return [adapted(y, x, a, owned=True) for y, a in zip(ys, ads)]


def adapted(y: torch.Tensor, x: torch.Tensor, adapters: tuple[LinearAdapter, ...], *,
            owned: bool = False) -> torch.Tensor:
    """``y`` plus every adapter's delta of ``x`` (``y`` itself when there are none), in ``y``'s dtype.
    ``owned``: nothing else reads ``y``, so a :class:`FusedAdapter` may add into it in place."""
    if not adapters:
        return y
    if len(adapters) == 1 and isinstance(adapters[0], FusedAdapter):
        return adapters[0].add_delta(y, x, y if owned else torch.empty_like(y))
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


_rows = threading.local()


def current_rows() -> torch.Tensor | None:
    """The step rows (int64 ``[n]``, device) that the rows of a linear's input are now, or None when
    they are the step's rows themselves (see :func:`row_map`)."""
    return getattr(_rows, "map", None)


@contextmanager
def row_map(rows: torch.Tensor | None) -> Iterator[None]:
    """Linears run inside this block get inputs whose row ``i`` is the step's row ``rows[i]`` (nested
    maps compose; None changes nothing). Host-side bookkeeping only: graph-capturable."""
    if rows is None:
        yield
        return
    outer = current_rows()
    _rows.map = rows if outer is None else outer.index_select(0, rows)
    try:
        yield
    finally:
        _rows.map = outer
