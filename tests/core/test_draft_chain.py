"""The draft chain (exl3_core.generator.draft_chain): one-token draft steps advanced on the device equal the
step-by-step loop. On the CPU the chain's program runs eagerly in place of the graph (tests/gpu replays it)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.cache import Cache
from exl3_core.generator.batching import Chunk, build_batch
from exl3_core.generator.draft_chain import advance, chain_steps
from exl3_core.generator.drafting import ModelDrafter
from exl3_core.generator.job import Job
from exl3_core.generator.toy import ToyModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 264


def test_advance_equals_the_host_built_next_step() -> None:
    """Advanced j times, step 1's inputs are what the host builds for step j + 1: real rows' positions, key
    counts and cache slots (across page boundaries), and padded rows stay on the scratch page."""
    g = torch.Generator().manual_seed(0)
    ps, W, scratch = 8, 6, 0
    lens = [5, 14, 23]  # the sequences' lengths at step 1; bucket 4 pads one row
    pages = [torch.randperm(40, generator=g)[:W].add(1).tolist() for _ in lens]

    def meta(j: int) -> BatchMeta:
        chunks = [Chunk([0], n + j, p, True) for n, p in zip(lens, pages)]
        return build_batch(chunks, page_size=ps, table_width=W, scratch_page=scratch, device=torch.device("cpu"),
                           decode=True)[0]

    m = meta(0)
    assert m.batch_size == 4
    for j in range(1, 9):
        advance(m, ps)
        want = meta(j)
        assert m.slot_mapping is not None and want.slot_mapping is not None
        assert m.positions[:3].tolist() == want.positions[:3].tolist()
        assert m.seq_lens_k[:3].tolist() == want.seq_lens_k[:3].tolist()
        assert m.slot_mapping[:3].tolist() == want.slot_mapping[:3].tolist()
        assert int(m.slot_mapping[3]) // ps == scratch


class EagerChain:
    """DraftChain's contract run eagerly: the chain's program over the host-built inputs."""

    def __init__(self, d: ModelDrafter) -> None:
        self.d = d
        self.calls = 0

    def accepts(self, meta: BatchMeta, steps: int) -> bool:
        return True

    def run(self, meta: BatchMeta, first: torch.Tensor, steps: int, forced: torch.Tensor | None = None) -> torch.Tensor:
        B = meta.batch_size
        meta.input_ids[:first.shape[0]].copy_(first)
        out = torch.zeros((B, steps), dtype=torch.int64)
        pad = None
        if forced is not None:
            pad = torch.zeros((B, steps), dtype=torch.int64)
            pad[:forced.shape[0]] = forced
        chain_steps(self.d.plan, self.d.cache, meta, steps, out, pad)
        self.calls += 1
        return out


class Forcing(ModelDrafter):
    """Proposes fixed pseudo-random tokens (the bench's stand-in draft) while running every draft forward."""

    def _forced(self, jobs: list[Job], seqs: Sequence[list[int]], K: int) -> torch.Tensor | None:
        return torch.tensor([[(31 * len(s) + 7 * i + j.identifier) % V for i in range(K)] for j, s in zip(jobs, seqs)])


def _drafter(cls: type[ModelDrafter], draft: ToyModel, plugins: Any, chain: bool) -> ModelDrafter:
    d = cls(draft, Cache(draft, 2048, page_size=8, plugins=plugins), max_seq_len=256)
    d.chain = EagerChain(d) if chain else None  # type: ignore[assignment]
    return d


def _rounds(d: ModelDrafter, K: int) -> list[list[list[int]]]:
    """Three proposals for three greedy jobs of different lengths (a padded bucket), each job accepting part of
    its drafts between them; the drafts of every proposal."""
    jobs = [Job(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist(),
                max_new_tokens=64, identifier=i) for i, n in enumerate((13, 30, 7))]
    out = []
    for r in range(3):
        prop = d.propose(jobs, [K] * len(jobs))
        assert prop.ids is not None
        drafted = prop.ids.tolist()
        out.append(drafted)
        for b, j in enumerate(jobs):
            keep = (b + r) % K
            j.seq += drafted[b][:keep] + [(drafted[b][keep] + 1) % V]
            d.commit(j, drafted[b])
    return out


@pytest.mark.parametrize("cls", [ModelDrafter, Forcing], ids=["greedy", "forced"])
@pytest.mark.parametrize("K", [2, 5])
def test_chain_drafts_equal_step_by_step(plugins, cls: type[ModelDrafter], K: int) -> None:
    """Greedy and forced proposals over rounds with partial acceptance: the chain gives the step-by-step drafts
    and runs once per proposal; the draft caches end up holding the same keys (the next round's drafts agree)."""
    draft = ToyModel(vocab_size=V, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, seed=5)
    ref = _rounds(_drafter(cls, draft, plugins, chain=False), K)
    d = _drafter(cls, draft, plugins, chain=True)
    got = _rounds(d, K)
    assert got == ref
    assert isinstance(d.chain, EagerChain) and d.chain.calls == 3
    if cls is ModelDrafter:  # greedy drafts are the draft's own picks: the chain's logits decided them
        assert len({tuple(x) for rnd in got for x in rnd}) > 3
