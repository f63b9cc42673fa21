"""The standard decoder's forward as the plan runs it: the same maths as
:meth:`~exl3_core.archkit.decoder.StandardDecoder.forward_batch`, in the fastest form each step allows.

Three forms, chosen per step from host-side values:

* **deferred** (decode sizes, every block a plain Attention + GatedMLP block, fp16, CUDA): each
  RMSNorm runs inside the EXL3 linears around it (sums of squares handed on by the residual launches),
  the embedding lookup, the first norm's sums and the RoPE tables in one launch, the id carry-over of
  the one-step-ahead loop folded into that launch;
* **chain** (CUDA): each residual add inside the norm after it; a fresh prompt's chunk in bf16;
* **plain** (anything else, e.g. the CPU): each block's own forward.

In every form the last block runs past its attention only on the rows whose logits are wanted.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from exl3_core import ops
from exl3_core.archkit.batch import BatchMeta
from exl3_core.archkit.decoder import Head, StandardDecoder
from exl3_core.cache.layer import CacheLayers
from exl3_core.nn.embedding import Embedding
from exl3_core.nn.module import Communicator, ForwardState
from exl3_core.nn.norm import RMSNorm
from exl3_core.nn.rope import RotaryEmbedding
from exl3_core.plan.blocks import BlockRunner, kind
from exl3_core.plan.kernels import LinearKernels
from exl3_core.plan.linears import DeferredNorm, Projection
from exl3_core.plan.report import Decision, PartReport, decide
from exl3_core.quant.exl3.linear import REBUILD_MIN_ROWS, EXL3Linear
from exl3_core.tuning import Tuning

#: per decode step: the previous step's greedy ids on the device (int32 source row per row, -1: keep;
#: float64 ids), see :func:`exl3_core.ops.carry_ids`
Carry = tuple[torch.Tensor, torch.Tensor]


class DecoderExecutor:
    """Runs a :class:`StandardDecoder`'s batch forward in the plan's forms (module docstring)."""

    def __init__(self, model: StandardDecoder, tuning: Tuning, device: torch.device, fused: bool,
                 kernels: LinearKernels) -> None:
        self.model = model
        # the one-launch forms' row limit depends on the model's width: every runner reads this model's own
        k, width = tuning.kernels, model.arch_config.hidden_size
        rows = k.one_launch_rows(width)
        #: [] when the one-launch forms take more than 8 rows
        self.rows16_why = [] if rows > 8 else (
            [f"residual stream {width} wide, over fused_linear_wide_width {k.fused_linear_wide_width}"]
            if width > k.fused_linear_wide_width else [f"fused_linear_max_rows {k.fused_linear_max_rows}"])
        tuning = replace(tuning, kernels=replace(k, fused_linear_max_rows=rows))
        self.tuning = tuning
        self.fused = fused
        self.max_rows = rows
        self.blocks = [BlockRunner(i, b, tuning, device, fused, kernels) for i, b in enumerate(model.layers)]
        n = len(self.blocks)
        self.embed_known = type(model.embed) is Embedding
        self.norm_known = type(model.norm) is RMSNorm
        self.head_known = type(model.head) is Head
        chain = [f"layer {b.index}: {'; '.join(b.chain_why)}" for b in self.blocks if b.chain_why]
        if not self.norm_known:
            chain.append(f"final norm is {kind(model.norm)}, not RMSNorm")
        if n == 0:
            chain.append("no layers")
        #: [] when every residual add runs inside the norm after it
        self.chain_why = chain
        deferred = [f"layer {b.index}: {'; '.join(b.deferred_why)}" for b in self.blocks if b.deferred_why]
        if not self.norm_known:
            deferred.append(f"final norm is {kind(model.norm)}, not RMSNorm")
        if not self.head_known:
            deferred.append(f"head is {kind(model.head)}, not Head")
        if n == 0:
            deferred.append("no layers")
        #: [] when decode-size steps run with every norm deferred
        self.deferred_why = deferred
        start = list(deferred[:1])
        if not tuning.fusion.step_start:
            start.append("off in the tuning")
        if not self.embed_known:
            start.append(f"embedding is {kind(model.embed)}, not Embedding")
        rope = model.rope
        if not (type(rope) is RotaryEmbedding and not rope.dynamic):
            start.append("RoPE is dynamic (tables per token length) or custom")
        #: [] when a decode step's lookup, first norm sums and RoPE tables are one launch
        self.step_start_why = start
        self.rows_why = self.blocks[-1].rows_why if self.blocks else ["no layers"]
        self.bf16_why = self._bf16_why(device)
        self.head_proj = Projection("final norm in the head's prologue", (model.head.linear,), tuning, device,
                                    kernels) if self.head_known and getattr(model.head, "linear", None) is not None \
            else None

    def _bf16_why(self, device: torch.device) -> list[str]:
        why: list[str] = []
        if not self.tuning.fusion.prefill_bf16:
            why.append("off in the tuning")
        if not self.fused:
            why.append(f"model on {device.type}")
        why += self.chain_why[:1]
        for b in self.blocks:
            if b.attn_runner is None or b.mlp_runner is None:
                why.append(f"layer {b.index}: not an Attention + GatedMLP block")
                break
            a, m = b.attn_runner.attn, b.mlp_runner.mlp
            if not all(isinstance(x, EXL3Linear) for x in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate, m.up, m.down)):
                why.append(f"layer {b.index}: not every linear is EXL3 (their W is rebuilt in bf16)")
                break
        return why

    # -- reports ------------------------------------------------------------------------------------
    def report(self) -> list[PartReport]:
        m = self.model
        top = PartReport("model", kind(m), [
            decide("decode steps with every norm deferred into the linears", self.deferred_why,
                   f"1-{self.max_rows} rows, fp16"),
            decide("residual adds inside the norms after them", self.chain_why),
            decide("one-launch linears from 9 rows (the kernel's m16 loop)", self.rows16_why, f"up to {self.max_rows} rows"),
            decide("decode step start: lookup, first norm sums, RoPE tables in one launch", self.step_start_why),
            decide("last layer past its attention on the logits rows alone", self.rows_why),
            decide("fresh prompt's prefill in bf16", self.bf16_why,
                   f"one sequence, no cached prefix, {REBUILD_MIN_ROWS}+ tokens, fp16 model"),
        ])
        if self.head_proj is not None:
            top.decisions.append(Decision("final norm in the head's prologue at decode sizes",
                                          not self.head_proj.launch_why and not self.deferred_why,
                                          tuple(self.head_proj.launch_why + self.deferred_why[:1])))
        parts = [top]
        for b in self.blocks:
            parts.append(PartReport(f"layer {b.index}", kind(b.block), b.decisions(b is self.blocks[-1])))
        return parts

    # -- forward ------------------------------------------------------------------------------------
    def deferrable(self, rows: int, dtype: torch.dtype) -> bool:
        return (self.fused and not self.deferred_why and 1 <= rows <= self.max_rows and dtype == torch.float16)

    def forward(self, meta: BatchMeta, cache: CacheLayers | None, carry: Carry | None = None,
                comm: Communicator | None = None) -> torch.Tensor:
        """Logits in the head's dtype for ``meta.logits_indices`` (every row if None)."""
        m = self.model
        state = ForwardState(meta, cache, m.allowed_backends, m.plugins, comm)
        w = m.embed.weight if self.embed_known else None
        if w is not None and self.deferrable(meta.input_ids.shape[0], w.dtype):
            slots = 2 * len(self.blocks) + 1
            rope = m.rope
            if not self.step_start_why and isinstance(rope, RotaryEmbedding):
                h, ss, cos, sin = ops.step_start(meta.input_ids, w, m.embed.scale, slots, meta.positions,
                                                 rope.inv_freq, rope.attention_factor, carry=carry)
                state.memoize(("rope", id(rope)), lambda: (cos, sin))  # the key Attention.cos_sin reads
            else:
                h, ss = ops.embed_ss(meta.input_ids, w, m.embed.scale, slots, carry=carry)
            return self._deferred(h, meta, state, ss)
        if carry is not None:
            ops.carry_ids(meta.input_ids, *carry)
        x = m.embed(meta.input_ids)
        head_dtype = x.dtype  # the head (and so the logits) stays in the model's dtype
        if self._bf16(x, meta):
            x = x.to(torch.bfloat16)
        if self.fused and not self.chain_why:
            if self.deferrable(x.shape[0], x.dtype):
                return self._deferred(x, meta, state)
            return self._chain(x, meta, state, head_dtype)
        return self._plain(x, meta, state, head_dtype)

    def _bf16(self, x: torch.Tensor, meta: BatchMeta) -> bool:
        """A fresh prompt's chunk on CUDA (one sequence, no cached prefix, enough tokens that every linear
        multiplies by its rebuilt W) runs its activations and GEMM operands in bf16: at the H200's power
        cap cuBLAS's bf16 GEMMs draw less power than fp16 ones. Keys and values are stored in the cache's
        dtype and the head runs in the model's, so the decode steps after it are unchanged."""
        return (not self.bf16_why and x.dtype == torch.float16 and meta.phase == "prefill"
                and x.shape[0] >= REBUILD_MIN_ROWS and meta.fresh_single_sequence)

    def _last_rows(self, meta: BatchMeta) -> tuple[torch.Tensor | None, int]:
        """The rows the last block keeps, and how many of them are real: ``meta.logits_indices`` when fewer
        rows than the batch's want logits (a prefill wants its last token's); else ``(None, 0)``. No row at
        all (a prompt's middle chunk) keeps one row, dropped after the stack, so no kernel sees an empty batch."""
        idx = meta.logits_indices
        if idx is None or self.rows_why or idx.shape[0] >= meta.input_ids.shape[0]:
            return None, 0
        if idx.shape[0] == 0:
            return meta.input_ids.new_zeros(1), 0
        return idx, idx.shape[0]

    def _plain(self, x: torch.Tensor, meta: BatchMeta, state: ForwardState, head_dtype: torch.dtype) -> torch.Tensor:
        rows, keep = self._last_rows(meta)
        last = len(self.blocks) - 1
        for b in self.blocks:
            x = b.plain(x, state, rows if b.index == last else None)
        if rows is not None:
            x = x[:keep]  # the last block kept only the rows that need logits
        elif meta.logits_indices is not None:
            x = x.index_select(0, meta.logits_indices)
        return self.model.head(self.model.norm(x).to(head_dtype))

    def _chain(self, x: torch.Tensor, meta: BatchMeta, state: ForwardState, head_dtype: torch.dtype) -> torch.Tensor:
        pending: torch.Tensor | None = None
        rows, keep = self._last_rows(meta)
        last = len(self.blocks) - 1
        for b in self.blocks:
            x, pending = b.chain(x, pending, state, rows if b.index == last else None)
        norm = self.model.norm
        assert isinstance(norm, RMSNorm) and pending is not None
        idx = meta.logits_indices
        if rows is not None:  # the last block kept only the rows that need logits
            normed, _ = norm.forward_residual(pending[:keep], x[:keep])
        elif idx is not None:
            normed, _ = norm.forward_residual(pending.index_select(0, idx), x.index_select(0, idx))
        else:
            normed, _ = norm.forward_residual(pending, x)
        return self.model.head(normed.to(head_dtype))

    def _deferred(self, h: torch.Tensor, meta: BatchMeta, state: ForwardState,
                  ss: torch.Tensor | None = None) -> torch.Tensor:
        """``ss``: fp32 ``[2 * layers + 1, rows]``, row 0 ``h``'s row sums of squares (the first norm is deferred
        too) and the rest zeros; None: zeros here, and the first norm runs as a kernel."""
        rows = h.shape[0]
        ss_in: torch.Tensor | None = None
        if ss is None:
            ss = torch.zeros((2 * len(self.blocks) + 1, rows), dtype=torch.float32, device=h.device)
        else:
            ss_in = ss[0]
        # one fp32 slot of row sums per residual-producing launch (they add into it with atomics)
        for i, b in enumerate(self.blocks):
            h = b.deferred(h, ss_in, state, ss[2 * i + 1], ss[2 * i + 2])
            ss_in = ss[2 * i + 2]
        norm = self.model.norm
        assert isinstance(norm, RMSNorm) and ss_in is not None and self.head_proj is not None
        if meta.logits_indices is not None:  # norm + head only for the rows that need logits
            return self.model.head(norm(h.index_select(0, meta.logits_indices)))
        return self.head_proj.run(DeferredNorm(h, norm, ss_in))[0]
