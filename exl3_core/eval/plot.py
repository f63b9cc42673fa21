"""Quality-vs-size plots: perplexity (and KL divergence) against bits per weight, as a PNG.

matplotlib draws the chart; it is the optional extra ``plot`` (``pip install 'exl3-core[plot]'``),
not a dependency of the core.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

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
PLOT_EXTRA_HINT = "pip install 'exl3-core[plot]' (or: pip install matplotlib)"


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the file-only Agg backend; ImportError naming the ``plot`` extra without it."""
    try:
        import matplotlib  # type: ignore[import-not-found]
    except ImportError:
        raise ImportError(f"exl3 eval plot draws with matplotlib, which is not installed: {PLOT_EXTRA_HINT}") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt  # type: ignore[import-not-found]

    return plt


def render(points: Sequence[Point], out: str | Path, *, title: str = "", reference_ppl: float | None = None) -> Path:
    """Write the chart to ``out`` (PNG): perplexity against bpw, and a KL-divergence panel when the
    points have KLD values. Raises ImportError naming the ``plot`` extra without matplotlib."""
    pts = sorted(points, key=lambda p: p.bpw)
    if not pts:
        raise ValueError("nothing to plot: no models were given")
    out = Path(out)
    plt = pyplot()
    n_panels = 2 if any(p.kld is not None for p in pts) else 1
    fig, axes = plt.subplots(1, n_panels, figsize=(5 * n_panels, 4), squeeze=False)
    try:
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
    finally:
        plt.close(fig)
    return out
