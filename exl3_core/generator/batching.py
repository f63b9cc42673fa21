"""Build :class:`~exl3_core.archkit.batch.BatchMeta` for one generator step.

Two shapes:

* *mixed* steps (any prefill chunk present): packed varlen batch of every scheduled job's new
  tokens, logits only for rows that end a job's scheduled input and need a sample;
* *decode* steps (one token per job): the batch is padded to a size bucket and the page table
  to a fixed width, padded rows write into the cache's scratch page and read nothing else, and
  every row yields logits. Shapes depend only on the bucket, so a CUDA graph per bucket can
  replay the step.

Everything is built on the host with numpy and copied to the device once per tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from exl3_core.archkit.batch import BatchMeta

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def bucket_size(n: int) -> int:
    """Smallest decode bucket holding ``n`` rows (multiples of 128 past the table)."""
    for b in DECODE_BUCKETS:
        if n <= b:
            return b
    return -(-n // 128) * 128


@dataclass
class Chunk:
    """New tokens of one job in this step.

    :param tokens: the ids to run.
    :param past: tokens of this job already in the cache (the chunk starts at this position).
    :param pages: the job's page list, covering at least ``past + len(tokens)`` tokens.
    :param want_logits: whether the chunk's last token needs logits (sampling).
    :param ring_slot: the job's ring slot for per-sequence cache state (recent rows); -1: none (every chunk of
        a step has one, or none does)
    """

    tokens: list[int]
    past: int
    pages: list[int]
    want_logits: bool
    ring_slot: int = -1


def build_batch(chunks: list[Chunk], *, page_size: int, table_width: int, scratch_page: int,
                device: torch.device, decode: bool) -> tuple[BatchMeta, list[int]]:
    """Metadata for ``chunks`` plus, per chunk wanting logits, its row in the returned logits (the row of its
    last token). A decode step carries the same number k of tokens in every chunk (1, or more to verify
    drafted tokens); sequence b's rows are then ``b*k .. b*k+k-1``, all with logits."""
    B_real = len(chunks)
    B = bucket_size(B_real) if decode else B_real
    k = len(chunks[0].tokens) if decode and chunks else 1
    if decode and any(len(c.tokens) != k for c in chunks):
        raise ValueError(f"a decode step carries the same number of tokens per sequence, got "
                         f"{[len(c.tokens) for c in chunks]}")
    table = np.full((B, table_width), scratch_page, dtype=np.int32)
    lens_q = np.full(B, k, dtype=np.int64)
    lens_k = np.full(B, k, dtype=np.int32)
    rings = [c.ring_slot for c in chunks]
    if any(r < 0 for r in rings) and any(r >= 0 for r in rings):
        raise ValueError(f"build_batch: every chunk of a step names a ring slot or none does, got {rings}")
    # padded rows take ring slot 0, the scratch slot
    ring_slots = np.zeros(B, dtype=np.int32) if rings and rings[0] >= 0 else None
    if ring_slots is not None:
        ring_slots[:B_real] = rings
    ids_parts, pos_parts, slot_parts = [], [], []
    for b, c in enumerate(chunks):
        n = len(c.tokens)
        if len(c.pages) > table_width:
            raise ValueError(f"sequence needs {len(c.pages)} pages but the page table holds {table_width}; "
                             f"raise the generator's max_seq_len")
        table[b, :len(c.pages)] = c.pages
        lens_q[b] = n
        lens_k[b] = c.past + n
        pos = np.arange(c.past, c.past + n, dtype=np.int64)
        pages = np.asarray(c.pages, dtype=np.int64)
        ids_parts.append(np.asarray(c.tokens, dtype=np.int64))
        pos_parts.append(pos)
        slot_parts.append(pages[pos // page_size] * page_size + pos % page_size)
    pad = B - B_real
    if pad:  # padded sequences: k rows each at positions 0..k-1, writing the scratch page only
        ids_parts.append(np.zeros(pad * k, dtype=np.int64))
        pos_parts.append(np.tile(np.arange(k, dtype=np.int64), pad))
        slot_parts.append(np.full(pad * k, scratch_page * page_size, dtype=np.int64))
    cu = np.zeros(B + 1, dtype=np.int32)
    np.cumsum(lens_q, out=cu[1:])
    logit_rows: list[int] = []
    if decode:
        logits_indices = None  # every row's logits, fixed shape
        logit_rows = [b * k + k - 1 for b, c in enumerate(chunks) if c.want_logits]
    else:
        want = [b for b, c in enumerate(chunks) if c.want_logits]
        logits_indices = torch.tensor([int(cu[b + 1]) - 1 for b in want], dtype=torch.int64, device=device)
        logit_rows = list(range(len(want)))

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    meta = BatchMeta(
        input_ids=t(np.concatenate(ids_parts)),
        positions=t(np.concatenate(pos_parts)),
        cu_seqlens_q=t(cu),
        seq_lens_k=t(lens_k),
        max_seqlen_q=k if decode else int(lens_q.max(initial=1)),
        max_seqlen_k=table_width * page_size if decode else int(lens_k.max(initial=1)),
        phase="decode" if decode else "prefill",
        page_table=t(table),
        slot_mapping=t(np.concatenate(slot_parts)),
        logits_indices=logits_indices,
        ring_slots=None if ring_slots is None else t(ring_slots),
    )
    return meta, logit_rows


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``t`` on ``device``: on CUDA pinned first, so that its copy is asynchronous."""
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)


def gather_rows(t: torch.Tensor, src: list[int]) -> torch.Tensor:
    """``t[src]`` for a device tensor ``t``: a view when ``src`` is ``0 .. n-1``, else an index_select
    whose index travels asynchronously (no host sync)."""
    if src == list(range(len(src))):
        return t[:len(src)]
    return t.index_select(0, to_device_async(torch.tensor(src, dtype=torch.int64), t.device))


def meta_to_device(meta: BatchMeta, device: torch.device) -> BatchMeta:
    """Host-built ``meta`` on ``device``, each tensor through :func:`to_device_async`."""
    new = {f.name: to_device_async(v, device)
           for f in fields(meta) if isinstance(v := getattr(meta, f.name), torch.Tensor)}
    return replace(meta, **new)


class HostRead:
    """Asynchronous device->host copy of a small tensor; :meth:`wait` is the step's one sync.

    On CUDA the copy goes to pinned memory on the current stream and :attr:`event` marks its end; on
    the CPU the tensor is simply kept (cloned: a static buffer could be overwritten later).
    """

    def __init__(self, t: torch.Tensor) -> None:
        self.event: torch.cuda.Event | None = None
        if t.is_cuda:
            self._buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._buf.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(t.device))
        else:
            self._buf = t.clone()

    def wait(self) -> list[list[float]]:
        if self.event is not None:
            self.event.synchronize()
        return self._buf.tolist()
