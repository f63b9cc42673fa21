"""Which part of each module a rank holds: the tensor-parallel rules, applied module by module as a model
loads (:class:`RankSharder`), and the checks run on rank 0 before any worker starts.

* attention: split by KV heads (query heads with them; KV heads replicated when ranks exceed them), q/k/v
  column cuts, o_proj a row cut reduced after it;
* latent attention: query heads split, the latent (and its cache row) whole on every rank;
* gated MLPs (and the shared experts of a MoE layer): intermediate features split, down reduced;
* mixture of experts: every expert's intermediate features split, or (``expert_parallel``) whole experts
  divided among the ranks; the router whole everywhere; one reduction per layer;
* the head: the vocabulary split, the logits gathered on rank 0;
* embeddings, norms and rotary tables: whole on every rank.

A module that holds linears and has no rule here is refused, naming it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from exl3_core.archkit.decoder import Head, StandardDecoder
from exl3_core.archkit.model import Model
from exl3_core.cache.geometry import LayerGeometry
from exl3_core.nn.attention import Attention
from exl3_core.nn.linear import DenseLinear
from exl3_core.nn.mla import LatentAttention
from exl3_core.nn.mlp import MLP, GatedMLP
from exl3_core.nn.moe import MoE
from exl3_core.nn.shard import head_shard
from exl3_core.quant.exl3.linear import EXL3Linear


@dataclass(frozen=True)
class RankSharder:
    """Cuts each module to rank ``rank``'s share of ``world`` (a :class:`~exl3_core.nn.shard.ModuleSharder`)."""

    rank: int
    world: int
    expert_parallel: bool = False

    def shard_module(self, module: torch.nn.Module) -> None:
        r, w = self.rank, self.world
        if isinstance(module, Attention):
            module.apply_shard(head_shard(module.num_heads, module.num_kv_heads, r, w))
        elif isinstance(module, LatentAttention):
            module.apply_shard(head_shard(module.num_heads, 1, r, w))
        elif isinstance(module, (GatedMLP, MLP)):
            module.apply_shard(r, w)
        elif isinstance(module, MoE):
            module.apply_shard(r, w, self.expert_parallel)
        elif isinstance(module, Head):
            module.apply_shard(r, w)
        else:
            held = [n for n, c in module.named_children() if isinstance(c, (DenseLinear, EXL3Linear))]
            if held:
                raise TypeError(f"{type(module).__name__} holds linears ({', '.join(held)}) but has no tensor-parallel "
                                f"rule; only attention, latent attention, MLPs, mixtures of experts and the head "
                                f"are split. Load this model without tensor_parallel_size")


def check_model(model: Model) -> None:
    """Refuse a model whose forward the tensor-parallel runtime cannot run (it runs the execution plan's
    standard decoder on every rank).

    :raises TypeError: naming the model class."""
    if not isinstance(model, StandardDecoder) or not model.standard_forward:
        raise TypeError(f"{type(model).__name__} runs its own forward_batch; tensor parallelism splits the standard "
                        f"decoder only (a StandardDecoder with standard_forward = True)")


def rank_geometry(model: Model, rank: int, world: int) -> tuple[LayerGeometry, ...]:
    """What each cache layer of rank ``rank`` stores: its attention layers' KV heads (a latent whole)."""
    out = []
    for m in model.attention_layers():
        g = m.cache_geometry()
        if isinstance(m, Attention):
            g = g._replace(num_kv_heads=head_shard(m.num_heads, m.num_kv_heads, rank, world).num_kv_heads)
        out.append(g)
    return tuple(out)
