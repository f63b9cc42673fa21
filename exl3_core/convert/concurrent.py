"""Run independent GPU jobs (the linears of one stage) side by side, one CUDA stream each.

One linear's LDLQ is a chain of 16-row steps, each a tile-encoder launch plus a few small kernels;
a narrow linear (an 8B model's k_proj/v_proj: 64 tiles per step, 32 encoder blocks for 132 SMs)
leaves most of the GPU idle, and every step of every linear drains the GPU once. Streams let the
encoder launches of q/k/v/o/gate/up/down overlap. The jobs share nothing they write, each one's
kernels and their order are unchanged, so results are bit-identical to running them one by one.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")

#: concurrent jobs at most (each holds a few fp32 copies of its weight on the device)
MAX_WORKERS = 8


def run_on_streams(jobs: Sequence[Callable[[], T]], device: torch.device, workers: int = MAX_WORKERS) -> list[T]:
    """``[job() for job in jobs]``, on CUDA with up to ``workers`` threads, each job on a fresh stream
    that first waits for the caller's stream (so the jobs see every input it produced). Results come
    back in order; the first error is raised after all jobs have stopped. On other devices, or for
    a single job, the jobs simply run in order."""
    if device.type != "cuda" or len(jobs) < 2 or workers < 2:
        return [job() for job in jobs]
    caller = torch.cuda.current_stream(device)

    def on_stream(job: Callable[[], T]) -> T:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(caller)
        with torch.cuda.device(device), torch.cuda.stream(stream), torch.no_grad():
            out = job()
        stream.synchronize()  # the job's device work is done before its result is used elsewhere
        return out

    with ThreadPoolExecutor(max_workers=min(workers, len(jobs)), thread_name_prefix="exl3-quant") as pool:
        futures = [pool.submit(on_stream, job) for job in jobs]
        results = []
        error: BaseException | None = None
        for f in futures:
            try:
                results.append(f.result())
            except BaseException as e:  # noqa: BLE001 - keep waiting for the others, raise the first
                error = error or e
    if error is not None:
        raise error
    return results
