"""Mixture-of-experts block: router, top-k selection (plain, group-limited, grouped with a
selection-only correction bias), routed experts, optional shared experts with optional gate.

Routing is pure tensor math on the device (no host reads). Expert execution sorts the T*k
(token, expert) assignments by expert so every expert sees one contiguous slice, runs that
expert's own module on the slice (experts may be quantized linears, so they are called through
their ``forward``), and scatter-adds the weighted rows back. Dense experts are stacked at load
and run as two grouped GEMMs over device-side offsets: fixed shapes, no host read. Other experts
(quantized) take the sliced path, whose one host read per layer is the per-expert row counts
(``E`` ints) that become slice bounds; it also skips empty experts, which is what matters at
decode where T*k << E.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from exl3_core.nn.adapters import row_map
from exl3_core.nn.linear import make_linear, shard_granularity, shard_linear
from exl3_core.nn.mlp import Activation, GatedMLP, activation
from exl3_core.nn.module import ForwardState, LoadContext, Module, WeightError
from exl3_core.nn.shard import LinearShard, block_split

Scoring = Literal["softmax", "sigmoid"]
GroupScore = Literal["max", "top2_sum"]


@dataclass(frozen=True, kw_only=True)
class RoutingConfig:
    """How router logits become ``(weights, expert ids)`` per token.

    :param num_experts: routed experts E.
    :param top_k: experts per token.
    :param scoring: ``softmax`` over all experts, or an independent ``sigmoid`` per expert.
    :param num_groups: experts are split into this many equal contiguous groups (1 = no grouping).
    :param topk_groups: groups kept per token before the expert top-k (grouped routing only).
    :param group_score: how a group is ranked: its best expert (``max``, group-limited greedy)
        or the sum of its two best experts (``top2_sum``).
    :param renormalize: divide the k selected weights by their sum.
    :param scaling_factor: multiply the final weights (applied after renormalisation).
    """

    num_experts: int
    top_k: int
    scoring: Scoring = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    group_score: GroupScore = "max"
    renormalize: bool = False
    scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        E, k, g = self.num_experts, self.top_k, self.num_groups
        if not 1 <= k <= E:
            raise ValueError(f"RoutingConfig: top_k={k} must be in 1..num_experts={E}")
        if g < 1 or E % g:
            raise ValueError(f"RoutingConfig: num_experts={E} is not divisible by num_groups={g}")
        if g > 1:
            if not 1 <= self.topk_groups <= g:
                raise ValueError(f"RoutingConfig: topk_groups={self.topk_groups} must be in 1..num_groups={g}")
            if k > self.topk_groups * (E // g):
                raise ValueError(f"RoutingConfig: top_k={k} exceeds the {self.topk_groups} kept groups x "
                                 f"{E // g} experts; raise topk_groups")
            if self.group_score == "top2_sum" and E // g < 2:
                raise ValueError("RoutingConfig: group_score='top2_sum' needs at least 2 experts per group")

    @property
    def grouped(self) -> bool:
        return self.num_groups > 1 and self.topk_groups < self.num_groups


def route(logits: torch.Tensor, cfg: RoutingConfig, correction_bias: torch.Tensor | None = None,
          ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Select experts for each token and weigh them.

    :param logits: ``[T, E]`` router logits (any float dtype; math runs in fp32).
    :param correction_bias: ``[E]`` added to the scores for *selection only* (load-balancing
        bias); the returned weights are always the unbiased scores.
    :param ids: ``[T, k]`` experts to use instead of selecting them (weights are still computed
        from ``logits``); lets a test pin the routing of a reference implementation.
    :return: ``(weights fp32 [T, k], ids int64 [T, k])``.
    """
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if cfg.scoring == "softmax" else torch.sigmoid(logits)
    if ids is None:
        ids = _choose(scores, cfg, correction_bias)
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        # the epsilon only matters when every selected sigmoid score underflows to 0
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.scaling_factor != 1.0:
        weights = weights * cfg.scaling_factor
    return weights, ids


def _choose(scores: torch.Tensor, cfg: RoutingConfig, correction_bias: torch.Tensor | None) -> torch.Tensor:
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.grouped:
        T, E, G = choice.shape[0], cfg.num_experts, cfg.num_groups
        per_group = choice.view(T, G, E // G)
        if cfg.group_score == "max":
            group_rank = per_group.amax(dim=-1)
        else:
            group_rank = per_group.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.topk(group_rank, cfg.topk_groups, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_rank, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~group_mask.repeat_interleave(E // G, dim=1), float("-inf"))
    return torch.topk(choice, cfg.top_k, dim=-1, sorted=False).indices


@dataclass(frozen=True)
class ExpertShard:
    """A rank's share of a MoE layer: with ``expert_parallel``, the whole experts ``first:stop``; else a slice
    of every expert's intermediate features (``first:stop`` of them)."""

    rank: int
    world: int
    expert_parallel: bool
    first: int
    stop: int


@functools.cache
def grouped_gemm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``F.grouped_mm`` runs (and is right) for ``dtype`` on ``device``; probed once."""
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(12, 16, generator=g).to(device, dtype)
        b = torch.randn(3, 24, 16, generator=g).to(device, dtype)  # stored [E, out, in] like the experts
        offs = torch.tensor([5, 5, 12], dtype=torch.int32, device=device)
        out = F.grouped_mm(a, b.transpose(1, 2), offs=offs).float()
        ref = torch.cat([a[:5].float() @ b[0].float().T, a[5:].float() @ b[2].float().T])
        return bool(((out - ref).abs().max() <= 0.05 * ref.abs().max()).item())
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False


class GatedExpert(torch.nn.Module):
    """``down(act(gate(x)) * up(x))`` over three already-built linear modules (any implementation)."""

    def __init__(self, gate: torch.nn.Module, up: torch.nn.Module, down: torch.nn.Module, act: Activation) -> None:
        super().__init__()
        self.gate, self.up, self.down = gate, up, down
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))


class MoE(Module):
    """Routed gated experts plus optional always-on shared experts.

    Checkpoint layout under ``prefix`` (sub-keys configurable): router ``gate.weight [E, H]``,
    optional selection bias ``gate.e_score_correction_bias [E]``, experts either one linear triple
    per expert (``experts.{e}.gate_proj``/``up_proj``/``down_proj``, dense or EXL3) or fused dense
    3-D tensors (``experts.gate_up_proj [E, 2I, H]`` with the gate rows first, ``experts.down_proj
    [E, H, I]``), optional shared experts (a gated MLP) and an optional shared-expert gate
    (a linear ``H -> 1`` whose sigmoid scales the shared output).

    :param prefix: e.g. ``"model.layers.3.mlp"``.
    :param intermediate_size: per-expert intermediate width.
    :param routing: see :class:`RoutingConfig`.
    :param router_dtype: dtype of the router weight and of its input (fp32 keeps the choice of
        experts stable under bf16 activations); None = the model dtype.
    :param correction_bias_key: sub-key of the selection-only bias, or None if the family has none.
    :param shared_intermediate_size: width of the shared experts (all of them fused into one
        gated MLP, as checkpoints store them), or None.
    :param shared_gate_key: sub-key of the shared-expert gate linear, or None.
    """

    def __init__(self, *, prefix: str, hidden_size: int, intermediate_size: int, routing: RoutingConfig,
                 act: str = "silu", router_key: str = "gate", router_dtype: torch.dtype | None = None,
                 correction_bias_key: str | None = None, experts_key: str = "experts",
                 expert_proj_keys: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 shared_intermediate_size: int | None = None, shared_key: str = "shared_experts",
                 shared_gate_key: str | None = None, bias: bool | None = False) -> None:
        super().__init__()
        # slots filled by load_weights (declared for type checkers; None until loaded)
        self.router: torch.nn.Module | None
        self.experts: torch.nn.ModuleList | None
        self.shared_gate: torch.nn.Module | None
        self.prefix = prefix
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.routing = routing
        self.act = activation(act)
        self.router_key = f"{prefix}.{router_key}"
        self.router_dtype = router_dtype
        self.correction_bias_key = None if correction_bias_key is None else f"{prefix}.{correction_bias_key}"
        self.experts_key = f"{prefix}.{experts_key}"
        self.expert_proj_keys = expert_proj_keys
        self.bias = bias
        self.shared: GatedMLP | None = None
        if shared_intermediate_size:
            g, u, d = expert_proj_keys
            sk = f"{prefix}.{shared_key}"
            self.shared = GatedMLP(hidden_size=hidden_size, intermediate_size=shared_intermediate_size, act=act,
                                   gate_key=f"{sk}.{g}", up_key=f"{sk}.{u}", down_key=f"{sk}.{d}", bias=bias)
        self.shared_gate_key = None if shared_gate_key is None else f"{prefix}.{shared_gate_key}"
        self.correction_bias: torch.Tensor | None
        self.register_buffer("correction_bias", None, persistent=False)
        self.declare_slots("router", "experts", "shared_gate")
        #: ``[T, k]`` expert ids to use instead of the router's choice (see :func:`pin_routing`)
        self.pinned_ids: torch.Tensor | None = None
        #: this rank's share under tensor or expert parallelism (None: the whole layer)
        self.shard: ExpertShard | None = None
        #: stack dense experts at load for the grouped-GEMM path (False: always the sliced path)
        self.grouped_gemm = True
        self.gate_up_t: torch.Tensor | None
        self.down_t: torch.Tensor | None
        self.register_buffer("gate_up_t", None, persistent=False)
        self.register_buffer("down_t", None, persistent=False)

    # -- loading --------------------------------------------------------------------------------
    def load_weights(self, ctx: LoadContext) -> None:
        H, I, E = self.hidden_size, self.intermediate_size, self.routing.num_experts
        self.attach_loaded("router", make_linear(self.router_key, H, E, bias=False, source=ctx.source,
                                                 device=ctx.device, dtype=self.router_dtype or ctx.dtype,
                                                 names=ctx.names))  # type: ignore[arg-type]
        if self.correction_bias_key is not None:
            self.correction_bias = ctx.tensor(self.correction_bias_key, shape=(E,), dtype=torch.float32,
                                              what="expert selection bias")
        if self.shared_gate_key is not None:
            self.attach_loaded("shared_gate", ctx.linear(self.shared_gate_key, H, 1, bias=False))  # type: ignore[arg-type]
        self.attach_loaded("experts", torch.nn.ModuleList(self._load_experts(ctx, H, I, E)))
        self.shard = None
        self._stack_dense_experts()

    def apply_shard(self, rank: int, world: int, expert_parallel: bool = False) -> None:
        """Keep ``rank``'s share: with ``expert_parallel`` its run of whole experts (as evenly as they divide),
        else a slice of every expert's intermediate features (gate/up cut by output, down by input). The
        router stays whole on every rank, so every rank routes alike; the shared experts (a gated MLP) cut
        themselves. Each rank's output is a partial sum that :meth:`forward` reduces. Call after loading.

        :raises ValueError: naming the counts when some rank would get no expert (or no feature block)."""
        assert self.experts is not None, f"{self.prefix}: MoE is not loaded"
        experts: list[GatedExpert] = list(self.experts)  # type: ignore[arg-type]
        if expert_parallel:
            first, stop = block_split(len(experts), world, 1, f"experts of {self.prefix}")[rank]
            self.attach_loaded("experts", torch.nn.ModuleList(experts[first:stop]))
            self.gate_up_t = self.down_t = None  # a share of the experts runs the sliced path
        else:
            g = shard_granularity(experts[0].gate, experts[0].up, experts[0].down)
            first, stop = block_split(self.intermediate_size, world, g,
                                      f"expert intermediate features of {self.prefix}")[rank]
            col, row = LinearShard("column", rank, world, first, stop), LinearShard("row", rank, world, first, stop)
            self.attach_loaded("experts", torch.nn.ModuleList(
                GatedExpert(shard_linear(ex.gate, col), shard_linear(ex.up, col), shard_linear(ex.down, row), ex.act)
                for ex in experts))
        self.shard = ExpertShard(rank, world, expert_parallel, first, stop)
        if not expert_parallel:
            self._stack_dense_experts()

    def _stack_dense_experts(self) -> None:
        """Dense experts: stack their weights for the sync-free grouped-GEMM path.

        The per-expert linears are re-pointed at views of the stacked tensors, so memory is not
        doubled. Quantized experts (or a device/dtype without grouped GEMM) keep the sliced path.
        """
        from exl3_core.nn.linear import DenseLinear

        self.gate_up_t = self.down_t = None
        assert self.experts is not None
        mods = [(ex.gate, ex.up, ex.down) for ex in self.experts]
        if not self.grouped_gemm or not all(type(m) is DenseLinear and m.bias is None for t in mods for m in t):
            return
        lins: list[tuple[DenseLinear, DenseLinear, DenseLinear]] = mods  # type: ignore[assignment]
        w = lins[0][0].weight
        if not grouped_gemm_works(w.device, w.dtype):
            return
        I = lins[0][0].out_features  # this rank's share of the features when sharded
        gate_up = torch.stack([torch.cat([g.weight, u.weight]) for g, u, _ in lins])  # [E, 2I, H]
        down = torch.stack([d.weight for _, _, d in lins])  # [E, H, I]
        for e, (g, u, d) in enumerate(lins):
            g.weight, u.weight, d.weight = gate_up[e, :I], gate_up[e, I:], down[e]
        self.gate_up_t = gate_up.transpose(1, 2)  # [E, H, 2I]: rows @ gate_up_t[e]
        self.down_t = down.transpose(1, 2)  # [E, I, H]

    def _load_experts(self, ctx: LoadContext, H: int, I: int, E: int) -> list[GatedExpert]:
        g, u, d = self.expert_proj_keys
        ek = self.experts_key
        fused_gu, fused_d = f"{ek}.gate_up_proj", f"{ek}.down_proj"
        if ctx.has(fused_gu) and not ctx.has(f"{ek}.0.{g}.weight"):
            # fused dense layout (transformers-5 in-memory form): split once into per-expert linears
            from exl3_core.nn.linear import DenseLinear

            gu = ctx.tensor(fused_gu, shape=(E, 2 * I, H), dtype=ctx.dtype, what="fused expert gate/up weights")
            dn = ctx.tensor(fused_d, shape=(E, H, I), dtype=ctx.dtype, what="fused expert down weights")
            assert gu is not None and dn is not None
            return [GatedExpert(DenseLinear(gu[e, :I].contiguous(), None, H, I, key=f"{fused_gu}[{e}].gate"),
                                DenseLinear(gu[e, I:].contiguous(), None, H, I, key=f"{fused_gu}[{e}].up"),
                                DenseLinear(dn[e].contiguous(), None, I, H, key=f"{fused_d}[{e}]"), self.act)
                    for e in range(E)]
        if not ctx.has(f"{ek}.0.{g}.weight") and not ctx.has(f"{ek}.0.{g}.trellis"):
            raise WeightError(f"{self.prefix}: no experts found in the checkpoint at {ctx.where(self.router_key + '.weight')}"
                              f" (looked for {ek}.0.{g}.weight/.trellis and fused {fused_gu}); the checkpoint does "
                              f"not match config.json")
        return [GatedExpert(ctx.linear(f"{ek}.{e}.{g}", H, I, bias=self.bias),  # type: ignore[arg-type]
                            ctx.linear(f"{ek}.{e}.{u}", H, I, bias=self.bias),  # type: ignore[arg-type]
                            ctx.linear(f"{ek}.{e}.{d}", I, H, bias=self.bias), self.act)  # type: ignore[arg-type]
                for e in range(E)]

    # -- forward --------------------------------------------------------------------------------
    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights fp32 [T, k], ids int64 [T, k])`` for hidden states ``x [T, H]``."""
        assert self.router is not None, f"{self.prefix}: MoE is not loaded"
        logits = self.router(x if self.router_dtype is None else x.to(self.router_dtype))
        return route(logits, self.routing, self.correction_bias, self.pinned_ids)

    def forward(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.select(x)
        y = self.run_experts(x, weights, ids)
        if self.shared is not None:
            s = self.shared(x).float()  # without the state: its partial sum joins this layer's one reduction
            if self.shared_gate is not None:
                s = s * torch.sigmoid(self.shared_gate(x).float())
            y = y + s
        y = y.to(x.dtype)
        if self.shard is not None and state is not None:
            y = state.all_reduce(y)
        return y.reshape(shape)

    def graph_capturable(self) -> str | None:
        """None when a forward can be captured in a CUDA graph, else why not (the sliced expert
        path reads per-expert row counts back to the host)."""
        if self.gate_up_t is None or self.down_t is None:
            return f"{self.prefix}: quantized, unstacked or expert-parallel experts take the sliced path (one host " \
                   f"read per forward)"
        if self.experts_adapted():
            return f"{self.prefix}: experts with adapters take the sliced path (one host read per forward)"
        return None

    def fused_adapter_params(self) -> dict[str, tuple[tuple[torch.nn.Module, ...], ...]]:
        """The fused 3-D expert parameters of transformers' layout that a PEFT adapter may target
        (``target_parameters``): parameter path -> per expert, the linears holding its output rows in order
        (``gate_up_proj [E, 2I, H]``: gate rows first, then up; ``down_proj [E, H, I]``)."""
        if self.experts is None:
            return {}
        ek = self.experts_key
        return {f"{ek}.gate_up_proj": tuple((ex.gate, ex.up) for ex in self.experts),
                f"{ek}.down_proj": tuple((ex.down,) for ex in self.experts)}

    def experts_adapted(self) -> bool:
        """Whether any expert's linear carries an adapter (the stacked grouped GEMM would leave its delta out)."""
        assert self.experts is not None
        return any(getattr(m, "adapters", ()) for ex in self.experts for m in (ex.gate, ex.up, ex.down))

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Weighted sum of each token's selected experts, fp32 ``[T, H]``."""
        assert self.experts is not None, f"{self.prefix}: MoE is not loaded"
        T, k = ids.shape
        flat = ids.reshape(-1)
        # stable sort keeps each expert's rows in token order, so results are deterministic
        order = torch.argsort(flat, stable=True)
        token = order // k
        rows = x.index_select(0, token)
        counts = torch.bincount(flat, minlength=self.routing.num_experts)
        if (self.gate_up_t is not None and self.down_t is not None and rows.dtype == self.gate_up_t.dtype
                and not self.experts_adapted()):
            # grouped GEMM over device-side offsets: fixed shapes, no host read (graph-capturable)
            offs = counts.cumsum(0).to(torch.int32)
            gu = F.grouped_mm(rows, self.gate_up_t, offs=offs)
            gate, up = gu.split(self.gate_up_t.shape[-1] // 2, dim=-1)  # this rank's features
            out = F.grouped_mm(self.act(gate) * up, self.down_t, offs=offs)
        else:
            bounds = counts.cumsum(0).cpu().tolist()  # the one host read: slice bounds per expert
            # expert parallel: this rank holds experts first:first+len(experts); others' rows stay zero
            first = self.shard.first if self.shard is not None and self.shard.expert_parallel else 0
            local = range(first, first + len(self.experts))
            alloc = torch.zeros if len(local) < len(bounds) else torch.empty
            out = alloc((T * k, x.shape[-1]), dtype=x.dtype, device=x.device)
            start = 0
            for e, end in enumerate(bounds):
                if end > start and e in local:
                    with row_map(token[start:end]):  # the expert's input rows are these tokens' rows
                        out[start:end] = self.experts[e - first](rows[start:end])
                start = end
        w = weights.reshape(-1).index_select(0, order)
        y = torch.zeros((T, x.shape[-1]), dtype=torch.float32, device=x.device)
        return y.index_add_(0, token, out.float() * w[:, None])

    def extra_repr(self) -> str:
        r = self.routing
        return f"{self.prefix}: experts={r.num_experts}, top_k={r.top_k}, scoring={r.scoring}, " \
               f"groups={r.topk_groups}/{r.num_groups}, shared={self.shared is not None}"


@contextmanager
def pin_routing(pins: dict[MoE, torch.Tensor]) -> Iterator[None]:
    """Force the expert choice of some MoE blocks (weights still come from their own router).

    Testing aid: near-tied router scores flip under bf16 rounding in *any* implementation, and
    one flipped token changes its output by a whole expert. Pinning both sides to the same
    choice makes a bf16 comparison measure numerics rather than tie-breaking luck.
    """
    try:
        for moe, ids in pins.items():
            moe.pinned_ids = ids
        yield
    finally:
        for moe in pins:
            moe.pinned_ids = None
