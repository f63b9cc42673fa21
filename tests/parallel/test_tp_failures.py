"""Failures of a tensor-parallel group end in clear errors, within a bound, with no process left behind: a
size the heads do not allow and shares beyond the memory are refused before any worker starts; a rank that
cannot allocate is named and the group stays usable; a killed worker, and one that stops answering, fail the
group at the next step (within the timeout), after which the model refuses work until loaded again."""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tp_support import ARCHS, alive

from exl3_core import settings
from exl3_core.archkit import Config, Model
from exl3_core.archkit.batch import BatchMeta
from exl3_core.cache import Cache
from exl3_core.devmem import InsufficientDeviceMemory
from exl3_core.parallel import ParallelError, WorkerGroup
from exl3_core.parallel import memory as tp_memory
from exl3_core.parallel.comm import meta_header
from exl3_core.parallel.protocol import Forward
from exl3_core.testing.arch import build_checkpoint, tiny_variants
from exl3_core.testing.parallel import RankFailingSource
from exl3_core.tuning import Tuning


def _model(checkpoints: dict, arch: str = "llama", fmt: str = "dense") -> Model:
    return Model.from_config(Config.from_directory(checkpoints[(arch, fmt)]))


def _children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children() if p.pid is not None}


@pytest.mark.parametrize("size,match", [(3, "num_attention_heads"), (8, "num_attention_heads")])
def test_sizes_the_heads_do_not_allow_are_refused_before_any_worker_starts(size: int, match: str,
                                                                             checkpoints: dict) -> None:
    before = _children()
    model = _model(checkpoints)
    with pytest.raises(ValueError, match=match) as e:
        model.load(device="cpu", tensor_parallel_size=size)
    assert f"tensor_parallel_size={size}" in str(e.value)
    assert _children() == before and not model.loaded


def test_experts_fewer_than_ranks_are_refused(tmp_path: Path) -> None:
    """Expert parallel over more ranks than experts: some rank would hold none."""
    hf_arch, variant, resize = ARCHS["qwen3moe"]
    cfg = tiny_variants(hf_arch)[variant]
    cfg.update({**resize, "num_experts": 2, "num_experts_per_tok": 1})
    build_checkpoint(hf_arch, cfg, tmp_path, seed=1)
    before = _children()
    model = Model.from_config(Config.from_directory(tmp_path))
    with pytest.raises(ValueError, match=r"with expert parallelism: 2 experts of model\.layers\.1\.mlp are fewer "
                                         r"than tensor_parallel_size=4"):
        model.load(device="cpu", tensor_parallel_size=4, expert_parallel=True)
    assert _children() == before and not model.loaded


@pytest.mark.parametrize("kwargs,match", [
    ({"devices": ["cpu", "cuda:0"]}, "all 'cpu' or all 'cuda'"),
    ({"devices": ["cpu", "cpu"], "tensor_parallel_size": 3}, "tensor_parallel_size=3 but 2 devices"),
    ({"device": "cpu", "tensor_parallel_size": 0}, "at least 1"),
])
def test_device_arguments_that_disagree_are_refused(kwargs: dict, match: str, checkpoints: dict) -> None:
    with pytest.raises(ValueError, match=match):
        _model(checkpoints).load(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without those GPUs")
def test_missing_gpus_are_refused(checkpoints: dict) -> None:
    with pytest.raises(ValueError, match="do not exist"):
        _model(checkpoints).load(device="cuda", tensor_parallel_size=2)


def test_shares_beyond_host_memory_are_refused_before_any_worker_starts(checkpoints: dict,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    before = _children()
    model = _model(checkpoints)
    monkeypatch.setattr(tp_memory, "host_available_bytes", lambda: 1 << 20)
    with pytest.raises(InsufficientDeviceMemory) as e:
        model.load(device="cpu", tensor_parallel_size=2)
    msg = str(e.value)
    assert "rank 0 (cpu)" in msg and "rank 1 (cpu)" in msg and "1.0 MiB is available" in msg
    assert _children() == before and not model.loaded


def test_a_rank_that_cannot_allocate_is_named_and_the_group_stays_usable(checkpoints: dict, cpu_groups) -> None:
    group = cpu_groups(2)
    directory = checkpoints[("llama", "dense")]
    model = _model(checkpoints)
    source = RankFailingSource(directory, rank=1, tensor="model.layers.1.mlp.down_proj.weight")
    cache = Cache(model, max_num_tokens=64, page_size=16)
    planned = cache.geometry
    with pytest.raises(ParallelError, match=r"rank 1 \(cpu\): OutOfMemoryError: could not allocate "
                                            r"model\.layers\.1\.mlp\.down_proj\.weight"):
        model.load(parallel_group=group, source=source, caches=[cache])
    assert not model.loaded and model.parallel is None
    assert not cache.allocated and cache.geometry == planned, "a failed load leaves the caches as they were given"
    assert group.failure is None
    model.load(parallel_group=group)  # the same group loads the model once the source is sound
    try:
        ref = Model.from_config(Config.from_directory(directory)).load(device="cpu")
        ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(1))
        assert float((model.forward(ids) - ref.forward(ids)).abs().max()) <= 1e-5
    finally:
        model.unload()


def test_a_killed_worker_fails_the_group_and_the_model_refuses_work(checkpoints: dict,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXL3_TP_TIMEOUT", "20")
    settings.reload()
    try:
        before = _children()
        model = _model(checkpoints)
        model.load(device="cpu", tensor_parallel_size=2)  # starts (and owns) its own group
        assert model.parallel is not None
        group = model.parallel.group  # type: ignore[attr-defined]
        ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(2))
        model.forward(ids)
        (pid,) = group.pids()
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ParallelError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL"):
            model.forward(ids)
        with pytest.raises(ParallelError, match="unusable: worker rank 1"):
            model.forward(ids)
        assert time.monotonic() - t0 < 20
        model.unload()
        assert not model.loaded and not alive(pid) and _children() == before
    finally:
        monkeypatch.delenv("EXL3_TP_TIMEOUT")
        settings.reload()


def test_a_worker_that_stops_answering_times_out(checkpoints: dict) -> None:
    before = _children()
    group = WorkerGroup(["cpu", "cpu"], timeout=3)
    try:
        model = _model(checkpoints)
        model.load(parallel_group=group)
        ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(3))
        model.forward(ids)
        (pid,) = group.pids()
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(ParallelError, match="step failed.*[Tt]imed out"):
            model.forward(ids)
        assert time.monotonic() - t0 < 15
        assert group.failure is not None and not alive(pid)
        with pytest.raises(ParallelError, match="unusable"):
            model.forward(ids)
        model.unload()
    finally:
        group.close()
    assert _children() == before


def test_a_worker_whose_step_raises_is_reported_with_its_error(checkpoints: dict) -> None:
    """A worker that cannot run a step says why before it leaves; the next step reports it (here the step names
    a cache the worker does not have, so only the worker fails)."""
    before = _children()
    group = WorkerGroup(["cpu", "cpu"], timeout=10)
    try:
        model = _model(checkpoints)
        model.load(parallel_group=group)
        meta = BatchMeta.full(torch.tensor([[1, 2, 3]]))
        group.send(Forward(model.parallel.model_id, 12345, meta_header(meta), Tuning.generic()))  # type: ignore[union-attr]
        with pytest.raises(ParallelError, match=r"rank 1 \(cpu\) failed a step: KeyError: \(\d+, 12345\)"):
            model.forward(torch.tensor([[1, 2, 3]]))
        model.unload()
    finally:
        group.close()
    assert _children() == before


def test_workers_leave_when_rank_0_dies(tmp_path: Path) -> None:
    """Rank 0 killed outright (no clean-up runs): its workers notice and exit."""
    script = tmp_path / "rank0.py"
    script.write_text("import sys\n"
                      "from exl3_core.parallel import WorkerGroup\n"
                      "if __name__ == '__main__':\n"
                      "    g = WorkerGroup(['cpu', 'cpu'])\n"
                      "    print(*g.pids(), flush=True)\n"
                      "    sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        (pid,) = [int(p) for p in proc.stdout.readline().split()]
        assert alive(pid)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(pid), "a worker outlived rank 0"
    finally:
        if proc.poll() is None:
            proc.kill()
