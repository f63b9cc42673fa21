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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
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


class PendingInput:
    """An adapter input that no kernel has formed yet, described so that an adapter's own kernel can form it
    where it reads it (no launch of its own); :meth:`formed` computes it as the plain modules do, once."""

    def __init__(self, form: Callable[[], torch.Tensor]) -> None:
        self._form = form
        self._x: torch.Tensor | None = None

    def formed(self) -> torch.Tensor:
        if self._x is None:
            self._x = self._form()
        return self._x


class NormedInput(PendingInput):
    """``rms_norm(h)``: ``h [..., d]``, ``ss`` fp32 ``[>= rows]`` the sums of squares of ``h``'s rows, the norm's
    ``weight`` (fp32 ``[d]``, or None), ``eps`` and ``offset`` (the scale is ``weight + offset``)."""

    def __init__(self, h: torch.Tensor, ss: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
                 form: Callable[[], torch.Tensor]) -> None:
        super().__init__(form)
        self.h, self.ss, self.weight, self.eps, self.offset = h, ss, weight, eps, offset


def norm_formable(h: torch.Tensor, ss: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether a kernel can form ``rms_norm(h)`` from these as it reads ``h``: ``ss`` fp32, one unit-strided entry
    per row of ``h`` (or more), ``weight`` None or fp32 ``[d]``, all on ``h``'s device."""
    d = h.shape[-1]
    return (ss.dtype == torch.float32 and ss.dim() == 1 and ss.stride(0) == 1 and ss.device == h.device
            and ss.shape[0] >= h.numel() // max(d, 1)
            and (weight is None or (weight.dtype == torch.float32 and weight.shape == (d,) and weight.device == h.device)))


class GatedInput(PendingInput):
    """``act(gate) * up`` (a gated MLP's down-projection input), ``act`` a name of
    :data:`exl3_core.kernels.codes.ACT_CODES`."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, act: str, form: Callable[[], torch.Tensor]) -> None:
        super().__init__(form)
        self.gate, self.up, self.act = gate, up, act


#: what an adapter reads: a tensor, or one no kernel has formed yet
AdapterInput = torch.Tensor | PendingInput


def formed(x: AdapterInput) -> torch.Tensor:
    """``x`` as a tensor (formed now where it was pending)."""
    return x if isinstance(x, torch.Tensor) else x.formed()


#: adds a group's deltas to the linears' outputs after their launch: ``finish(ys, outs) -> outs`` with ``outs[i] =
#: ys[i] + delta_i`` (``outs[i]`` may be ``ys[i]``: in place)
Finish = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], list[torch.Tensor]]
#: adds one linear's delta into the residual stream its launch has already added to: ``finish_ss(h, ss) -> h``, ``h``
#: in place, and the change of each row's sum of squares into ``ss`` (fp32, one per row), which a deferred norm after
#: it reads
FinishSS = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PendingDeltas:
    """A group's deltas whose input part is launched: ``finish`` adds them to the outputs once the linears'
    launch has made them; ``finish_ss``, where given, does so for one linear whose launch added its output to the
    residual stream (see :func:`finish_residual`)."""

    finish: Finish
    finish_ss: FinishSS | None = None


def finish_residual(pending: PendingDeltas, h: torch.Tensor, ss: torch.Tensor) -> torch.Tensor:
    """``h`` (a residual stream that one linear's launch has added its output to, ``ss`` its rows' fp32 sums of
    squares) with that linear's deltas added, and ``ss`` moved by as much: in one kernel where the adapter offers it,
    else the deltas as ``finish`` adds them and the sums' change in torch."""
    if pending.finish_ss is not None:
        return pending.finish_ss(h, ss)
    new = pending.finish([h], [torch.empty_like(h)])[0]
    rows = new.numel() // new.shape[-1]
    ss[:rows] += (new.float().pow(2) - h.float().pow(2)).reshape(rows, -1).sum(-1)
    return new


@runtime_checkable
class FusedAdapter(LinearAdapter, Protocol):
    """An adapter that adds its delta into an output itself (one kernel instead of delta, cast and add)."""

    def add_delta(self, y: torch.Tensor, x: AdapterInput, out: torch.Tensor) -> torch.Tensor:
        """``out = y + delta(x)`` summed in fp32 and rounded once to ``out``'s dtype, as :func:`adapted`
        does; ``out`` may be ``y`` (in place). Returns ``out``."""
        ...


@runtime_checkable
class GroupAdapter(FusedAdapter, Protocol):
    """An adapter that computes its delta together with those of adapters on other linears reading the same input
    (q/k/v, gate/up) in fewer launches than one by one, starting on the input apart from adding to the outputs."""

    def begin_group(self, members: Sequence[LinearAdapter], x: AdapterInput) -> PendingDeltas | None:
        """Launch what reads only ``x`` for ``members`` (one per linear reading ``x``, this adapter among them)
        now, and say how their deltas join the linears' outputs once those exist. None, with nothing done,
        where it cannot."""
        ...


def begin_adapters(x: AdapterInput, layers: Sequence[torch.nn.Module]) -> PendingDeltas:
    """Start the adapters of linears reading ``x``: a :class:`GroupAdapter` on each linear launches its input's part
    now (the caller picks whether before or after the linears' own launch); the deltas join at ``finish``."""
    ads: list[tuple[LinearAdapter, ...]] = [getattr(m, "adapters", ()) for m in layers]
    if all(len(a) == 1 for a in ads) and isinstance(ads[0][0], GroupAdapter):
        pending = ads[0][0].begin_group([a[0] for a in ads], x)
        if pending is not None:
            return pending

    def one_by_one(ys: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        done = [adapted(y, x, a, owned=o is y) for y, o, a in zip(ys, outs, ads)]
        return [o if d is o else o.copy_(d) for d, o in zip(done, outs)]

    return PendingDeltas(one_by_one)


def adapted(y: torch.Tensor, x: AdapterInput, adapters: tuple[LinearAdapter, ...], *,
            owned: bool = False) -> torch.Tensor:
    """``y`` plus every adapter's delta of ``x`` (``y`` itself when there are none), in ``y``'s dtype.
    ``owned``: nothing else reads ``y``, so a :class:`FusedAdapter` may add into it in place."""
    if not adapters:
        return y
    if len(adapters) == 1 and isinstance(adapters[0], FusedAdapter):
        return adapters[0].add_delta(y, x, y if owned else torch.empty_like(y))
    acc = y.float()
    for a in adapters:
        acc = acc + a.delta(formed(x)).float()
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
