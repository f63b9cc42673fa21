"""The generator's typed contracts: what it needs of a model, and what it returns per step.

One way only: the generator calls the model (through an :class:`~exl3_core.plan.ExecutionPlan`) and
the model knows nothing of the generator, its one-step-ahead loop or its CUDA graphs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypedDict

import torch

from exl3_core.archkit.batch import BatchModel

__all__ = ["BatchModel", "NumericFault", "Result"]

if TYPE_CHECKING:
    from exl3_core.generator.job import Job


class NumericFault(RuntimeError):
    """The model produced NaN or infinite logits for a job (corrupt weights, an overflow): a fault of
    the model or its numerics, never of the job's sampling settings. Names the job and the step."""

    def __init__(self, identifier: Any, step: int, position: int) -> None:
        super().__init__(
            f"numeric fault: the model's logits for job {identifier!r} at generator step {step} (sequence "
            f"position {position}) are NaN or infinite; the weights or activations are corrupt or overflowed "
            f"(check the model files, or run in a wider dtype). No sampling setting caused this")
        self.identifier = identifier
        self.step = step
        self.position = position


class Result(TypedDict, total=False):
    """One job's output of one step (what :meth:`Generator.iterate` returns a list of).

    Always present: ``job``, ``identifier``, ``stage``, ``eos``, ``text``, ``token_ids``. With
    ``eos`` True: ``eos_reason`` ("stop_token", "stop_string", "filter", "max_new_tokens",
    "max_seq_len", "error"), ``full_completion`` and the job's stats (``preemptions``: times it was
    paused for cache space); ``stop_token`` for a stop token, ``error`` for an error.
    ``token_probs``/``logits`` when the job asked for them. Speculative decoding: ``draft_tokens``
    verified for the job, ``accepted_draft_tokens`` of them and their ratio ``acceptance_rate`` (zeros
    without drafting).
    """

    job: Job
    identifier: Any
    stage: str
    eos: bool
    text: str
    token_ids: list[int]
    token_probs: list[float]
    logits: torch.Tensor
    eos_reason: str
    stop_token: int | None
    stop_string: bool
    error: BaseException
    full_completion: str
    prompt_tokens: int
    cached_tokens: int
    new_tokens: int
    time_queued: float
    time_prefill: float
    time_generate: float
    prefill_tokens_per_s: float
    tokens_per_s: float
    draft_tokens: int
    accepted_draft_tokens: int
    acceptance_rate: float
    preemptions: int
