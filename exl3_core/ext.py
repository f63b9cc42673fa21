"""Lazy access to the optional compiled extension ``exl3_core._C``.

The extension registers its ops under ``torch.ops.exl3``. Nothing here imports it at module
import time; callers ask ``has_op(name)`` and fall back to the torch reference otherwise.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Iterable

import torch


@functools.cache
def load() -> bool:
    """Import the extension once; True when it loaded. Failures are remembered, not raised."""
    from exl3_core import settings

    if settings.get().disable_ext:
        return False
    try:
        importlib.import_module("exl3_core._C")
    except ImportError as e:
        # The sources only register torch ops (no PyInit__C), so Python's import refuses the .so;
        # load it as a plain torch op library instead.
        spec = importlib.util.find_spec("exl3_core._C")
        if spec is None or spec.origin is None:
            load_error.append(str(e))
            return False
        try:
            torch.ops.load_library(spec.origin)
        except (OSError, RuntimeError) as e2:
            load_error.append(f"{e}; torch.ops.load_library: {e2}")
            return False
    if hasattr(torch.ops.exl3, "set_kt_exceptions"):
        set_kt_exceptions(KT_EXCEPTIONS)
    return True


#: Measured exceptions to the decode-size EXL3 linear's k-chunk cost model (``pick_kt_per_chunk`` in
#: csrc/exl3/exl3_fused.cuh), applied at m = 1 where they were measured: (SM count, K bits, k tiles,
#: 128-column blocks) -> k tiles per chunk. Each row is a shape where a sweep of one decoder layer's
#: linears, launched as in the decode step (``TUNE_CHAIN`` in bench/gemv_tune.cu), found a chunk size
#: clearly faster than the model's pick on that device; docs/performance.md (run 12) has the sweeps.
#: Empty since run 23: the H200 row (132, 4, 256, 224, 24) for the 8B-shape gate/up (4096 x 28672), 77.9 vs
#: 78.8 us per layer at 32 with 2 n tiles per warp (run 12), measured 71.7-72.1 against 70.9 at 32 (the
#: model's pick) once the transposed loop took 4 n tiles per warp.
KT_EXCEPTIONS: tuple[tuple[int, int, int, int, int], ...] = ()


def set_kt_exceptions(rows: Iterable[tuple[int, ...]]) -> int:
    """Replace the extension's k-chunk exceptions (rows as in :data:`KT_EXCEPTIONS`; empty: the cost
    model everywhere, e.g. for A/B runs). Returns the row count installed (0 without the CUDA linear).
    Checked here: a C++ error inside the extension would take the process down on some images."""
    flat: list[int] = []
    for row in rows:
        if len(row) != 5 or any(not isinstance(v, int) or v <= 0 for v in row) or row[4] > 32:
            raise ValueError(f"k-chunk exception {row!r}: want 5 positive ints "
                             "(sms, K, k_tiles, col_blocks, kt <= 32)")
        flat.extend(row)
    if not hasattr(torch.ops.exl3, "set_kt_exceptions"):  # an extension built without the CUDA linear
        return 0
    return int(torch.ops.exl3.set_kt_exceptions(flat))


load_error: list[str] = []


def has_op(name: str) -> bool:
    """True when ``torch.ops.exl3.<name>`` exists (extension built with that op)."""
    return load() and hasattr(torch.ops.exl3, name)


def op(name: str):
    """The compiled op ``torch.ops.exl3.<name>``; call ``has_op`` first."""
    return getattr(torch.ops.exl3, name)
