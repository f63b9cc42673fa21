"""Named sampler presets (registered with ``kind="preset"``; each is a zero-argument factory)."""
from __future__ import annotations

from exl3_core.sampling.sampler import Sampler


def default() -> Sampler:
    """A general-purpose chat setting."""
    return Sampler.build(temperature=0.8, top_p=0.95)


def creative() -> Sampler:
    return Sampler.build(temperature=1.1, min_p=0.05)


def precise() -> Sampler:
    return Sampler.build(temperature=0.3, top_p=0.9, repetition_penalty=1.05)


PRESETS = {"default": default, "creative": creative, "precise": precise}
