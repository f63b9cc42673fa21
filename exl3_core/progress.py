"""A tiny, dependency-free progress reporter.

:class:`Progress` draws a one-line bar on stderr when stderr is a TTY and
``settings.get().no_progress`` is false, and stays silent otherwise (logs, pipes, CI). A user
callback ``callback(done, total, what)`` replaces the bar entirely: an application with its own UI
gets the numbers and exl3 draws nothing.

Usage::

    with Progress(total_bytes, "loading", unit="B") as bar:
        for t in tensors:
            ...
            bar.advance(t.nbytes, what=name)

A :class:`Progress` is itself a ``(done, total, what)`` callable, so it can be handed to any API
that takes a progress callback.
"""
from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

ProgressCallback = Callable[[int, int, str], None]

# Redraw at most this often: a bar that repaints per tensor costs more than the load on fast disks.
_MIN_REDRAW_S = 0.1


def _fmt(n: float, unit: str) -> str:
    if unit != "B":
        return f"{int(n)}{unit}"
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or suffix == "TiB":
            return f"{n:.0f} {suffix}" if suffix == "B" else f"{n:.1f} {suffix}"
        n /= 1024
    raise AssertionError("unreachable")


def _bar_enabled(stream: TextIO) -> bool:
    # Imported lazily so this module stays importable (and cheap) on its own.
    from exl3_core import settings

    if settings.get().no_progress:
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # closed stream
        return False


class Progress:
    """Progress over ``total`` units (bytes when ``unit="B"``).

    :param total: amount of work; 0 is allowed (the bar then shows 100% at once).
    :param what: label shown before the bar; :meth:`advance` may replace it per step.
    :param callback: if given, called as ``callback(done, total, what)`` on every update and no bar
        is drawn.
    :param unit: ``"B"`` formats amounts as KiB/MiB/GiB; anything else is appended to integers.
    :param stream: where the bar goes (default ``sys.stderr``).
    :param enabled: force the bar on/off; ``None`` decides from TTY-ness and settings.
    """

    def __init__(
        self,
        total: int,
        what: str = "",
        *,
        callback: ProgressCallback | None = None,
        unit: str = "",
        stream: TextIO | None = None,
        enabled: bool | None = None,
    ) -> None:
        self.total = max(int(total), 0)
        self.done = 0
        self.what = what
        self.unit = unit
        self._callback = callback
        self._stream = stream if stream is not None else sys.stderr
        self._draw = False if callback is not None else (
            _bar_enabled(self._stream) if enabled is None else enabled
        )
        self._last_draw = 0.0
        self._drawn = False
        self._closed = False
        self._t0 = time.monotonic()

    # -- reporting --------------------------------------------------------------------------------

    def advance(self, n: int = 1, what: str | None = None) -> None:
        """Add ``n`` to the amount done."""
        self.update(self.done + int(n), what)

    def update(self, done: int, what: str | None = None) -> None:
        """Set the amount done (clamped to ``total`` when ``total`` is known)."""
        self.done = min(int(done), self.total) if self.total else int(done)
        if what is not None:
            self.what = what
        if self._callback is not None:
            self._callback(self.done, self.total, self.what)
        elif self._draw:
            now = time.monotonic()
            if now - self._last_draw >= _MIN_REDRAW_S or self.done >= self.total:
                self._last_draw = now
                self._render()

    def __call__(self, done: int, total: int, what: str) -> None:
        """Callback form: lets a :class:`Progress` stand in for a user ``(done, total, what)`` callable."""
        self.total = max(int(total), 0)
        self.update(done, what)

    def _render(self) -> None:
        width = shutil.get_terminal_size((80, 24)).columns
        frac = 1.0 if self.total == 0 else self.done / self.total
        amounts = f"{_fmt(self.done, self.unit)}/{_fmt(self.total, self.unit)}"
        elapsed = time.monotonic() - self._t0
        rate = f" {_fmt(self.done / elapsed, self.unit)}/s" if self.unit == "B" and elapsed > 0.5 else ""
        tail = f" {frac * 100:3.0f}% {amounts}{rate}"
        label = self.what[: max(width // 3, 0)]
        bar_w = max(width - len(label) - len(tail) - 4, 5)
        filled = int(bar_w * frac)
        line = f"{label} [{'#' * filled}{'.' * (bar_w - filled)}]{tail}"
        try:
            # \r + clear-to-end keeps one line however long the previous label was.
            self._stream.write("\r" + line[: width - 1] + "\x1b[K")
            self._stream.flush()
            self._drawn = True
        except (OSError, ValueError):
            self._draw = False  # stream went away: stop drawing rather than break the caller

    # -- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish the bar line (idempotent). Nothing is printed if nothing was drawn."""
        if self._closed:
            return
        self._closed = True
        if self._draw and self._drawn:
            self._render()
            try:
                self._stream.write("\n")
                self._stream.flush()
            except (OSError, ValueError):
                pass

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
