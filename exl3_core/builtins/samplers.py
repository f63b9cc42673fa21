"""Built-in plugin: the stock sampling steps and presets."""
from __future__ import annotations

from exl3_core.plugins import hookimpl
from exl3_core.plugins.specs import SamplerSpec

_STEPS = {
    "greedy": "Greedy", "temperature": "Temperature", "top_k": "TopK", "top_p": "TopP", "min_p": "MinP",
    "typical": "Typical", "repetition_penalty": "RepetitionPenalty", "frequency_penalty": "FrequencyPenalty",
    "presence_penalty": "PresencePenalty", "logit_bias": "LogitBias", "token_ban": "TokenBan",
}
_PRESETS = ("default", "creative", "precise")


@hookimpl
def exl3_samplers() -> list[SamplerSpec]:
    # lazy references only: declaring samplers must not import torch
    return [
        *(SamplerSpec(name=n, impl=f"exl3_core.sampling.steps:{cls}") for n, cls in _STEPS.items()),
        *(SamplerSpec(name=n, impl=f"exl3_core.sampling.presets:{n}", kind="preset") for n in _PRESETS),
    ]
