"""The ``SamplingStep`` contract: one logits transform, vectorised over a batch of jobs.

A job's :class:`~exl3_core.sampling.sampler.Sampler` is an ordered list of step instances, each
holding that job's parameter values (validated when the step is built, so bad values fail at
job creation). Rows of a batch whose samplers have the same step order run together: every step
class gathers its rows' parameters into per-row tensors (:meth:`SamplingStep.batch_params`) and
transforms the ``[B, vocab]`` float32 logits in one go (:meth:`SamplingStep.apply`).

Pipeline state (:class:`State`): every step consumes and produces *logits*, where excluded
tokens are ``-inf``; the final draw turns them into probabilities. Keeping one state avoids the
renormalisation bugs of pipelines that hand probabilities between truncation steps.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


class State(enum.Enum):
    """What the tensor between steps holds (kept explicit for plugin steps that need probs)."""

    LOGITS = "logits"  # unnormalised log-probabilities, -inf = excluded
    PROBS = "probs"  # normalised probabilities (only inside a step; steps return logits)


class SamplerValueError(ValueError):
    """A sampler parameter is out of range; raised when the job is created."""


@dataclass
class StepContext:
    """Per-batch inputs a step may need besides the logits.

    :param history: ``int64 [B, W]`` most recent generated/prompt tokens, right-aligned (the
        newest in the last column), ``-1`` where a row has fewer than ``W`` tokens.
    """

    vocab_size: int
    history: torch.Tensor | None = None


class SamplingStep:
    """Base class. Subclasses set ``name``, ``defaults`` and implement :meth:`apply`.

    ``defaults`` maps each scalar parameter to its value when omitted. ``preset`` holds the
    values used when the step's name alone is given as a sampler (``sampler="top_p"``).
    """

    name: ClassVar[str]
    defaults: ClassVar[dict[str, Any]] = {}
    preset: ClassVar[dict[str, Any]] = {}
    #: history tokens this step reads (0: none); a parameter name means "that parameter's value"
    history_param: ClassVar[str | None] = None

    def __init__(self, **params: Any) -> None:
        unknown = set(params) - set(self.defaults)
        if unknown:
            raise SamplerValueError(f"sampling step {self.name!r} got unknown parameter(s) {sorted(unknown)}; "
                                    f"it takes {sorted(self.defaults)}")
        self.params = {**self.defaults, **params}
        self.validate()

    def validate(self) -> None:
        """Raise :class:`SamplerValueError` naming the parameter and its valid range."""

    def check_vocab(self, vocab_size: int) -> None:
        """Raise if a token id parameter is outside ``[0, vocab_size)`` (called at job creation)."""

    def history_window(self) -> int:
        return int(self.params[self.history_param]) if self.history_param else 0

    def _err(self, param: str, rule: str) -> SamplerValueError:
        return SamplerValueError(f"sampler step {self.name!r}: {param}={self.params[param]!r} is invalid; {rule}")

    def _number(self, param: str, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
                integer: bool = False) -> None:
        v = self.params[param]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self._err(param, "it must be a finite number")
        try:
            finite = math.isfinite(v)  # an int beyond float range raises here
        except OverflowError:
            finite = False
        if not finite:
            raise self._err(param, "it must be a finite number")
        if integer and int(v) != v:
            raise self._err(param, "it must be an integer")
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise self._err(param, f"it must be {'>' if lo_open else '>='} {lo}")
        if hi is not None and v > hi:
            raise self._err(param, f"it must be <= {hi}")

    @classmethod
    def batch_params(cls, steps: list[SamplingStep], device: torch.device) -> dict[str, torch.Tensor]:
        """Per-row parameter tensors ``[B, 1]`` (float32) for ``steps`` (one per row)."""
        return {k: torch.tensor([float(s.params[k]) for s in steps], dtype=torch.float32).view(-1, 1).to(device)
                for k in cls.defaults}

    @classmethod
    def apply(cls, logits: torch.Tensor, params: Any, ctx: StepContext) -> torch.Tensor:
        """Transform ``logits [B, V]`` (float32, -inf = excluded); may work in place."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.params.items())})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.params == self.params  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, repr(self.params)))
