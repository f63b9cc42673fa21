"""Every registered architecture: incremental decode through the paged cache (chunked prefill of
uneven sizes, padded batched decode) equals one full forward, and the Generator's greedy tokens
are the argmax of a full forward over the sequence it produced."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from exl3_core.generator.batching import Chunk, build_batch
from exl3_core.plugins import get_plugins
from exl3_core.testing.arch import build_checkpoint, rel_err, tiny_variants

pytest.importorskip("transformers")

PAGE = 16
LENS = [70, 45, 40]
# uneven prefill chunks (crossing page boundaries), then one token per step; three rows decode
# together for a while, so the decode batch is padded to its bucket of 4 (scratch-page row)
SCHEDULE = [[23, 5, 20], [30, 29, 10], [7, 1, 5]]
TOL = 1e-4


def _cases() -> list[Any]:
    plugins = get_plugins()
    out = []
    seen = set()
    for spec in plugins.architectures().values():
        if spec.test_config is None or spec.hf_arch in seen:
            continue
        seen.add(spec.hf_arch)
        try:
            variants = tiny_variants(spec.hf_arch, plugins)
        except Exception as e:  # noqa: BLE001 - reported as a failing case below
            out.append(pytest.param(spec.hf_arch, None, e, id=f"{spec.hf_arch}-config-error"))
            continue
        for name, cfg in variants.items():
            out.append(pytest.param(spec.hf_arch, name, cfg, id=f"{spec.hf_arch}-{name}"))
    return out


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _load(hf_arch: str, cfg: Any, tmp: Path) -> Any:
    from exl3_core.archkit import Config, Model

    build_checkpoint(hf_arch, cfg, tmp / "ckpt", seed=0)
    model = Model.from_config(Config.from_directory(tmp / "ckpt"))
    model.load(device="cpu", dtype=torch.float32)
    return model


@pytest.mark.parametrize(("hf_arch", "variant", "cfg"), _cases())
def test_incremental_equals_full(hf_arch: str, variant: str | None, cfg: Any, tmp_path: Path) -> None:
    if isinstance(cfg, Exception):
        raise cfg
    from exl3_core.cache import Cache
    from exl3_core.generator import Generator, Job

    model = _load(hf_arch, cfg, tmp_path)
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in LENS]
    with torch.no_grad():
        ref = [model(torch.tensor([s]))[0] for s in seqs]
        cache = Cache(model, max_num_tokens=PAGE * 24, page_size=PAGE)
        perm = torch.randperm(cache.num_pages, generator=g).tolist()  # non-contiguous pages
        pages, k = [], 0
        for n in LENS:
            need = -(-n // PAGE)
            pages.append(perm[k:k + need])
            k += need
        done = [0] * len(LENS)
        worst = 0.0
        steps = [list(s) for s in SCHEDULE]
        while any(d < n for d, n in zip(done, LENS)):
            step = steps.pop(0) if steps else [1 if d < n else 0 for d, n in zip(done, LENS)]
            live = [b for b in range(len(LENS)) if step[b] > 0]
            chunks = [Chunk(seqs[b][done[b]:done[b] + step[b]], done[b], pages[b], True) for b in live]
            decode = all(step[b] == 1 for b in live)
            meta, rows = build_batch(chunks, page_size=PAGE, table_width=8, scratch_page=cache.scratch_page,
                                     device=model.device, decode=decode)
            logits = model.forward_batch(meta, cache)[rows]
            for i, b in enumerate(live):
                done[b] += step[b]
                worst = max(worst, rel_err(logits[i], ref[b][done[b] - 1]))
        assert worst <= TOL, f"{hf_arch}/{variant}: paged incremental logits differ by {worst:.3g}"

        # the Generator end to end: greedy tokens are the full-forward argmax of what it produced
        gen = Generator(model, Cache(model, max_num_tokens=PAGE * 16, page_size=PAGE), None, max_chunk_tokens=40)
        gen.eos_ids = set()
        jobs = [Job(seqs[b][:n], max_new_tokens=6, identifier=b) for b, n in enumerate([50, 17])]
        gen.enqueue(jobs)
        while gen.num_remaining():
            gen.iterate()
        for j in jobs:
            full = model(torch.tensor([j.seq]))[0]
            assert full[len(j.prompt) - 1:-1].argmax(-1).tolist() == j.seq[len(j.prompt):], f"{hf_arch}/{variant}"
        assert gen.cache.allocator.num_live() == 0
    model.unload()
