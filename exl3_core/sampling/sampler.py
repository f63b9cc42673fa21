"""``Sampler`` (one job's ordered steps) and the batched draw over many jobs' samplers."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from exl3_core.sampling.step import SamplerValueError, SamplingStep, StepContext
from exl3_core.sampling.steps import (
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


class Sampler:
    """An ordered pipeline of :class:`SamplingStep` instances; an empty pipeline is greedy."""

    def __init__(self, steps: Sequence[SamplingStep] = ()) -> None:
        for s in steps:
            if not isinstance(s, SamplingStep):
                raise SamplerValueError(f"Sampler steps must be SamplingStep instances, got {s!r}")
        self.steps: tuple[SamplingStep, ...] = tuple(steps)

    @classmethod
    def build(cls, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
              typical: float = 1.0, repetition_penalty: float = 1.0, frequency_penalty: float = 0.0,
              presence_penalty: float = 0.0, penalty_window: int = 1024, logit_bias: Mapping[int, float] | None = None,
              banned_tokens: Sequence[int] | None = None) -> Sampler:
        """The canonical pipeline; steps left at their neutral value are omitted.

        Order: bans, bias, penalties (on raw logits, as in the CTRL paper), temperature, then the
        truncations top-k, top-p, min-p, typical (each on the tempered distribution).
        """
        steps: list[SamplingStep] = []
        if banned_tokens:
            steps.append(TokenBan(tokens=tuple(banned_tokens)))
        if logit_bias:
            steps.append(LogitBias(bias=dict(logit_bias)))
        if repetition_penalty != 1.0:
            steps.append(RepetitionPenalty(penalty=repetition_penalty, window=penalty_window))
        if frequency_penalty != 0.0:
            steps.append(FrequencyPenalty(penalty=frequency_penalty, window=penalty_window))
        if presence_penalty != 0.0:
            steps.append(PresencePenalty(penalty=presence_penalty, window=penalty_window))
        steps.append(Temperature(temperature=temperature))
        if top_k != 0:
            steps.append(TopK(top_k=top_k))
        if top_p != 1.0:
            steps.append(TopP(top_p=top_p))
        if min_p != 0.0:
            steps.append(MinP(min_p=min_p))
        if typical != 1.0:
            steps.append(Typical(typical=typical))
        return cls(steps)

    @classmethod
    def greedy(cls) -> Sampler:
        return cls(())

    @property
    def signature(self) -> tuple[type[SamplingStep], ...]:
        """Step classes in order; rows with equal signatures are sampled together."""
        return tuple(type(s) for s in self.steps)

    @property
    def is_greedy(self) -> bool:
        return not self.steps

    def history_window(self) -> int:
        return max((s.history_window() for s in self.steps), default=0)

    def check_vocab(self, vocab_size: int) -> None:
        for s in self.steps:
            s.check_vocab(vocab_size)

    def __repr__(self) -> str:
        return f"Sampler([{', '.join(map(repr, self.steps))}])" if self.steps else "Sampler(greedy)"


@dataclass
class SampleOutput:
    """``ids [B]`` int64; ``probs [B]`` final-distribution probability of each id (if asked);
    ``ok [B]`` False where every token was excluded (the job must fail)."""

    ids: torch.Tensor
    probs: torch.Tensor | None
    ok: torch.Tensor


def draw(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: one uniform in [0, 1) per row picks ``i`` with probability ``softmax(logits)[i]``."""
    probs = torch.softmax(logits, dim=-1)
    cdf = probs.cumsum(-1)
    target = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
    ids = torch.searchsorted(cdf, target, right=True).clamp_(max=logits.shape[1] - 1)
    # a rounding step past the last nonzero entry would pick an excluded token: fall back to argmax
    picked = probs.gather(1, ids)
    return torch.where(picked > 0, ids, probs.argmax(-1, keepdim=True)).squeeze(1)


def sample(logits: torch.Tensor, samplers: Sequence[Sampler], uniforms: torch.Tensor | None = None, *,
           history: torch.Tensor | None = None, want_probs: bool = False,
           generator: torch.Generator | None = None) -> SampleOutput:
    """Sample one token per row of ``logits [B, V]``, row b with ``samplers[b]``.

    :param uniforms: ``[B]`` uniforms in [0, 1) (the generator draws them from each job's own
        seeded ``torch.Generator``); None draws them from ``generator``.
    :param history: ``int64 [B, W]`` right-aligned recent tokens for penalty steps.
    """
    B, V = logits.shape
    dev = logits.device
    if len(samplers) != B:
        raise ValueError(f"sample: {B} logit rows but {len(samplers)} samplers")
    if uniforms is None:
        uniforms = torch.rand(B, generator=generator, device="cpu" if generator is None else generator.device).to(dev)
    ids = torch.empty(B, dtype=torch.int64, device=dev)
    ok = torch.empty(B, dtype=torch.bool, device=dev)
    probs = torch.empty(B, dtype=torch.float32, device=dev) if want_probs else None
    groups: dict[tuple[type[SamplingStep], ...], list[int]] = {}
    for b, s in enumerate(samplers):
        groups.setdefault(s.signature, []).append(b)
    for sig, rows_list in groups.items():
        whole = len(rows_list) == B
        rows = torch.arange(B, device=dev) if whole else torch.tensor(rows_list, dtype=torch.int64, device=dev)
        x = (logits if whole else logits.index_select(0, rows)).float()
        if sig:
            x = x.clone()
            ctx = StepContext(vocab_size=V, history=None if history is None else
                              (history if whole else history.index_select(0, rows.to(history.device))))
            for i, cls in enumerate(sig):
                params = cls.batch_params([samplers[b].steps[i] for b in rows_list], dev)
                x = cls.apply(x, params, ctx)
            g_ids = draw(x, uniforms if whole else uniforms.index_select(0, rows))
        else:
            g_ids = x.argmax(-1)
        ids.index_copy_(0, rows, g_ids)
        ok.index_copy_(0, rows, torch.isfinite(x).any(-1) & ~torch.isnan(x).any(-1))
        if probs is not None:
            probs.index_copy_(0, rows, torch.softmax(x, -1).gather(1, g_ids[:, None]).squeeze(1))
    return SampleOutput(ids, probs, ok)


def final_logits(logits: torch.Tensor, samplers: Sequence[Sampler], *,
                 history: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[B, V]``: row b of ``logits`` after ``samplers[b]``'s steps, the logits whose softmax
    :func:`sample` draws from (``-inf``: excluded); a greedy row keeps only its argmax. Speculative
    decoding needs these whole distributions, not one draw from them."""
    B, V = logits.shape
    if len(samplers) != B:
        raise ValueError(f"final_logits: {B} logit rows but {len(samplers)} samplers")
    dev = logits.device
    out = logits.float().clone()
    groups: dict[tuple[type[SamplingStep], ...], list[int]] = {}
    for b, s in enumerate(samplers):
        groups.setdefault(s.signature, []).append(b)
    for sig, rows_list in groups.items():
        whole = len(rows_list) == B
        rows = None if whole else torch.tensor(rows_list, dtype=torch.int64).to(dev, non_blocking=True)
        x = out if rows is None else out.index_select(0, rows)
        if sig:
            ctx = StepContext(vocab_size=V, history=None if history is None else
                              (history if rows is None else history.index_select(0, rows.to(history.device))))
            for i, cls in enumerate(sig):
                x = cls.apply(x, cls.batch_params([samplers[b].steps[i] for b in rows_list], dev), ctx)
        else:
            x = Greedy.apply(x, None, StepContext(vocab_size=V))
        if rows is None:
            out = x
        else:
            out.index_copy_(0, rows, x)
    return out


def resolve_sampler(sampler: Any, plugins: Any = None) -> Sampler:
    """``Sampler`` from a Sampler, a registered preset/step name, a dict of ``Sampler.build`` args,
    or None (greedy)."""
    if sampler is None:
        return Sampler.greedy()
    if isinstance(sampler, Sampler):
        return sampler
    if isinstance(sampler, SamplingStep):
        return Sampler([sampler])
    if isinstance(sampler, Mapping):
        return Sampler.build(**sampler)
    if isinstance(sampler, str):
        if plugins is None:
            from exl3_core.plugins import get_plugins

            plugins = get_plugins()
        spec = plugins.sampler_specs().get(sampler)
        obj = plugins.sampler(sampler)  # raises listing the registered names when unknown
        if spec.kind == "preset":
            out = obj()
            if not isinstance(out, Sampler):
                raise TypeError(f"sampler preset {sampler!r} ({spec.impl}) returned {out!r}, not a Sampler")
            return out
        if obj is Greedy:
            return Sampler.greedy()
        step = obj(**obj.preset)
        if obj is Temperature:
            return Sampler([step])
        # logit edits come before temperature, truncations after it (as in Sampler.build)
        return Sampler([step, Temperature()] if obj.history_param or obj in (LogitBias, TokenBan)
                       else [Temperature(), step])
    raise TypeError(f"sampler={sampler!r}: expected a Sampler, a sampler name, a dict of Sampler.build "
                    f"arguments or None")
