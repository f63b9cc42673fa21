"""Sampling: composable steps vectorised over a batch, samplers, presets."""
from __future__ import annotations

from exl3_core.sampling.sampler import SampleOutput, Sampler, draw, resolve_sampler, sample
from exl3_core.sampling.step import SamplerValueError, SamplingStep, State, StepContext
from exl3_core.sampling.steps import (
    STEPS,
    FrequencyPenalty,
    Greedy,
    LogitBias,
    MinP,
    PresencePenalty,
    RepetitionPenalty,
    Temperature,
    TokenBan,
    TopK,
    TopP,
    Typical,
)

__all__ = ["STEPS", "FrequencyPenalty", "Greedy", "LogitBias", "MinP", "PresencePenalty", "RepetitionPenalty",
           "SampleOutput", "Sampler", "SamplerValueError", "SamplingStep", "State", "StepContext", "Temperature",
           "TokenBan", "TopK", "TopP", "Typical", "draw", "resolve_sampler", "sample"]
