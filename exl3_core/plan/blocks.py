"""How the plan runs the modules it knows: attention, the gated MLP, the pre-norm block.

A runner is built once per module when the plan is built; it decides what it can (layer types,
kernels, tuning) and reports it, and calls the module's own pieces (:class:`Attention`'s
``split_heads``/``qk_normed``/``attend``/``project_out``, :class:`GatedMLP`'s ``act_mul``) around the
fused launches. Modules of other types (subclasses included: their methods may compute something
else) run their own ``forward``, and the report says so.
"""
from __future__ import annotations

import torch

from exl3_core import ops
from exl3_core.archkit.decoder import DecoderBlock
from exl3_core.cache.layer import CacheLayer
from exl3_core.nn.adapters import row_map
from exl3_core.nn.attention import Attention
from exl3_core.nn.mla import LatentAttention
from exl3_core.nn.mlp import FUSED_ACT_NAMES, GatedMLP
from exl3_core.nn.module import ForwardState
from exl3_core.nn.norm import RMSNorm
from exl3_core.plan.kernels import LinearKernels
from exl3_core.plan.linears import DeferredNorm, Projection, ResidualOut, add_residual_ss
from exl3_core.plan.report import Decision, decide
from exl3_core.quant.exl3.linear import RopeCacheEpilogue
from exl3_core.tuning import Tuning

#: head dims the q/k/v epilogue rotates
EPILOGUE_HEAD_DIMS = (32, 64, 128)


def kind(m: torch.nn.Module) -> str:
    return type(m).__name__


class AttentionRunner:
    """:class:`Attention` (exactly that type) with grouped q/k/v, RoPE and the cache write fused where
    they can be, and o_proj adding the residual in its epilogue at decode sizes."""

    def __init__(self, attn: Attention, tuning: Tuning, device: torch.device, fused: bool,
                 kernels: LinearKernels) -> None:
        self.attn = attn
        self.fused = fused
        layers = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.qkv = Projection("q/k/v", layers, tuning, device, kernels)
        self.out = ResidualOut("o_proj", attn.o_proj, tuning, device, kernels)
        why: list[str] = []
        if not tuning.fusion.qkv_epilogue:
            why.append("off in the tuning")
        if attn.rope is None:
            why.append("no RoPE")
        else:
            if attn.rope.rotary_dim != attn.head_dim:
                why.append(f"partial RoPE ({attn.rope.rotary_dim} of {attn.head_dim} channels)")
        if attn.q_norm is not None:
            why.append("per-head q/k norms run between the projection and RoPE")
        if attn.head_dim not in EPILOGUE_HEAD_DIMS:
            why.append(f"head dim {attn.head_dim} (the epilogue rotates {EPILOGUE_HEAD_DIMS})")
        why += self.qkv.launch_why
        if any(getattr(m, "bias", None) is not None for m in layers):
            why.append("q/k/v have biases (added after the epilogue)")
        if any(getattr(m, "out_features", 1) % 4 for m in layers):
            why.append("q/k/v widths not multiples of 4 (the epilogue stores 4 columns a lane)")
        if self.qkv.has_adapters:
            why.append("an adapter's delta must join q/k/v before RoPE")
        #: [] when q/k/v may rotate and store keys and values in their launch's epilogue
        self.epilogue_why = why
        rw: list[str] = []
        if not tuning.fusion.rope_cache_write:
            rw.append("off in the tuning")
        if attn.rope is None:
            rw.append("no RoPE")
        if not fused:
            rw.append(f"model on {device.type}, the kernel is CUDA's")
        #: [] when RoPE and the cache write run through the cache layer's ``write_rotated`` (one kernel)
        self.rope_write_why = rw

    def decisions(self) -> list[Decision]:
        return [*self.qkv.decisions(),
                decide("q/k/v epilogue: RoPE and the cache write in the projection launch", self.epilogue_why,
                       "decode sizes, where the cache layer offers an in-kernel write target"),
                decide("RoPE and the cache write in one kernel (the cache layer's write_rotated)", self.rope_write_why,
                       "steps without the epilogue"),
                *self.out.decisions()]

    def _epilogue(self, x: torch.Tensor | DeferredNorm, layer: CacheLayer | None,
                  state: ForwardState) -> RopeCacheEpilogue | None:
        meta, attn = state.meta, self.attn
        if self.epilogue_why or layer is None or meta.slot_mapping is None or attn.rope is None:
            return None
        if self.qkv.has_adapters:  # attached after the plan was built: the delta must join before RoPE
            return None
        h = x.h if isinstance(x, DeferredNorm) else x
        if not self.qkv.launchable(h, no_bias=True):
            return None
        target = layer.fused_write_target()
        if target is None:
            return None
        k_proj, v_proj = attn.k_proj, attn.v_proj
        if (target.k.shape[2:].numel() != k_proj.out_features or target.v.shape[2:].numel() != v_proj.out_features
                or target.k.device != meta.slot_mapping.device):
            return None
        cos, sin = attn.cos_sin(state)
        if cos.dtype != torch.float32 or sin.dtype != torch.float32:
            return None
        return RopeCacheEpilogue(cos, sin, attn.rope.interleaved, meta.slot_mapping, target.k, target.v)

    def attend(self, x: torch.Tensor | DeferredNorm, state: ForwardState) -> torch.Tensor:
        """The attention up to o_proj's input ``[T, Hq * Dv]``; this step's keys and values are stored."""
        attn = self.attn
        layer = state.cache_layer(attn.cache_index)
        ep = self._epilogue(x, layer, state)
        if ep is not None:  # rotated, and k/v stored, by the launch
            q, k, v = attn.split_heads(*self.qkv.run_epilogue(x, ep))
        else:
            q, k, v = attn.split_heads(*self.qkv.run(x))
            q, k = attn.qk_normed(q, k)
            rope = attn.rope
            if rope is not None:
                cos, sin = attn.cos_sin(state)
                if layer is not None and not self.rope_write_why:
                    layer.write_rotated(q, k, v, state.slots(), cos, sin, rope.rotary_dim, rope.interleaved)
                else:
                    q, k = rope.rotate_qk(q, k, cos, sin)
                    if layer is not None:
                        layer.write(k, v, state.slots())
            elif layer is not None:
                layer.write(k, v, state.slots())
        return attn.attend(q, k, v, layer, state)

    def forward(self, x: torch.Tensor, state: ForwardState, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The module's output; with ``rows`` only those rows' (every row still attends and is stored)."""
        o = self.attend(x, state)
        if rows is None:
            return self.attn.project_out(o, state)
        with row_map(rows):  # o_proj's input rows are the step's rows ``rows``
            return self.attn.project_out(o.index_select(0, rows), state)

    def forward_residual(self, x: torch.Tensor | DeferredNorm, state: ForwardState, residual: torch.Tensor,
                         ss: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``, each row's sum of squares of the result added into ``ss``."""
        o = self.attend(x, state)
        return self.out.run(o, residual, ss, lambda: self.attn.project_out(o, state))


class GatedMLPRunner:
    """:class:`GatedMLP` (exactly that type) with grouped gate/up, the activation product in down's
    prologue and the residual add in its epilogue at decode sizes."""

    def __init__(self, mlp: GatedMLP, tuning: Tuning, device: torch.device, kernels: LinearKernels) -> None:
        self.mlp = mlp
        self.gate_up = Projection("gate/up", (mlp.gate, mlp.up), tuning, device, kernels)
        self.act = FUSED_ACT_NAMES.get(mlp.act)
        self.down = ResidualOut("down", mlp.down, tuning, device, kernels, act=self.act)
        self.sharded = getattr(mlp.down, "shard", None) is not None

    def decisions(self) -> list[Decision]:
        return [*self.gate_up.decisions(), *self.down.decisions(gated=True)]

    def _down(self, gate: torch.Tensor, up: torch.Tensor, state: ForwardState) -> torch.Tensor:
        y = self.down.product(gate, up, self.mlp.act_mul) if ops.fused_enabled(up) else \
            self.mlp.down(self.mlp.act_mul(gate, up))
        return state.all_reduce(y) if self.sharded else y

    def forward(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        gate, up = self.gate_up.run(x)
        return self._down(gate, up, state)

    def forward_residual(self, x: torch.Tensor | DeferredNorm, residual: torch.Tensor, ss: torch.Tensor,
                         state: ForwardState) -> torch.Tensor:
        """``residual + self(x)``, each row's sum of squares of the result added into ``ss``."""
        gate, up = self.gate_up.run(x)
        if self.act is None or not ops.fused_enabled(up):
            return add_residual_ss(residual, self._down(gate, up, state), ss)
        return self.down.run(up, residual, ss, lambda: self._down(gate, up, state), gate=gate,
                             act_mul=self.mlp.act_mul)


AttentionLike = AttentionRunner | LatentAttention | torch.nn.Module


class BlockRunner:
    """One layer of the decoder: a plain :class:`DecoderBlock` run in the plan's forms (its residual adds
    inside the norms after them; at decode sizes its norms deferred into the linears around them), or
    any other block through its own forward."""

    def __init__(self, index: int, block: torch.nn.Module, tuning: Tuning, device: torch.device, fused: bool,
                 kernels: LinearKernels) -> None:
        self.index = index
        self.block = block
        self.known = type(block) is DecoderBlock
        self.attn_runner: AttentionRunner | None = None
        self.mlp_runner: GatedMLPRunner | None = None
        chain: list[str] = []
        rows: list[str] = []
        if not self.known:
            chain.append(f"{kind(block)} is not a DecoderBlock: its own forward runs")
            rows.append(chain[0])
        else:
            assert isinstance(block, DecoderBlock)
            if type(block.attn) is Attention:
                self.attn_runner = AttentionRunner(block.attn, tuning, device, fused, kernels)
            if type(block.mlp) is GatedMLP:
                self.mlp_runner = GatedMLPRunner(block.mlp, tuning, device, kernels)
            if not (type(block.attn_norm) is RMSNorm and type(block.mlp_norm) is RMSNorm):
                chain.append(f"norms are {kind(block.attn_norm)}/{kind(block.mlp_norm)}, not RMSNorm")
            if type(block.attn) not in (Attention, LatentAttention):
                rows.append(f"{kind(block.attn)} cannot project only some rows")
        if not tuning.fusion.residual_norm:
            chain.append("off in the tuning")
        if not fused:
            chain.append(f"model on {device.type}, the kernel is CUDA's")
        if not tuning.fusion.last_rows:
            rows.append("off in the tuning")
        #: [] when the residual adds run inside the norms after them
        self.chain_why = chain
        #: [] when this block (the last) may run past its attention on the rows wanting logits alone
        self.rows_why = rows
        deferred = list(chain)
        if not tuning.fusion.deferred_norm:
            deferred.append("deferred norms off in the tuning")
        if self.known and self.attn_runner is None:
            deferred.append(f"attention is {kind(block.attn)}, not Attention")  # type: ignore[union-attr]
        if self.known and self.mlp_runner is None:
            deferred.append(f"MLP is {kind(block.mlp)}, not GatedMLP")  # type: ignore[union-attr]
        # a residual launch that cannot take its layer leaves the add and the sums to several eager kernels,
        # where the chain form adds inside the next norm's one kernel
        producers = ([self.attn_runner.out] if self.attn_runner is not None else []) + \
            ([self.mlp_runner.down] if self.mlp_runner is not None else [])
        deferred += [f"{out.name}'s residual launch declines: {'; '.join(out.shape_why)}" for out in producers
                     if out.shape_why]
        #: [] when, at decode sizes, this block's norms run inside the linears around them
        self.deferred_why = deferred

    def decisions(self, last: bool) -> list[Decision]:
        out = [decide("residual add inside the next norm", self.chain_why),
               decide("norms deferred into the linears around them", self.deferred_why,
                      "decode sizes, when every block can")]
        if last:
            out.append(decide("past its attention, only the rows that want logits", self.rows_why,
                              "prefill chunks"))
        if self.attn_runner is not None:
            out += self.attn_runner.decisions()
        if self.mlp_runner is not None:
            out += self.mlp_runner.decisions()
        return out

    # -- the module calls, through the runners where there are ones ---------------------------------
    def _attn(self, x: torch.Tensor, state: ForwardState, rows: torch.Tensor | None = None) -> torch.Tensor:
        assert isinstance(self.block, DecoderBlock)
        if self.attn_runner is not None:
            return self.attn_runner.forward(x, state, rows)
        attn = self.block.attn
        if rows is not None:
            assert isinstance(attn, LatentAttention)
            return attn(x, state, rows=rows)
        return attn(x, state)

    def _mlp(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        assert isinstance(self.block, DecoderBlock)
        if self.mlp_runner is not None:
            return self.mlp_runner.forward(x, state)
        return self.block.mlp(x, state)

    # -- the forms ----------------------------------------------------------------------------------
    def plain(self, x: torch.Tensor, state: ForwardState, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The block's maths; with ``rows``, only those rows leave the block (every row attends)."""
        if rows is None or self.rows_why:
            return self.block(x, state) if rows is None else self.block(x, state).index_select(0, rows)
        b = self.block
        assert isinstance(b, DecoderBlock)
        x = x.index_select(0, rows) + self._attn(b.attn_norm(x), state, rows)
        with row_map(rows):
            return x + self._mlp(b.mlp_norm(x), state)

    def chain(self, x: torch.Tensor, pending: torch.Tensor | None, state: ForwardState,
              rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block on the stream ``x + pending`` with both residual adds inside the norms after them;
        returns ``(stream before the MLP output, MLP output)``: the caller adds (or fuses) the second."""
        b = self.block
        assert isinstance(b, DecoderBlock) and isinstance(b.attn_norm, RMSNorm) and isinstance(b.mlp_norm, RMSNorm)
        if pending is None:
            normed = b.attn_norm(x)
        else:
            normed, x = b.attn_norm.forward_residual(pending, x)
        if rows is None:
            a = self._attn(normed, state)
        else:
            a, x = self._attn(normed, state, rows), x.index_select(0, rows)
        normed, x = b.mlp_norm.forward_residual(a, x)
        with row_map(rows):
            return x, self._mlp(normed, state)

    def deferred(self, h: torch.Tensor, ss_in: torch.Tensor | None, state: ForwardState, ss_attn: torch.Tensor,
                 ss_mlp: torch.Tensor) -> torch.Tensor:
        """The block on the stream ``h`` with both norms deferred into the linears after them: o_proj and
        down add the residual in their epilogues and sum each row's squares into ``ss_attn``/``ss_mlp``
        (zero before), q/k/v and gate/up normalise in their prologues. ``ss_in``: ``h``'s sums, or None
        (the norm runs as a kernel). Returns the new stream."""
        b = self.block
        assert isinstance(b, DecoderBlock) and isinstance(b.attn_norm, RMSNorm) and isinstance(b.mlp_norm, RMSNorm)
        assert self.attn_runner is not None and self.mlp_runner is not None
        x: torch.Tensor | DeferredNorm = b.attn_norm(h) if ss_in is None else DeferredNorm(h, b.attn_norm, ss_in)
        h = self.attn_runner.forward_residual(x, state, h, ss_attn)
        return self.mlp_runner.forward_residual(DeferredNorm(h, b.mlp_norm, ss_attn), h, ss_mlp, state)
