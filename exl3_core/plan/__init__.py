"""The execution plan: fused forms of the model's forward, chosen by declared rules, with reasons.

The model's own modules hold the reference forward (the maths); this package decides how the
engine runs it on a device and reports every decision (``exl3 inspect --plan``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from exl3_core.lazy import lazy_attributes, refs_of

if TYPE_CHECKING:
    from exl3_core.plan.decoder import Carry, DecoderExecutor
    from exl3_core.plan.plan import ExecutionPlan, decode_shapes
    from exl3_core.plan.report import Decision, PartReport

__getattr__ = lazy_attributes(__name__, {**refs_of("exl3_core.plan.decoder", "Carry", "DecoderExecutor"),
                                         **refs_of("exl3_core.plan.plan", "ExecutionPlan", "decode_shapes"),
                                         **refs_of("exl3_core.plan.report", "Decision", "PartReport")})

__all__ = ["Carry", "Decision", "DecoderExecutor", "ExecutionPlan", "PartReport", "decode_shapes"]
