"""Which adapters each row of a step uses, in device buffers a CUDA graph can capture.

A step's choice is a list of *active* adapter slots (the distinct adapters any row names) and a
weight per (row, active slot). They live in one device byte buffer, so a step's whole choice travels
in one host-to-device copy that the step's kernels read from fixed addresses:

    n_active int32 [1] (padded to 16 bytes) | slots int64 [U] | coef fp32 [R, U]

``U`` is the slot capacity of the adapter set; entries past ``n_active`` hold the sentinel slot ``U``,
which no linear has. Rows past the ones a step filled have zero weights (no adapter). On CUDA the
host side is staged in a ring of pinned buffers and copied asynchronously on the current stream, so
filling the next step's choice never waits for the device; a choice equal to the previous one is not
copied again.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

#: a group of consecutive rows that use the same adapters: (slot -> weight, row count)
RowGroup = tuple[Mapping[int, float], int]

_HEAD = 16  # bytes of the n_active field (kept 16-byte aligned like every other field)
_RING = 4  # pinned staging buffers in flight


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class Selection:
    """Per-row adapter weights for the steps of one model (see the module docstring).

    :param device: where the model runs.
    :param slots: the adapter set's slot capacity ``U``.
    :param rows: rows to hold at first (grows by powers of two; growing makes new buffers, which
        ``version`` counts, so captured graphs know to be captured again).
    """

    def __init__(self, device: torch.device, slots: int, rows: int = 256) -> None:
        self.device = device
        self.capacity = slots
        self.version = 0
        #: host-known count of active slots of the current choice (the torch path's loop bound)
        self.n_active = 0
        #: rows the current choice covers
        self.rows = 0
        self._high = 0  # rows with nonzero weights in the device buffer, at most
        self._last: tuple[tuple[tuple[tuple[int, float], ...], int], ...] | None = ()
        self._allocate(max(rows, 1))

    # -- buffers --------------------------------------------------------------------------------
    def _nbytes(self, rows: int) -> int:
        return _HEAD + 8 * self.capacity + 4 * rows * self.capacity

    def _views(self, buf: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        U = self.capacity
        n = buf[:_HEAD].view(torch.int32)[:1]
        slots = buf[_HEAD:_HEAD + 8 * U].view(torch.int64)
        coef = buf[_HEAD + 8 * U:_HEAD + 8 * U + 4 * rows * U].view(torch.float32).view(rows, U)
        return n, slots, coef

    def _allocate(self, rows: int) -> None:
        self.row_capacity = rows
        self.buf = torch.zeros(self._nbytes(rows), dtype=torch.uint8, device=self.device)
        self.active, self.slots, self.coef = self._views(self.buf, rows)
        self.slots.fill_(self.capacity)
        cuda = self.device.type == "cuda"
        self._ring = [(torch.zeros(self._nbytes(rows), dtype=torch.uint8, pin_memory=cuda),
                       torch.cuda.Event() if cuda else None) for _ in range(_RING if cuda else 1)]
        self._turn = 0
        self._high = 0
        self._last = ()
        self.n_active = self.rows = 0
        self.version += 1

    def reserve(self, rows: int) -> None:
        """Hold at least ``rows`` rows (new, zeroed buffers when that grows them; the choice is cleared)."""
        if rows > self.row_capacity:
            self._allocate(_pow2(rows))

    # -- choosing -------------------------------------------------------------------------------
    def fill(self, groups: Sequence[RowGroup]) -> None:
        """Set the choice of the next forward: ``groups`` in row order (rows past them use no adapter).

        :raises ValueError: for a slot outside the capacity.
        """
        sig = tuple((tuple(sorted(g.items())), n) for g, n in groups)
        if sig == self._last:
            return
        rows = sum(n for _, n in groups)
        self.reserve(rows)
        order: dict[int, int] = {}
        for g, _ in groups:
            for s, w in g.items():
                if not 0 <= s < self.capacity:
                    raise ValueError(f"adapter slot {s} outside the selection's capacity {self.capacity}")
                if w != 0.0:
                    order.setdefault(s, len(order))
        upto = max(rows, self._high)  # rows a previous choice may have left weights in are zeroed too
        host, event = self._ring[self._turn]
        self._turn = (self._turn + 1) % len(self._ring)
        if event is not None:
            event.synchronize()  # this staging buffer's previous copy has read it
        n, slots, coef = self._views(host, self.row_capacity)
        n[0] = len(order)
        slots.fill_(self.capacity)
        if order:
            slots[:len(order)] = torch.tensor(list(order), dtype=torch.int64)
        c = coef.numpy()
        c[:upto] = 0.0
        r = 0
        for g, count in groups:
            for s, w in g.items():
                if s in order:
                    c[r:r + count, order[s]] = w
            r += count
        nbytes = _HEAD + 8 * self.capacity + 4 * upto * self.capacity
        if event is not None:
            self.buf[:nbytes].copy_(host[:nbytes], non_blocking=True)
            event.record()
        else:
            self.buf[:nbytes].copy_(host[:nbytes])
        self.n_active, self.rows, self._high = len(order), rows, rows if order else 0
        self._last = sig

    def clear(self) -> None:
        """No adapter on any row."""
        self.fill([])

    def ensure(self, n: int, capturing: bool) -> None:
        """Hold at least ``n`` rows.

        :raises RuntimeError: while a graph is captured, for more rows than the buffers hold (they cannot grow
            then; the generator reserves its largest step before capturing).
        """
        if n > self.row_capacity:
            if capturing:
                raise RuntimeError(f"LoRA selection holds {self.row_capacity} rows but a captured step has {n}; "
                                   f"reserve the largest step first (Selection.reserve)")
            self.reserve(n)

    def coef_rows(self, n: int, rows: torch.Tensor | None, capturing: bool) -> torch.Tensor:
        """``coef`` for a linear input of ``n`` rows that are the step's rows ``rows`` (None: ``0..n-1``)."""
        if rows is not None:
            return self.coef.index_select(0, rows)
        self.ensure(n, capturing)
        return self.coef[:n]

    def describe(self) -> Mapping[str, int]:
        return {"slots": self.capacity, "rows": self.row_capacity, "active": self.n_active}

