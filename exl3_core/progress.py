"""Progress bars for exl3's long steps (model load, GGUF import, conversion, evaluation, benchmarks).

The bars are tqdm's; this module only adapts them to exl3's conventions:

* a bar is drawn on stderr only when stderr is a terminal and ``EXL3_NO_PROGRESS`` is not set;
* a user callback ``callback(done, total, what)`` replaces the bar (an application with its own UI
  gets the numbers and exl3 draws nothing), and a :class:`Progress` is itself such a callable;
* lines printed while a bar is up go through :func:`write` (or the logging handler
  :class:`AboveBars`), which prints them above the bar instead of into it.

tqdm rather than rich: it is already installed with exl3's own dependencies (gguf, transformers),
it redraws only from the thread that reports progress (rich's live display runs a refresh thread
that competes with the work on small CPU machines), and ``tqdm.write`` keeps log lines off the bar.

Usage::

    with Progress(total_bytes, "loading", unit="B") as bar:
        for t in tensors:
            ...
            bar.advance(t.nbytes, what=name)
"""
from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from tqdm import tqdm

ProgressCallback = Callable[[int, int, str], None]

# Redraw at most this often: a bar that repaints per tensor costs more than the load on fast disks.
_MIN_REDRAW_S = 0.1


def bars_enabled(stream: TextIO | None = None) -> bool:
    """True when a bar would be drawn on ``stream`` (default stderr): a terminal, and not silenced
    by ``EXL3_NO_PROGRESS``."""
    from exl3_core import settings  # lazily: this module stays cheap to import

    if settings.get().no_progress:
        return False
    s = stream if stream is not None else sys.stderr
    isatty = getattr(s, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # closed stream
        return False


def write(line: str, stream: TextIO | None = None) -> None:
    """Print ``line`` to ``stream`` (default stderr) above any bar that is up, not into it."""
    tqdm.write(line, file=stream if stream is not None else sys.stderr)


class AboveBars(logging.StreamHandler):  # type: ignore[type-arg]
    """A logging handler whose records are printed with :func:`write`, above any active bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            write(self.format(record), self.stream)
        except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
            self.handleError(record)


class Progress:
    """Progress over ``total`` units (bytes when ``unit="B"``).

    :param total: amount of work; 0 is allowed.
    :param what: the bar's title; :meth:`advance`, :meth:`update` and :meth:`step` show their
        ``what`` (the current item or sub-step) after the counts.
    :param callback: if given, called as ``callback(done, total, what)`` on every update and no bar
        is drawn.
    :param unit: ``"B"`` shows amounts in KiB/MiB/GiB; anything else names the counted things.
    :param stream: where the bar goes (default ``sys.stderr``).
    :param enabled: force the bar on/off; ``None`` decides from :func:`bars_enabled`.
    :param heartbeat_s: redraw the bar this often even when nothing is reported, so that its elapsed
        time keeps moving through a step that takes minutes (one quantized tensor on a CPU); None: no.
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
        heartbeat_s: float | None = None,
    ) -> None:
        self.total = max(int(total), 0)
        self.done = 0
        self.what = ""
        self._callback = callback
        self._stream = stream
        draw = False if callback is not None else (bars_enabled(stream) if enabled is None else enabled)
        self._bar: tqdm | None = None  # type: ignore[type-arg]
        if draw:
            self._bar = tqdm(total=self.total, desc=what or None, unit=unit.strip() or "it",
                             unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
                             file=stream if stream is not None else sys.stderr, dynamic_ncols=True,
                             mininterval=_MIN_REDRAW_S, leave=True)
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if self._bar is not None and heartbeat_s is not None:
            self._ticker = threading.Thread(target=self._tick, args=(heartbeat_s,), daemon=True,
                                            name="exl3-progress")
            self._ticker.start()

    def _tick(self, period: float) -> None:
        while not self._stop.wait(period):
            bar = self._bar
            if bar is not None:
                bar.refresh()

    def advance(self, n: int = 1, what: str | None = None) -> None:
        """Add ``n`` to the amount done."""
        self.update(self.done + int(n), what)

    def update(self, done: int, what: str | None = None) -> None:
        """Set the amount done (clamped to ``total`` when ``total`` is known)."""
        done = min(int(done), self.total) if self.total else int(done)
        step, self.done = done - self.done, done
        if what is not None:
            self.what = what
        if self._callback is not None:
            self._callback(self.done, self.total, self.what)
        elif self._bar is not None:
            if what is not None:
                self._bar.set_postfix_str(what, refresh=False)
            self._bar.update(step)

    def step(self, what: str) -> None:
        """Show what is being done now without counting anything (a sub-step of a long unit)."""
        self.what = what
        if self._callback is not None:
            self._callback(self.done, self.total, what)
        elif self._bar is not None:
            self._bar.set_postfix_str(what)  # redraws now: elapsed time and the sub-step move

    def write(self, line: str) -> None:
        """Print ``line`` above this bar (stderr when no bar is drawn)."""
        write(line, self._stream)

    def __call__(self, done: int, total: int, what: str) -> None:
        """Callback form: lets a :class:`Progress` stand in for a user ``(done, total, what)`` callable."""
        total = max(int(total), 0)
        if total != self.total:
            self.total = total
            if self._bar is not None:
                self._bar.total = total
        self.update(done, what)

    def close(self) -> None:
        """Finish the bar (idempotent)."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
