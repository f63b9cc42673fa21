"""Device states go to pinned memory on a side stream; the file must hold exactly what the
device held when submitted, even though the caller frees that memory right away."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from exl3_core.convert.workdir import Job, StatesCommitter, WorkDir


def test_device_states_commit_bit_exact_after_the_source_is_freed(tmp_path: Path) -> None:
    dev = torch.device("cuda")
    work = WorkDir(tmp_path)
    c = StatesCommitter(work)
    job = Job(args={}, source={}, done=1)
    for step in range(3):
        x = torch.randn(64, 256, 512, device=dev)
        xf = torch.randn(64, 256, 512, device=dev)
        want = torch.stack([x, xf]).cpu() if step == 1 else x.cpu()
        c.submit(job, step, [x, xf] if step == 1 else [x])
        del x, xf  # freed at once: the caching allocator must not hand the block out before the copy
        junk = torch.full((64, 256, 512), 7.0, device=dev)  # would reuse it and overwrite it
        c.wait()
        del junk
        saved = json.loads(work.job_file.read_text())
        assert saved["states"] == f"states-{step:04d}.safetensors"
        assert torch.equal(work.load_states(saved["states"]), want)
