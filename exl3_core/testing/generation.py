"""Running jobs through a generator to the end, for tests that compare two generators' outputs."""
from __future__ import annotations

from typing import Any

import torch


def run_to_end(gen: Any, prompts: list[list[int]], n: int,
               logits: bool = False) -> list[tuple[list[int], torch.Tensor | None]]:
    """Enqueue one job of ``n`` new tokens per prompt on ``gen`` (a :class:`~exl3_core.generator.Generator`, no
    stop at EOS) and iterate until every job ends: per prompt, its tokens and, with ``logits``, their logits
    ``[n, vocab]`` (None without)."""
    from exl3_core.generator import Job

    jobs = [Job(p, max_new_tokens=n, stop_at_eos=False, identifier=i, return_logits=logits)
            for i, p in enumerate(prompts)]
    gen.enqueue(jobs)
    toks: dict[int, list[int]] = {i: [] for i in range(len(jobs))}
    lg: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(jobs))}
    while gen.num_remaining():
        for r in gen.iterate():
            toks[r["identifier"]] += r["token_ids"]
            if logits and len(r.get("logits", [])):
                lg[r["identifier"]].append(r["logits"])
    return [(toks[i], torch.cat(lg[i]) if logits else None) for i in range(len(jobs))]
