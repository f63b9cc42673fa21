"""The collectives of a tensor-parallel group over one torch.distributed process group (gloo on the CPU,
NCCL on CUDA), and how a step's metadata and logits travel through them.

The group is a process group *object* built from a store (not the process-wide default group), so a
process may hold several (one per :class:`~exl3_core.parallel.WorkerGroup`) and a user's own
``init_process_group`` is never disturbed. Every collective has the group's timeout: a rank that died
or hangs makes the others' call raise (gloo: the timeout or the closed connection; NCCL: its watchdog
aborts the communicator), which :class:`GroupComm` reports as a :class:`ParallelError`.
"""
from __future__ import annotations

import datetime
import os
import re
from typing import Any

import torch
import torch.distributed as dist

from exl3_core.archkit.batch import BatchMeta
from exl3_core.parallel.protocol import MetaHeader, ParallelError


def short_error(e: BaseException) -> str:
    """A collective's error without the backend's source location and advice boilerplate."""
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", str(e)).strip()
    return text.split(". This is typically caused by")[0]


def backend_for(device: torch.device) -> str:
    """The collective backend of a device type: NCCL between GPUs, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


class GroupComm:
    """One rank's view of the group: the :class:`~exl3_core.nn.module.Communicator` a sharded forward reduces
    through, plus the broadcast and gather a step needs.

    :param pg: the process group backend (``ProcessGroupGloo`` / ``ProcessGroupNCCL``).
    :param rank: this rank.
    :param world: ranks in the group.
    :param device: this rank's device (where its tensors live).
    """

    def __init__(self, pg: Any, rank: int, world: int, device: torch.device, timeout: float) -> None:
        self.pg = pg
        self.rank = rank
        self.world = world
        self.device = device
        #: seconds a collective may take
        self.timeout = timeout

    @classmethod
    def connect(cls, store: dist.Store, rank: int, world: int, device: torch.device, *, timeout: float,
                connect_timeout: float) -> GroupComm:
        """Join the group (blocks until every rank joined, at most ``connect_timeout`` seconds); collectives
        then time out after ``timeout`` seconds."""
        prefix = dist.PrefixStore("exl3-tp", store)
        step = datetime.timedelta(seconds=timeout)
        if backend_for(device) == "nccl":
            # a failed collective aborts the communicator and raises here; the default tears the process down
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
            torch.cuda.set_device(device)
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = False
            opts._timeout = step  # the watchdog aborts a collective that waits longer, so nothing hangs
            pg: Any = dist.ProcessGroupNCCL(prefix, rank, world, opts)
        else:
            pg = dist.ProcessGroupGloo(prefix, rank, world, datetime.timedelta(seconds=connect_timeout))
            pg.set_timeout(step)
        return cls(pg, rank, world, device, timeout)

    def _wait(self, work: Any, what: str, bounded: bool = False) -> None:
        """Wait for ``work``: on NCCL the stream waits and the host goes on, unless ``bounded``: then the host
        blocks until it is done, at most the group's timeout (the step's last collective does, so a step
        never hands out logits of a collective the watchdog aborted)."""
        try:
            if bounded:
                work.wait(datetime.timedelta(seconds=self.timeout))
            else:
                work.wait()
        except RuntimeError as e:
            raise ParallelError(f"the {what} on rank {self.rank} of {self.world} failed: {short_error(e)}") from e

    # -- Communicator ---------------------------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of ``t`` over the ranks (every rank gets it)."""
        t = t.contiguous()
        self._wait(self.pg.allreduce([t]), "all_reduce")
        return t

    # -- a step's traffic -------------------------------------------------------------------------------------------
    def broadcast_(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """``t`` (contiguous, the same shape on every rank) overwritten by rank ``root``'s."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._wait(self.pg.broadcast([t], opts), "broadcast")
        return t

    def gather_logits(self, local: torch.Tensor, shares: list[tuple[int, int]]) -> torch.Tensor | None:
        """Every rank's vocabulary slice of the step's logits (``shares[r]`` its range), joined on rank 0; None
        elsewhere. Slices are padded to the widest one, as the collective wants equal shapes."""
        width = max(b - a for a, b in shares)
        rows = local.shape[0]
        if rows == 0:
            return local.new_empty((0, shares[-1][1])) if self.rank == 0 else None
        mine = local if local.shape[1] == width else torch.nn.functional.pad(local, (0, width - local.shape[1]))
        mine = mine.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            parts = [torch.empty_like(mine) for _ in range(self.world)]
            self._wait(self.pg.gather([parts], [mine], opts), "logits gather", bounded=True)
            return torch.cat([p[:, : b - a] for p, (a, b) in zip(parts, shares)], dim=1)
        self._wait(self.pg.gather([], [mine], opts), "logits gather")
        return None

    def shutdown(self) -> None:
        """Drop the group's connections (best effort: a broken group may refuse)."""
        for name in ("abort", "shutdown"):
            fn = getattr(self.pg, name, None)
            if fn is None:
                continue
            try:
                fn()
                return
            except RuntimeError:
                continue


# -- the metadata of a step ---------------------------------------------------------------------------------------
def meta_header(meta: BatchMeta) -> MetaHeader:
    """The host-side shape of ``meta`` (no device read: sizes and Python bounds only)."""
    pt = meta.page_table
    return MetaHeader(tokens=meta.input_ids.shape[0], seqs=meta.batch_size,
                      table_width=0 if pt is None else pt.shape[1],
                      logits_rows=-1 if meta.logits_indices is None else meta.logits_indices.shape[0],
                      has_slots=meta.slot_mapping is not None, max_seqlen_q=meta.max_seqlen_q,
                      max_seqlen_k=meta.max_seqlen_k, phase=meta.phase)


def pack_meta(meta: BatchMeta, device: torch.device) -> torch.Tensor:
    """``meta``'s tensors as one int64 vector on ``device`` (:func:`unpack_meta` reverses it)."""
    parts = [meta.input_ids, meta.positions, meta.cu_seqlens_q, meta.seq_lens_k]
    for t in (meta.page_table, meta.slot_mapping, meta.logits_indices):
        if t is not None:
            parts.append(t)
    return torch.cat([p.reshape(-1).to(device=device, dtype=torch.int64) for p in parts])


def unpack_meta(h: MetaHeader, buf: torch.Tensor) -> BatchMeta:
    """The :class:`BatchMeta` that :func:`pack_meta` packed into ``buf`` (shapes from ``h``)."""
    t, b = h.tokens, h.seqs
    sizes = [t, t, b + 1, b, b * h.table_width, t if h.has_slots else 0, max(h.logits_rows, 0)]
    ids, pos, cu, lens, table, slots, rows = buf.split(sizes)
    return BatchMeta(
        input_ids=ids, positions=pos, cu_seqlens_q=cu.to(torch.int32), seq_lens_k=lens.to(torch.int32),
        max_seqlen_q=h.max_seqlen_q, max_seqlen_k=h.max_seqlen_k, phase=h.phase,
        page_table=table.to(torch.int32).view(b, h.table_width) if h.table_width else None,
        slot_mapping=slots if h.has_slots else None,
        logits_indices=rows if h.logits_rows >= 0 else None)
