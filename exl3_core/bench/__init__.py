"""``exl3 bench``: random-weight EXL3 models of a given shape and the engine benchmark over them."""
from __future__ import annotations

from typing import TYPE_CHECKING

from exl3_core.lazy import lazy_attributes, refs_of

if TYPE_CHECKING:
    from exl3_core.bench.models import BenchShape, RandomSource, build_model, named_shapes, parse_shape
    from exl3_core.bench.run import run_bench

__getattr__ = lazy_attributes(__name__, {
    **refs_of("exl3_core.bench.models", "BenchShape", "RandomSource", "build_model", "named_shapes", "parse_shape"),
    **refs_of("exl3_core.bench.run", "run_bench")})

__all__ = ["BenchShape", "RandomSource", "build_model", "named_shapes", "parse_shape", "run_bench"]
