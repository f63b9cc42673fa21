"""``Job``: one generation request and its per-job state inside the generator."""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from exl3_core.cache.pages import ROOT_HASH
from exl3_core.filters.base import Filter
from exl3_core.lora.config import check_choice
from exl3_core.sampling.sampler import Sampler, resolve_sampler


class Job:
    """A generation request.

    :param input_ids: prompt token ids (``LongTensor [1, S]``, ``[S]`` or a list).
    :param max_new_tokens: stop after this many generated tokens.
    :param sampler: a :class:`Sampler`, a registered sampler/preset name, a dict of
        :meth:`Sampler.build` arguments, or None (greedy). Invalid values raise here.
    :param seed: seed of this job's own ``torch.Generator`` (None: drawn from torch's global RNG,
        so ``torch.manual_seed`` makes runs reproducible).
    :param stop_conditions: token ids and strings that end the job. A stop string may span
        token boundaries; neither it nor a stop token appears in the output text.
    :param stop_at_eos: also stop at the model's EOS token ids.
    :param banned_strings: strings that must never appear in the output; when one is generated
        the job rolls back to where it began and bans the token that started it.
    :param filters: :class:`~exl3_core.filters.Filter` instances constraining the output.
    :param return_logits: report each sampled token's raw logits row (``float32 [V]``, on CPU).
    :param return_probs: report each sampled token's probability under the final distribution.
    :param identifier: anything; returned with every result of this job.
    :param loras: LoRA adapters loaded on the model to run this job with, ``{name: weight}`` (the weighted sum
        of their deltas; 1.0: as trained); None: the base model.
    :param priority: larger runs first: queued jobs are admitted by priority, then arrival, and when
        the cache runs out the lowest-priority (then newest) running job is paused first (see
        :mod:`exl3_core.generator.scheduler`).
    """

    def __init__(self, input_ids: torch.Tensor | Sequence[int], *, max_new_tokens: int = 256, sampler: Any = None,
                 seed: int | None = None, stop_conditions: Sequence[int | str] = (), stop_at_eos: bool = True,
                 banned_strings: Sequence[str] = (), filters: Sequence[Filter] = (), return_logits: bool = False,
                 return_probs: bool = False, identifier: Any = None, plugins: Any = None,
                 loras: Mapping[str, float] | None = None, priority: int = 0) -> None:
        ids = input_ids.reshape(-1).tolist() if isinstance(input_ids, torch.Tensor) else [int(t) for t in input_ids]
        if not ids:
            raise ValueError("Job: input_ids is empty; a prompt needs at least one token (e.g. BOS)")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"Job: max_new_tokens={max_new_tokens!r} must be a positive integer")
        self.sampler: Sampler = resolve_sampler(sampler, plugins)
        self.prompt: list[int] = ids
        self.max_new_tokens = max_new_tokens
        self.seed = int(seed) if seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.stop_tokens: set[int] = set()
        self.stop_strings: list[str] = []
        for c in stop_conditions:
            if isinstance(c, str):
                self.stop_strings.append(c)
            elif isinstance(c, int) and not isinstance(c, bool):
                self.stop_tokens.add(c)
            else:
                raise TypeError(f"Job: stop condition {c!r} must be a token id (int) or a string")
        self.stop_at_eos = stop_at_eos
        self.banned_strings = [s for s in banned_strings if s]
        self.filters = list(filters)
        for f in self.filters:
            if not isinstance(f, Filter):
                raise TypeError(f"Job: filter {f!r} is not an exl3_core.filters.Filter")
        self.return_logits = return_logits
        self.return_probs = return_probs
        self.identifier = identifier
        self.loras: dict[str, float] = check_choice(loras, "Job: loras")
        self.lora_uids: dict[str, int] = {}  # which load of each adapter the job runs with (set at enqueue)
        self.hash_root = ROOT_HASH  # prefix-cache chain root (salted with the adapters at enqueue)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"Job: priority={priority!r} must be an integer (larger runs first)")
        self.priority = priority
        self.arrival = 0  # enqueue order, set by the generator (ties between equal priorities)
        self.preemptions = 0  # times paused for cache space (recomputed on resume)
        self.status = "new"  # new -> queued -> active (-> queued when preempted -> active) -> done | cancelled
        self.error: BaseException | None = None
        self._init_state()

    def _init_state(self) -> None:
        self.seq: list[int] = list(self.prompt)
        self.cached = 0  # tokens of seq whose keys/values are in the cache
        self.pages: list[int] = []
        #: its ring slot in a cache that keeps per-sequence recent rows while it is active (-1: none)
        self.ring_slot = -1
        self.hashes: list[bytes] = []  # hash chain of the full pages registered so far
        self.prompt_hashes: list[bytes] | None = None  # prefix-cache keys of seq's full pages (until admitted)
        self.new_tokens = 0
        self.cached_tokens = 0  # prompt tokens served by the prefix cache
        self.ban_at: dict[int, set[int]] = {}  # position -> tokens banned there (banned strings)
        self.rollbacks = 0  # banned-string rollbacks so far (drafters re-check their copies of seq)
        self.draft_tokens = 0  # speculative decoding: draft tokens verified for this job
        self.accepted_draft_tokens = 0  # of which the target accepted
        self._completion: list[str] = []  # the text streamed so far, in pieces (see completion)
        self.rng: torch.Generator | None = None
        self.stream: Any = None
        self.held: Any = None
        self.t_enqueue = self.t_admit = self.t_first = self.t_end = 0.0

    @property
    def completion(self) -> str:
        """The text streamed so far. Kept in pieces and joined when read: a string grown a token at a time
        would be copied whole at every token."""
        if len(self._completion) > 1:
            self._completion = ["".join(self._completion)]
        return self._completion[0] if self._completion else ""

    def add_completion(self, text: str) -> None:
        if text:
            self._completion.append(text)

    @property
    def prefill_done(self) -> bool:
        return self.cached >= len(self.seq) - 1

    def stats(self) -> dict[str, Any]:
        """Timing and token counts (seconds; rates in tokens/s)."""
        end = self.t_end or time.perf_counter()
        prefill = (self.t_first or end) - self.t_admit if self.t_admit else 0.0
        gen = end - self.t_first if self.t_first else 0.0
        return {
            "prompt_tokens": len(self.prompt), "cached_tokens": self.cached_tokens, "new_tokens": self.new_tokens,
            "time_queued": (self.t_admit or end) - self.t_enqueue, "time_prefill": prefill, "time_generate": gen,
            "prefill_tokens_per_s": (len(self.prompt) - self.cached_tokens) / prefill if prefill > 0 else 0.0,
            "tokens_per_s": (self.new_tokens - 1) / gen if gen > 0 and self.new_tokens > 1 else 0.0,
            "draft_tokens": self.draft_tokens, "accepted_draft_tokens": self.accepted_draft_tokens,
            "acceptance_rate": self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "preemptions": self.preemptions,
        }

    def __repr__(self) -> str:
        return (f"Job(id={self.identifier!r}, status={self.status}, prompt={len(self.prompt)} tokens, "
                f"new={self.new_tokens}/{self.max_new_tokens})")
