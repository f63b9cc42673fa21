"""Integer bitrate per tensor for a fractional average budget (format spec 5.7).

Every budgeted tensor starts at ``floor(bpw)`` bits. Groups of tensors that share an input (and so
should share a bitrate) are ordered by priority (higher first), then by the distance of their
layer to the nearer end of the stack, then by layer index, then by first appearance. The order is
swept repeatedly, giving +1 bit (up to 8) to every group whose cost still fits the budget
``floor(bpw·Σnumel)`` bits, until a sweep changes nothing. Fixed-bit tensors (the output head,
extra prediction layers) sit outside the budget. Nothing here knows about model families.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

MAX_BITS = 8
UNQUANTIZED_BITS = 16  # a fixed entry of 16 means "store in fp16"


@dataclass(frozen=True)
class AllocItem:
    """One quantizable tensor: its key, weight count, group, group priority and layer index.

    ``layer`` None (a tensor outside the layer stack) counts as distance 0 and sorts before layer 0.
    """

    key: str
    numel: int
    group: str
    priority: int = 0
    layer: int | None = None


def _as_item(x: AllocItem | Sequence) -> AllocItem:
    return x if isinstance(x, AllocItem) else AllocItem(*x)


def _check_fixed(key: str, bits: int) -> int:
    if (
        isinstance(bits, bool)
        or not isinstance(bits, int)
        or not (1 <= bits <= MAX_BITS or bits == UNQUANTIZED_BITS)
    ):
        raise ValueError(
            f"allocation: fixed bits {bits!r} for {key!r} must be an integer in 1..{MAX_BITS} or 16"
        )
    return bits


def allocate_bits(
    items: Iterable[AllocItem | Sequence],
    bpw: float,
    *,
    head_keys: Iterable[str] = (),
    head_bits: int = 6,
    fixed: Mapping[str, int] | None = None,
    num_layers: int | None = None,
    max_bits: int = MAX_BITS,
) -> dict[str, int]:
    """Map every tensor key to its integer K.

    ``items`` are :class:`AllocItem` or tuples ``(key, numel, group, priority, layer)``. Keys in
    ``head_keys`` get ``head_bits`` and keys in ``fixed`` their given bits; both are outside the
    budget (16 = unquantized). ``num_layers`` defaults to the largest layer index + 1. Deterministic.
    """
    items = [_as_item(x) for x in items]
    if not isinstance(bpw, (int, float)) or isinstance(bpw, bool) or not math.isfinite(bpw):
        raise ValueError(f"allocation: bpw={bpw!r} must be a finite number")
    if not 1 <= max_bits <= MAX_BITS:
        raise ValueError(f"allocation: max_bits={max_bits} must be in 1..{MAX_BITS}")
    if not 1.0 <= bpw <= max_bits:
        raise ValueError(
            f"allocation: bpw={bpw} is out of range; EXL3 bitrates are 1..{max_bits} bits per weight"
        )
    out: dict[str, int] = {}
    for key in head_keys:
        out[key] = _check_fixed(key, head_bits)
    for key, bits in (fixed or {}).items():
        out[key] = _check_fixed(key, bits)

    seen: set[str] = set()
    groups: dict[str, list[AllocItem]] = {}
    for it in items:
        if it.key in seen:
            raise ValueError(f"allocation: tensor {it.key!r} is listed twice")
        seen.add(it.key)
        if it.numel <= 0:
            raise ValueError(f"allocation: tensor {it.key!r} has numel {it.numel}; it must be positive")
        if it.key not in out:
            groups.setdefault(it.group, []).append(it)
    for name, members in groups.items():
        if len({(m.priority, m.layer) for m in members}) > 1:
            raise ValueError(
                f"allocation: group {name!r} mixes priorities/layers {sorted({(m.priority, m.layer) for m in members}, key=str)}; "
                f"all tensors of a group must share both"
            )

    layers = [m.layer for ms in groups.values() for m in ms if m.layer is not None]
    n_layers = num_layers if num_layers is not None else (max(layers) + 1 if layers else 0)

    def order_key(entry: tuple[int, str]) -> tuple:
        pos, name = entry
        head = groups[name][0]
        idx = -1 if head.layer is None else head.layer
        dist = 0 if head.layer is None else min(head.layer, max(0, n_layers - 1 - head.layer))
        return (-head.priority, dist, idx, pos)

    order = [name for _, name in sorted(enumerate(groups), key=order_key)]
    cost = {name: sum(m.numel for m in groups[name]) for name in order}
    total = sum(cost.values())
    base = math.floor(bpw)
    bits = dict.fromkeys(order, base)
    remaining = math.floor(bpw * total) - base * total
    changed = True
    while changed:
        changed = False
        for name in order:
            if bits[name] < max_bits and cost[name] <= remaining:
                bits[name] += 1
                remaining -= cost[name]
                changed = True
    for name in order:
        for m in groups[name]:
            out[m.key] = bits[name]
    return out


def average_bits(alloc: Mapping[str, int], items: Iterable[AllocItem | Sequence]) -> float:
    """Numel-weighted mean K over ``items`` (the budgeted tensors): the config's ``bits`` value."""
    items = [_as_item(x) for x in items]
    total = sum(it.numel for it in items)
    if total == 0:
        return 0.0
    return sum(alloc[it.key] * it.numel for it in items) / total
