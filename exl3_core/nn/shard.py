"""Tensor-parallel shards of linears and attention heads: what a rank holds, and how to cut it.

A *column* shard keeps a range of a linear's output features (every rank computes its own part
of the output, nothing to reduce); a *row* shard keeps a range of its input features (every rank
computes a partial sum of the whole output, which an all-reduce completes). Attention splits by
KV heads (each rank attends with its query heads' own KV heads; with more ranks than KV heads, KV
heads are replicated), so q/k/v are column shards and o is a row shard; a gated MLP splits its
intermediate features the same way (gate/up column, down row).

The reductions are the modules' (see :meth:`ForwardState.all_reduce`); cutting happens once, after
loading, with :func:`exl3_core.nn.linear.shard_linear`. A shard of one rank is the whole layer, so the sharded code
path runs, and is tested, on one device too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import torch

ShardKind = Literal["column", "row"]


@dataclass(frozen=True)
class LinearShard:
    """Which part of a linear a rank holds: features ``start:stop`` of its output (column) or input (row)."""

    kind: ShardKind
    rank: int
    world: int
    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.kind not in ("column", "row"):
            raise ValueError(f"LinearShard.kind={self.kind!r}: want 'column' or 'row'")
        if not 0 <= self.rank < self.world or not 0 <= self.start < self.stop:
            raise ValueError(f"LinearShard: rank {self.rank} of {self.world}, features {self.start}:{self.stop}")

    @property
    def needs_reduce(self) -> bool:
        """Whether outputs are partial sums that an all-reduce completes."""
        return self.kind == "row" and self.world > 1


@dataclass(frozen=True)
class HeadShard:
    """The query and KV heads a rank computes attention for (``q_start:q_stop``, ``kv_start:kv_stop``)."""

    rank: int
    world: int
    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int

    @property
    def num_q_heads(self) -> int:
        return self.q_stop - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_stop - self.kv_start


def head_shard(num_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadShard:
    """Rank ``rank``'s heads: query heads split evenly; KV heads split evenly, or, with more ranks than
    KV heads, each rank holds (a replica of) the one KV head its query heads read.

    :raises ValueError: naming the counts, when the heads do not divide over the ranks.
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of tensor_parallel_size {world}")
    if num_heads % world:
        raise ValueError(f"{num_heads} attention heads do not divide over tensor_parallel_size={world}; choose a "
                         f"size that divides num_attention_heads")
    per = num_heads // world
    group = num_heads // num_kv_heads
    if world <= num_kv_heads:
        if num_kv_heads % world:
            raise ValueError(f"{num_kv_heads} KV heads do not divide over tensor_parallel_size={world}; choose a size "
                             f"that divides num_key_value_heads, or a multiple of it")
        kv_per = num_kv_heads // world
        return HeadShard(rank, world, rank * per, (rank + 1) * per, rank * kv_per, (rank + 1) * kv_per)
    if world % num_kv_heads or group % (world // num_kv_heads):
        raise ValueError(f"tensor_parallel_size={world} exceeds the {num_kv_heads} KV heads and does not replicate "
                         f"them evenly (want a multiple of num_key_value_heads that divides num_attention_heads)")
    kv = rank * per // group
    return HeadShard(rank, world, rank * per, (rank + 1) * per, kv, kv + 1)


def even_split(n: int, rank: int, world: int, granularity: int = 1) -> tuple[int, int]:
    """``(start, stop)`` of rank's share of ``n`` features, cut at multiples of ``granularity``."""
    if n % granularity or (n // granularity) % world:
        raise ValueError(f"{n} features do not split into {world} equal shares of whole {granularity}-feature "
                         f"blocks")
    per = n // world
    return rank * per, (rank + 1) * per


def block_split(n: int, world: int, granularity: int = 1, what: str = "features") -> list[tuple[int, int]]:
    """Every rank's ``(start, stop)`` share of ``n`` features, cut at multiples of ``granularity`` (the last
    share may end at ``n``): whole blocks dealt out as evenly as they go, the first ranks taking one more
    where they do not divide. Row and column cuts add up for any shares, so uneven ones are exact too.

    :raises ValueError: naming ``what`` and the counts when some rank would get no block at all.
    """
    if world < 1 or n < 1 or granularity < 1:
        raise ValueError(f"block_split: {n} {what} over {world} ranks in blocks of {granularity}")
    blocks = -(-n // granularity)
    if blocks < world:
        count = f"{n} {what} make only {blocks} blocks of {granularity}," if granularity > 1 else f"{n} {what} are"
        raise ValueError(f"{count} fewer than tensor_parallel_size={world}: some rank would hold none; use fewer "
                         f"ranks")
    base, extra = divmod(blocks, world)
    out, start = [], 0
    for r in range(world):
        stop = start + base + (1 if r < extra else 0)
        out.append((start * granularity, min(stop * granularity, n)))
        start = stop
    return out


class ModuleSharder(Protocol):
    """What :meth:`exl3_core.archkit.model.Model.load` applies to each module right after it loads (and to the
    memory plan's dry run): cut the module's loaded weights to one rank's share, so a rank never holds more
    than one module's full weights at a time. ``rank``/``world`` name the share."""

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    def shard_module(self, module: torch.nn.Module) -> None:
        """Replace ``module``'s loaded weights by this rank's share (nothing for replicated modules).

        :raises ValueError, TypeError: naming the module when its weights cannot be cut this way."""
        ...
