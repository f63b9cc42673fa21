"""The LoRA adapter of one linear: every loaded adapter that targets it, stacked, applied per row.

For the step's active slots ``u`` (:class:`~exl3_core.lora.selection.Selection`) and each row ``t``::

    delta[t] = sum_u  coef[t, u] * scale[slot_u] * (x[t] A[slot_u]ᵀ) B[slot_u]ᵀ

``A``/``B`` of the adapters on this linear are stacked (``a [S, r, in]``, ``bt [S, r, out]``, ranks
zero-padded to the largest), and two small tables map a global slot to its place in the stack and to
its PEFT scale (0 where the adapter does not target this linear). Only the active slots' weights are
read, so a batch mixing adapters costs each adapter's weights once plus a rank-sized product per row
and active adapter. The torch form below is the reference (CPU); on CUDA two Triton kernels
(:mod:`exl3_core.lora.kernels`) run it with the adapter count read on the device, graph-capturable.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from exl3_core import ops
from exl3_core.lora.selection import Selection
from exl3_core.lora.stack import LoraStack
from exl3_core.nn.adapters import AdapterInput, PendingDeltas, current_rows, finish_residual, formed

#: the name every LoRA adapter object carries on its linear (one per linear, holding every adapter)
ADAPTER_NAME = "lora"


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _rows2(t: torch.Tensor, width: int) -> torch.Tensor | None:
    """``t`` as ``[rows, width]`` with a unit last stride, without a copy; None where no view does."""
    try:
        t2 = t.view(-1, width)
    except RuntimeError:
        return None
    return t2 if t2.stride(-1) == 1 else None


class LoraLinear:
    """The :class:`~exl3_core.nn.adapters.FusedAdapter` that carries every LoRA of one linear.

    :param key: the linear's checkpoint key (messages).
    :param stack: the adapters on it.
    :param selection: the model's per-step choice of adapters per row.
    """

    name = ADAPTER_NAME

    def __init__(self, key: str, in_features: int, out_features: int, stack: LoraStack, selection: Selection) -> None:
        self.key = key
        self.in_features = in_features
        self.out_features = out_features
        self.stack = stack
        self.selection = selection

    def _rows(self, x2: torch.Tensor) -> tuple[torch.Tensor | None, int]:
        rows = current_rows()
        if rows is not None and rows.shape[0] != x2.shape[0]:
            raise RuntimeError(f"{self.key}: LoRA input has {x2.shape[0]} rows but the row map names "
                               f"{rows.shape[0]}")
        return rows, x2.shape[0]

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., out]`` fp32 (zeros where no row uses an adapter of this linear)."""
        x2 = x.reshape(-1, self.in_features)
        d = self._delta2(x2)
        if d is None:
            d = torch.zeros((x2.shape[0], self.out_features), dtype=torch.float32, device=x.device)
        return d.view(*x.shape[:-1], self.out_features)

    def _delta2(self, x2: torch.Tensor) -> torch.Tensor | None:
        """The torch form on ``x2 [n, in]``: fp32 ``[n, out]``, or None when no adapter is active (host-known)."""
        sel, st = self.selection, self.stack
        capturing = _capturing(x2)
        u = sel.capacity if capturing else sel.n_active
        if u == 0:
            return None
        rows, n = self._rows(x2)
        slots = sel.slots[:u]
        coef = sel.coef_rows(n, rows, capturing)[:, :u] * st.scale.index_select(0, slots)  # [n, u]
        local = st.local.index_select(0, slots)
        a = st.a.index_select(0, local).float()  # [u, r, in]
        bt = st.bt.index_select(0, local).float()  # [u, r, out]
        xa = torch.einsum("ti,uri->tur", x2.float(), a) * coef[:, :, None]
        return torch.einsum("tur,uro->to", xa, bt)

    def add_delta(self, y: torch.Tensor, x: AdapterInput, out: torch.Tensor) -> torch.Tensor:
        """``out = y + delta(x)`` summed in fp32, rounded once to ``out``'s dtype (``out`` may be ``y``)."""
        pending = self.begin_group([self], x, fallback=True)
        assert pending is not None
        return pending.finish([y], [out])[0]

    def _add_torch(self, y: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        d = self._delta2(x.reshape(-1, self.in_features))
        if d is None:
            return out if out is y else out.copy_(y)
        o = (y.reshape(-1, self.out_features).float() + d).to(out.dtype)
        return out.copy_(o.view(out.shape))

    def _skip(self, x2: torch.Tensor) -> bool:
        """No adapter is active (known on the host outside a graph capture): nothing to launch."""
        return not _capturing(x2) and self.selection.n_active == 0

    def _kernel_rows(self, x2: torch.Tensor) -> torch.Tensor | None:
        rows, n = self._rows(x2)
        if rows is None:
            self.selection.ensure(n, _capturing(x2))
        return rows

    def begin_group(self, members: Sequence[object], x: AdapterInput, fallback: bool = False) -> PendingDeltas | None:
        """The deltas of LoRA adapters on linears reading ``x`` (q/k/v, gate/up, or this one alone): the shrink
        now, then the expand once the outputs exist (the Triton path, with one selection and weight dtype); else
        None, or with ``fallback`` the torch form at finish."""
        from exl3_core.lora.kernels import MAX_GROUP, ShrinkInput, lora_expand, lora_shrink, sums_fit

        lins: list[LoraLinear] = []
        for m in members:
            if not (isinstance(m, LoraLinear) and m.selection is self.selection and m.in_features == self.in_features
                    and m.stack.a.dtype == self.stack.a.dtype):
                return None
            lins.append(m)
        inp = ShrinkInput.of(x, self.in_features) if len(lins) <= MAX_GROUP else None
        if inp is None or not ops.fused_enabled(inp.x2):
            if not fallback:
                return None
            return PendingDeltas(lambda ys, outs: [m._add_torch(y, formed(x), o) for y, o, m in zip(ys, outs, lins)])
        if self._skip(inp.x2):
            return PendingDeltas(lambda ys, outs: [o if o is y else o.copy_(y) for y, o in zip(ys, outs)])
        shrunk = lora_shrink(inp, [m.stack for m in lins], self.selection, self._kernel_rows(inp.x2))

        def finish(ys: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
            y2s, o2s = [], []
            for y, o, m in zip(ys, outs, lins):
                y2, o2 = _rows2(y, m.out_features), _rows2(o, m.out_features)
                if y2 is None or o2 is None or y.dtype != ys[0].dtype or o.dtype != ys[0].dtype:
                    break
                y2s.append(y2)
                o2s.append(o2)
            else:
                lora_expand(shrunk, y2s, o2s)
                return list(outs)
            # an output no unit-strided 2-D view covers: the expand into contiguous copies
            yc = [y.reshape(-1, m.out_features).contiguous().to(ys[0].dtype) for y, m in zip(ys, lins)]
            lora_expand(shrunk, yc, yc)
            return [o.copy_(c.view(o.shape)) for o, c in zip(outs, yc)]

        def finish_ss(h: torch.Tensor, ss: torch.Tensor) -> torch.Tensor:
            h2 = _rows2(h, lins[0].out_features)
            if h2 is None or h2.shape[1] != h.shape[-1] or ss.device != h.device or not sums_fit(ss, h2.shape[0]):
                return finish_residual(PendingDeltas(finish), h, ss)
            lora_expand(shrunk, [h2], [h2], ss=ss)  # the sums' change added by the expand itself
            return h

        return PendingDeltas(finish, finish_ss if len(lins) == 1 else None)

    def __repr__(self) -> str:
        return (f"LoraLinear({self.key}: {len(self.stack.entries)} adapter(s), rank {self.stack.rank}, "
                f"slots {[e.slot for e in self.stack.entries]})")
