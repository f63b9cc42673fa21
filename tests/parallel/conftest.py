"""Shared by the tensor-parallel tests: worker groups (started once per session: spawned processes are slow
on a small CPU), and tiny checkpoints of three architectures, dense and EXL3, sized so every cut exists
(head dim 128, 128-feature blocks for every rank at 4 ranks, fewer KV heads than ranks)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tp_support import ARCHS, Groups, keep_dense

from exl3_core.testing.arch import build_checkpoint, tiny_variants
from exl3_core.testing.parallel import exl3_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """``(arch, "dense" | "exl3") -> directory`` for every arch of :data:`ARCHS`."""
    root = tmp_path_factory.mktemp("tp_ckpt")
    out = {}
    for name, (hf_arch, variant, resize) in ARCHS.items():
        cfg = tiny_variants(hf_arch)[variant]
        cfg.update(resize)
        dense = root / f"{name}_dense"
        build_checkpoint(hf_arch, cfg, dense, seed=3)
        out[(name, "dense")] = dense
        out[(name, "exl3")] = exl3_checkpoint(dense, root / f"{name}_exl3", keep_dense=keep_dense, seed=5)
    return out


@pytest.fixture(scope="session")
def cpu_groups() -> Iterator[Groups]:
    groups = Groups()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # rank 0 is one of several processes on few cores
    try:
        yield groups
    finally:
        torch.set_num_threads(threads)
        groups.close()
