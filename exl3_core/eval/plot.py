"""Quality-vs-size plots: perplexity (and KL divergence) against bits per weight, as a PNG.

matplotlib draws the chart when it is installed; otherwise a small built-in rasteriser writes
the PNG itself (zlib + struct): axes, ticks, one polyline with markers per panel, labels in a
5x7 bitmap font. Neither is a dependency of the core.
"""
from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

STORED_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "bias", "mul1", "mcg")


@dataclass(frozen=True)
class Point:
    label: str
    bpw: float
    ppl: float
    kld: float | None = None


# -- the bpw of a checkpoint ----------------------------------------------------------------------
def model_bpw(directory: str | Path) -> float:
    """Stored bits per weight of the quantized layers (all their tensors over the padded weight count).

    The output head (the linear whose width is the padded vocabulary) is left out, as the reference
    engine reports it separately. An unquantized model reports the bit width of its weights' dtype.
    """
    import json

    from exl3_core.loader import SafetensorsCollection

    d = Path(directory)
    vocab = json.loads((d / "config.json").read_text(encoding="utf-8")).get("vocab_size") or 0
    vocab_padded = -(-int(vocab) // 128) * 128
    bits, numel = 0.0, 0
    with SafetensorsCollection(d) as c:
        names = set(c.keys())
        for name in sorted(n for n in names if n.endswith(".trellis")):
            key = name[: -len(".trellis")]
            tk, tn, _ = c.shape(name)
            if tn * 16 == vocab_padded:
                continue
            n = tk * 16 * tn * 16
            stored = sum(c.nbytes(f"{key}.{s}") for s in STORED_SUFFIXES if f"{key}.{s}" in names)
            bits += 8 * stored
            numel += n
        if numel == 0:
            w = [n for n in names if n.endswith(".weight")]
            return float(torch.finfo(c.dtype(w[0])).bits) if w else 16.0
    return bits / numel


# -- rendering ------------------------------------------------------------------------------------
def render(points: Sequence[Point], out: str | Path, *, title: str = "", reference_ppl: float | None = None,
           backend: str = "auto") -> Path:
    """Write the chart to ``out`` (PNG). ``backend``: ``auto``, ``matplotlib`` or ``builtin``."""
    pts = sorted(points, key=lambda p: p.bpw)
    if not pts:
        raise ValueError("nothing to plot: no models were given")
    out = Path(out)
    if backend in ("auto", "matplotlib"):
        try:
            import matplotlib  # type: ignore[import-not-found]

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt  # type: ignore[import-not-found]
        except ImportError:
            if backend == "matplotlib":
                raise
        else:
            n_panels = 2 if any(p.kld is not None for p in pts) else 1
            fig, axes = plt.subplots(1, n_panels, figsize=(5 * n_panels, 4), squeeze=False)
            ax = axes[0][0]
            ax.plot([p.bpw for p in pts], [p.ppl for p in pts], "o-")
            if reference_ppl is not None:
                ax.axhline(reference_ppl, linestyle="--", color="gray", label="reference")
                ax.legend()
            ax.set_xlabel("bits per weight")
            ax.set_ylabel("perplexity")
            if n_panels == 2:
                kp = [p for p in pts if p.kld is not None]
                axes[0][1].plot([p.bpw for p in kp], [p.kld for p in kp], "o-", color="C1")
                axes[0][1].set_xlabel("bits per weight")
                axes[0][1].set_ylabel("KL divergence")
            if title:
                fig.suptitle(title)
            fig.tight_layout()
            fig.savefig(out, format="png")
            plt.close(fig)
            return out
    panels: list[tuple[str, list[tuple[float, float]], float | None]] = [
        ("PPL", [(p.bpw, p.ppl) for p in pts], reference_ppl)]
    if any(p.kld is not None for p in pts):
        panels.append(("KLD", [(p.bpw, float(p.kld)) for p in pts if p.kld is not None], None))
    canvas = Canvas(420 * len(panels), 320)
    for i, (name, xy, ref) in enumerate(panels):
        _panel(canvas, 420 * i, name, xy, ref)
    out.write_bytes(canvas.png())
    return out


class Canvas:
    """An RGB raster with just enough drawing for a line chart."""

    def __init__(self, width: int, height: int) -> None:
        self.w, self.h = width, height
        self.px = bytearray(b"\xff" * (width * height * 3))

    def dot(self, x: int, y: int, rgb: tuple[int, int, int]) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i: i + 3] = bytes(rgb)

    def line(self, x0: float, y0: float, x1: float, y1: float, rgb: tuple[int, int, int], width: int = 1) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        r = width // 2
        for k in range(n + 1):
            t = k / n
            x, y = round(x0 + (x1 - x0) * t), round(y0 + (y1 - y0) * t)
            for dx in range(-r, width - r):
                for dy in range(-r, width - r):
                    self.dot(x + dx, y + dy, rgb)

    def box(self, x: int, y: int, r: int, rgb: tuple[int, int, int]) -> None:
        for dx in range(-r, r + 1):
            for dy in range(-r, r + 1):
                self.dot(x + dx, y + dy, rgb)

    def text(self, x: int, y: int, s: str, rgb: tuple[int, int, int] = (0, 0, 0)) -> None:
        for ch in s:
            rows = FONT.get(ch, FONT["?"])
            for j, bits in enumerate(rows):
                for i in range(5):
                    if bits >> (4 - i) & 1:
                        self.dot(x + i, y + j, rgb)
            x += 6

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[3 * self.w * y: 3 * self.w * (y + 1)]) for y in range(self.h))

        def chunk(tag: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

        ihdr = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (step * m) <= n:
            step *= m
            break
    first = math.ceil(lo / step) * step
    return [first + k * step for k in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.1e}"


def _panel(c: Canvas, x_off: int, name: str, xy: list[tuple[float, float]], ref: float | None) -> None:
    left, right, top, bottom = x_off + 60, x_off + 400, 30, 280
    xs, ys = [p[0] for p in xy], [p[1] for p in xy] + ([ref] if ref is not None else [])
    x_lo, x_hi = min(xs) - 0.25, max(xs) + 0.25
    y_lo, y_hi = min(ys), max(ys)
    pad = (y_hi - y_lo) * 0.08 or abs(y_hi) * 0.1 or 1.0
    y_lo, y_hi = y_lo - pad, y_hi + pad

    def X(v: float) -> float:
        return left + (v - x_lo) / (x_hi - x_lo) * (right - left)

    def Y(v: float) -> float:
        return bottom - (v - y_lo) / (y_hi - y_lo) * (bottom - top)

    grey, black, blue = (200, 200, 200), (0, 0, 0), (31, 119, 180)
    for t in _ticks(y_lo, y_hi):
        c.line(left, Y(t), right, Y(t), grey)
        c.text(left - 6 * len(_fmt(t)) - 4, round(Y(t)) - 3, _fmt(t))
    for t in _ticks(x_lo, x_hi):
        c.line(X(t), bottom, X(t), bottom + 4, black)
        c.text(round(X(t)) - 3 * len(_fmt(t)), bottom + 8, _fmt(t))
    c.line(left, top, left, bottom, black)
    c.line(left, bottom, right, bottom, black)
    if ref is not None:
        for x in range(left, right, 8):
            c.line(x, Y(ref), x + 4, Y(ref), (128, 128, 128))
    for (x0, y0), (x1, y1) in itertools.pairwise(xy):
        c.line(X(x0), Y(y0), X(x1), Y(y1), blue, width=2)
    for px, py in xy:
        c.box(round(X(px)), round(Y(py)), 3, blue)
    c.text(left + (right - left) // 2 - 9, bottom + 22, "bpw")
    c.text(x_off + 8, top - 20, name)


# 5x7 glyphs, one int per row, bit 4 = leftmost pixel
FONT: dict[str, tuple[int, ...]] = {
    "0": (14, 17, 19, 21, 25, 17, 14), "1": (4, 12, 4, 4, 4, 4, 14), "2": (14, 17, 1, 2, 4, 8, 31),
    "3": (31, 2, 4, 2, 1, 17, 14), "4": (2, 6, 10, 18, 31, 2, 2), "5": (31, 16, 30, 1, 1, 17, 14),
    "6": (6, 8, 16, 30, 17, 17, 14), "7": (31, 1, 2, 4, 8, 8, 8), "8": (14, 17, 17, 14, 17, 17, 14),
    "9": (14, 17, 17, 15, 1, 2, 12), ".": (0, 0, 0, 0, 0, 12, 12), "-": (0, 0, 0, 31, 0, 0, 0),
    "+": (0, 4, 4, 31, 4, 4, 0), "e": (0, 0, 14, 17, 31, 16, 14), " ": (0,) * 7,
    "b": (16, 16, 22, 25, 17, 17, 30), "p": (0, 0, 30, 17, 30, 16, 16), "w": (0, 0, 17, 17, 21, 21, 10),
    "P": (30, 17, 17, 30, 16, 16, 16), "L": (16, 16, 16, 16, 16, 16, 31), "K": (17, 18, 20, 24, 20, 18, 17),
    "D": (28, 18, 17, 17, 17, 18, 28), "?": (14, 17, 1, 2, 4, 0, 4),
}
