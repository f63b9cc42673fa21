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
from exl3_core.nn.adapters import current_rows

#: the name every LoRA adapter object carries on its linear (one per linear, holding every adapter)
ADAPTER_NAME = "lora"


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


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

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = y + delta(x)`` summed in fp32, rounded once to ``out``'s dtype (``out`` may be ``y``)."""
        x2 = x.reshape(-1, self.in_features)
        try:
            y2, o2 = y.view(-1, self.out_features), out.view(-1, self.out_features)
        except RuntimeError:  # an output no 2-D view covers: add out of place
            o = self.add_delta(y.contiguous(), x, torch.empty_like(y.contiguous()))
            return out.copy_(o)
        if ops.fused_enabled(x2) and y2.stride(-1) == 1 and o2.stride(-1) == 1:
            if self._skip(x2):
                return out if out is y else out.copy_(y)
            from exl3_core.lora.kernels import lora_add

            lora_add(x2, y2, o2, self.stack, self.selection, self._kernel_rows(x2))
            return out
        d = self._delta2(x2)
        if d is None:
            return out if out is y else out.copy_(y)
        o2.copy_((y2.float() + d).to(out.dtype))
        return out

    def _skip(self, x2: torch.Tensor) -> bool:
        """No adapter is active (known on the host outside a graph capture): nothing to launch."""
        return not _capturing(x2) and self.selection.n_active == 0

    def _kernel_rows(self, x2: torch.Tensor) -> torch.Tensor | None:
        rows, n = self._rows(x2)
        if rows is None:
            self.selection.ensure(n, _capturing(x2))
        return rows

    def add_group(self, members: Sequence[object], ys: Sequence[torch.Tensor], x: torch.Tensor) -> bool:
        """The deltas of LoRA adapters on linears reading ``x`` (q/k/v, gate/up) in one launch pair: the Triton
        path with one selection and weight dtype, outputs with unit last strides; else False (one by one)."""
        from exl3_core.lora.kernels import MAX_GROUP, lora_add_group

        x2 = x.reshape(-1, self.in_features)
        if not ops.fused_enabled(x2) or not 1 <= len(members) <= MAX_GROUP:
            return False
        lins: list[LoraLinear] = []
        for m in members:
            if not (isinstance(m, LoraLinear) and m.selection is self.selection and m.in_features == self.in_features
                    and m.stack.a.dtype == self.stack.a.dtype):
                return False
            lins.append(m)
        y2s = []
        for y, m in zip(ys, lins):
            try:
                y2 = y.view(-1, m.out_features)
            except RuntimeError:
                return False
            if y2.stride(-1) != 1 or y2.dtype != ys[0].dtype:
                return False
            y2s.append(y2)
        if self._skip(x2):
            return True
        lora_add_group(x2, y2s, y2s, [m.stack for m in lins], self.selection, self._kernel_rows(x2))
        return True

    def __repr__(self) -> str:
        return (f"LoraLinear({self.key}: {len(self.stack.entries)} adapter(s), rank {self.stack.rank}, "
                f"slots {[e.slot for e in self.stack.entries]})")
