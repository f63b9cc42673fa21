"""The generator's side of LoRA: per-job checks, each step's per-row choice, and what a load or unload
while jobs run means for the generator.

* a job naming adapters that are not loaded is refused when it is enqueued;
* before every forward the step's rows get their jobs' adapters (padding rows none), in the model's
  :class:`~exl3_core.lora.selection.Selection` that the step's kernels (and graphs) read;
* a job's prefix-cache chain starts from a root salted with its adapters (identified per load, not by
  name), since its keys and values differ from the base model's: prompts share cached pages only with
  jobs of the same choice;
* when adapters were loaded or unloaded since the last step, the captured CUDA graphs (which hold the old
  tensors' addresses) are dropped and captured again as steps need them, and jobs naming an adapter no
  longer loaded end with an error while the others go on.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

from exl3_core.cache.cache import Cache
from exl3_core.cache.pages import ROOT_HASH
from exl3_core.generator.batching import bucket_size
from exl3_core.generator.graphs import DecodeGraphs, PrefillGraphs
from exl3_core.generator.job import Job
from exl3_core.lora.config import LoraError
from exl3_core.lora.registry import LoraSet, attached
from exl3_core.plan.plan import ExecutionPlan


class GraphHost(Protocol):
    """What :meth:`StepLoras.refresh` replaces on the generator."""

    plan: ExecutionPlan
    cache: Cache
    table_width: int
    max_chunk_tokens: int
    max_batch_size: int
    graphs: DecodeGraphs | None
    prefill_graphs: PrefillGraphs | None


class StepLoras:
    """LoRA bookkeeping of one generator (see the module docstring).

    :param model: the generator's model (adapters found on it when loaded, see :func:`attached`).
    """

    def __init__(self, model: object) -> None:
        self.model = model
        self._seen: tuple[int, int, int] | None = None

    def adapters(self) -> LoraSet | None:
        s = attached(self.model)  # type: ignore[arg-type]
        return s if s is not None and s.adapters else None

    def check(self, job: Job) -> None:
        """Refuse a job naming an adapter that is not loaded (at enqueue; :class:`LoraError` is a ValueError)."""
        if not job.loras:
            return
        s = attached(self.model)  # type: ignore[arg-type]
        if s is None:
            raise LoraError(f"the job names LoRA adapters {sorted(job.loras)} but none is loaded; load them with "
                            f"model.load_lora(path, name)")
        s.slots_of(job.loras)

    def hash_root(self, job: Job) -> bytes:
        """The root of ``job``'s prefix-cache chain: the plain root for the base model, else salted with the
        identity of each adapter load and its weight."""
        if not job.loras:
            return ROOT_HASH
        s = attached(self.model)  # type: ignore[arg-type]
        assert s is not None
        h = hashlib.blake2b(ROOT_HASH, digest_size=16)
        for name in sorted(job.loras):
            h.update(f"|{s.adapters[name].uid}:{job.loras[name]!r}".encode())
        return h.digest()

    def unloaded(self, jobs: Sequence[Job]) -> list[tuple[Job, LoraError]]:
        """The jobs among ``jobs`` that name an adapter no longer loaded (or loaded again since: another load's
        weights), with the error each ends with."""
        out = []
        s = attached(self.model)  # type: ignore[arg-type]
        for j in jobs:
            if not j.loras:
                continue
            gone = [n for n in sorted(j.loras) if s is None or n not in s.adapters
                    or j.lora_uids.get(n, s.adapters[n].uid) != s.adapters[n].uid]
            if gone:
                out.append((j, LoraError(f"LoRA adapter(s) {', '.join(map(repr, gone))} named by this job were unloaded "
                                         f"while it ran")))
        return out

    def bind(self, job: Job) -> None:
        """Record which load of each adapter ``job`` runs with (an adapter unloaded and loaded again under the same
        name is another adapter for a running job)."""
        s = attached(self.model)  # type: ignore[arg-type]
        if job.loras and s is not None:
            job.lora_uids = {n: s.adapters[n].uid for n in job.loras if n in s.adapters}
            job.hash_root = self.hash_root(job)

    def changed(self, rows: int) -> bool:
        """Reserve ``rows`` rows in the choice's buffers; whether adapters were loaded or unloaded (or the buffers
        grew) since the last call. The first call only records the state (False)."""
        s = attached(self.model)  # type: ignore[arg-type]
        if s is not None:
            s.selection.reserve(rows)
        key = (0, 0, 0) if s is None else (id(s), s.generation, s.selection.version)
        previous, self._seen = self._seen, key
        return previous is not None and previous != key

    def refresh(self, gen: GraphHost, rows_per_seq: int = 1) -> bool:
        """Reserve the generator's largest step (a prefill chunk, or a decode step of up to ``rows_per_seq`` rows
        for each sequence of its batch bucket) in the choice's buffers; after adapters were loaded or unloaded (or
        the buffers grew) since the last call, drop the captured graphs (created again, captured as steps need
        them). The first call only records the state (the generator's graphs were just made for it). True when
        the graphs were dropped."""
        rows = max(gen.max_chunk_tokens, rows_per_seq * bucket_size(max(gen.max_batch_size, 1)))
        if not self.changed(rows):
            return False
        # adapters on experts can make a module's forward uncapturable, so whether to graph is asked again
        gen.graphs = DecodeGraphs.renew(gen.graphs, gen.plan, gen.cache, gen.table_width)
        if gen.prefill_graphs is not None:
            gen.prefill_graphs.reset()
        gen.prefill_graphs = PrefillGraphs.create(gen.plan, gen.cache, gen.table_width, gen.max_chunk_tokens)
        return True

    def select(self, rows: Sequence[tuple[Job | None, int]], total: int) -> None:
        """The next forward's choice: ``rows`` are ``(job, row count)`` in row order (None: no adapter), and rows
        up to ``total`` (padding) use none."""
        s = self.adapters()
        if s is None:
            return
        groups = [(s.slots_of(j.loras) if j is not None and j.loras else {}, n) for j, n in rows]
        pad = total - sum(n for _, n in rows)
        if pad > 0:
            groups.append(({}, pad))
        s.select(groups)
