"""Projections as the plan runs them: linears sharing an input in one launch, norms deferred into a
linear's prologue, residual adds in its epilogue.

Each form has *static* conditions (layer types, bitrates, widths, kernels built, tuning), decided
once when the plan is built and reported, and *runtime* conditions (rows in the step, dtypes,
hooks), checked per call from host-side values only. Every form computes what the plain modules
compute; where it cannot run, the plain call runs.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from exl3_core import ops
from exl3_core.nn.adapters import (
    AdapterInput,
    GatedInput,
    NormedInput,
    PendingDeltas,
    begin_adapters,
    finish_residual,
    norm_formable,
)
from exl3_core.nn.norm import RMSNorm
from exl3_core.plan.kernels import LinearKernels
from exl3_core.plan.report import Decision, decide
from exl3_core.quant.exl3.linear import (
    REBUILD_MIN_ROWS,
    EXL3Linear,
    NormPrologue,
    RopeCacheEpilogue,
    launch_outputs,
    launch_unsupported,
    rebuild_unsupported,
    takes_unpadded,
)
from exl3_core.tuning import Tuning


@dataclass(frozen=True)
class DeferredNorm:
    """``norm(h)``, not yet computed: the input of the linear(s) after a pre-norm, handed over as the
    residual stream ``h`` plus ``ss``, fp32 ``[>= rows]`` sums of squares of ``h``'s rows added up by
    the launch that produced ``h``. A launch that can normalise in its prologue reads both and no norm
    kernel runs; anything else calls :meth:`materialize`."""

    h: torch.Tensor
    norm: RMSNorm
    ss: torch.Tensor

    def materialize(self) -> torch.Tensor:
        return self.norm(self.h)

    def adapter_input(self) -> NormedInput:
        """The normed rows as adapters read them (their kernels may normalise as they load)."""
        return NormedInput(self.h, self.ss, self.norm.weight, self.norm.eps, self.norm.offset, self.materialize)


def add_residual_ss(residual: torch.Tensor, y: torch.Tensor, ss: torch.Tensor) -> torch.Tensor:
    """``residual + y`` (rounded to the stream's dtype, as the fused residual norm), with each row's
    sum of squares of the result added into ``ss``: the unfused form of a residual-producing launch."""
    h = (residual.float() + y.float()).to(residual.dtype)
    rows = h.reshape(-1, h.shape[-1])
    ss[: rows.shape[0]] += rows.float().pow(2).sum(-1)
    return h


def hooked(layers: tuple[torch.nn.Module, ...]) -> bool:
    """A launch never calls the layers' own forward, so their hooks (e.g. a converter's input capture)
    would see nothing: layers with hooks run one by one."""
    return any(m._forward_pre_hooks or m._forward_hooks for m in layers)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1)


class Projection:
    """Linears that read the same input (q/k/v, gate/up, or one alone).

    :param name: for reports (``"q/k/v"``).
    :param layers: the linears, in output order.
    :param tuning: which fusions are allowed and the launch sizes.
    :param device: where the model runs.
    :param kernels: the one-launch kernels (the compiled ones, or a test's stand-in).
    """

    def __init__(self, name: str, layers: tuple[torch.nn.Module, ...], tuning: Tuning, device: torch.device,
                 kernels: LinearKernels) -> None:
        self.name = name
        self.layers = layers
        self.device = device
        self.kernels = kernels
        self.max_rows = tuning.kernels.fused_linear_max_rows
        allowed = tuning.fusion.grouped_projections
        #: [] when 1-3 EXL3 linears can run in one launch at decode sizes (with a norm prologue)
        self.launch_why = kernels.unavailable(device, "group_ex") + launch_unsupported(layers)
        group = launch_unsupported(layers, pads_input=True) if len(layers) >= 2 else [f"{len(layers)} linear"]
        group = kernels.unavailable(device, "group") + group
        if not allowed:
            group.append("grouped projections off in the tuning")
        self.group_why = group
        rebuild = rebuild_unsupported(layers) if len(layers) >= 2 else [f"{len(layers)} linear"]
        rebuild = kernels.unavailable(device, "rebuild_gemm") + rebuild
        if not allowed:
            rebuild.append("grouped projections off in the tuning")
        self.rebuild_why = rebuild

    @property
    def has_adapters(self) -> bool:
        """Whether any of the linears carries an adapter now (adapters come and go after the plan is built)."""
        return any(getattr(m, "adapters", ()) for m in self.layers)

    def decisions(self) -> list[Decision]:
        return [decide(f"{self.name}: one launch", self.group_why, f"steps of 1-{self.max_rows} rows"),
                decide(f"{self.name}: one rebuilt-W GEMM", self.rebuild_why, f"steps of {REBUILD_MIN_ROWS}+ rows")]

    def _lins(self) -> list[EXL3Linear]:
        return list(self.layers)  # type: ignore[arg-type]

    def launchable(self, h: torch.Tensor, no_bias: bool = False) -> bool:
        """Runtime conditions of the one-launch kernel on ``h`` (fp16, 1..max rows, no hooks)."""
        return (not self.launch_why and h.device == self.device and h.dtype == torch.float16
                and 1 <= _rows(h) <= self.max_rows
                and h.shape[-1] in self._widths() and not hooked(self.layers)
                and all(m.trellis.device == h.device and not (no_bias and m.bias is not None) for m in self._lins()))

    def _prologue_ok(self, d: DeferredNorm) -> bool:
        return norm_formable(d.h, d.ss, d.norm.weight)

    def _grouped_adapters(self) -> bool:
        """The adapters' deltas are added for the group at once (else each linear, run as a module, adds its own)."""
        return self.has_adapters and not hooked(self.layers) and all(isinstance(m, EXL3Linear) for m in self.layers)

    def _adapters(self, x: torch.Tensor | DeferredNorm) -> PendingDeltas | None:
        """The adapters' part that reads only the input (their kernels may form it as they load it), launched
        after the linears' own launch, so that launch directly follows the kernel before it; None: no adapters."""
        if not self._grouped_adapters():
            return None
        return begin_adapters(x.adapter_input() if isinstance(x, DeferredNorm) else x, self.layers)

    def run(self, x: torch.Tensor | DeferredNorm) -> list[torch.Tensor]:
        """``[layer(x) for layer in layers]``, in one launch where the kernels take it."""
        if isinstance(x, DeferredNorm):
            if self.launchable(x.h) and self._prologue_ok(x):
                ys = self.kernels.group_ex(x.h.reshape(-1, x.h.shape[-1]), self._lins(),
                                           NormPrologue(x.ss, x.norm.weight, x.norm.eps, x.norm.offset), None)
                return self._finish(ys, x.h, self._adapters(x))
            x = x.materialize()
        rows = _rows(x)
        if (not self.rebuild_why and x.device == self.device and rows >= REBUILD_MIN_ROWS and not hooked(self.layers)
                and all(m.trellis.device == x.device for m in self._lins())):
            return self._finish(self.kernels.rebuild_gemm(self._padded2(x), self._lins()), x, self._adapters(x))
        if not self.group_why and self.launchable_plain(x):
            return self._finish(self.kernels.group(self._padded2(x), self._lins()), x, self._adapters(x))
        if self._grouped_adapters():  # one by one, the adapters' deltas grouped (one launch pair, not one per linear)
            ys = [m.forward_base(x) for m in self._lins()]
            pending = self._adapters(x)
            assert pending is not None
            return pending.finish(ys, ys)
        return [m(x) for m in self.layers]  # each linear adds its own adapters' deltas

    def launchable_plain(self, x: torch.Tensor) -> bool:
        """Runtime conditions of the grouped launch on a plain input (any float dtype: it casts)."""
        return (x.device == self.device and 1 <= _rows(x) <= self.max_rows and not hooked(self.layers)
                and all(m.trellis.device == x.device for m in self._lins()))

    def run_epilogue(self, x: torch.Tensor | DeferredNorm, ep: RopeCacheEpilogue) -> list[torch.Tensor]:
        """q/k/v with RoPE and the cache write in the launch's epilogue (the caller checked
        :meth:`launchable` with ``no_bias`` and the epilogue's own conditions)."""
        if isinstance(x, DeferredNorm) and self._prologue_ok(x):
            ys = self.kernels.group_ex(x.h.reshape(-1, x.h.shape[-1]), self._lins(),
                                       NormPrologue(x.ss, x.norm.weight, x.norm.eps, x.norm.offset), ep)
            return self._finish(ys, x.h, None)
        h = x.materialize() if isinstance(x, DeferredNorm) else x
        return self._finish(self.kernels.group_ex(h.reshape(-1, h.shape[-1]), self._lins(), None, ep), h, None)

    def _widths(self) -> tuple[int, int]:
        """The input widths the kernels take: the layers' own and the padded one."""
        m = self._lins()[0]
        return m.in_features, m.padded_in_features

    def _padded2(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as rows, padded only where the kernels cannot read it unpadded."""
        x2 = x.reshape(-1, x.shape[-1])
        width = self._lins()[0].padded_in_features
        if x2.shape[-1] < width and not takes_unpadded(x2.shape[-1], width):
            return torch.nn.functional.pad(x2, (0, width - x2.shape[-1]))
        return x2

    def _finish(self, ys: list[torch.Tensor], like: torch.Tensor, pending: PendingDeltas | None) -> list[torch.Tensor]:
        """The launch's outputs as the layers' (trimmed, biased), with ``pending``'s deltas added (the launch does
        not add them)."""
        out = launch_outputs(self._lins(), ys, tuple(like.shape[:-1]), like.dtype)
        return pending.finish(out, out) if pending is not None else out


ActMul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ResidualOut:
    """A residual-producing linear (o_proj, down): ``residual + layer(x)`` and the rows' sums of squares
    for the next deferred norm, in one launch at decode sizes; with ``act`` (the name of a fused
    activation, :data:`exl3_core.kernels.codes.ACT_CODES`), the layer's input may be ``act(gate) * x``,
    formed in the launch's prologue."""

    def __init__(self, name: str, layer: torch.nn.Module, tuning: Tuning, device: torch.device,
                 kernels: LinearKernels, act: str | None = None) -> None:
        self.name = name
        self.layer = layer
        self.act = act
        self.device = device
        self.kernels = kernels
        self.max_rows = tuning.kernels.fused_linear_max_rows
        shape_why: list[str] = []
        if not isinstance(layer, EXL3Linear):
            shape_why.append(f"{type(layer).__name__}, not EXL3")
        else:
            if layer.bias is not None:
                shape_why.append("has a bias")
            if not takes_unpadded(layer.out_features, layer.padded_out_features):
                shape_why.append("output width not a multiple of 4")
            if not takes_unpadded(layer.in_features, layer.padded_in_features):
                shape_why.append("input width not a multiple of 4")
        #: [] when the layer itself suits the residual launch (whatever the device and sharding)
        self.shape_why = shape_why
        why: list[str] = kernels.unavailable(device, "residual") + shape_why
        if getattr(layer, "shard", None) is not None and layer.shard.needs_reduce:  # type: ignore[union-attr]
            why.append("row-parallel shard: the all-reduce comes between the projection and the residual add")
        #: [] when the residual launch applies at decode sizes
        self.why = why
        act_why: list[str] = kernels.unavailable(device, "act")
        if act is None:
            act_why.append("the activation has no fused kernel")
        if not tuning.fusion.act_in_down:
            act_why.append("off in the tuning")
        if not isinstance(layer, EXL3Linear):
            act_why.append(f"{type(layer).__name__}, not EXL3")
        #: [] when the activation product can form in this linear's prologue
        self.act_why = act_why
        #: the residual launch may form the product too (its own prologue, no other op needed)
        self.gate_ok = act is not None and tuning.fusion.act_in_down

    def decisions(self, gated: bool = False) -> list[Decision]:
        out = [decide(f"{self.name}: residual add in its epilogue", self.why, f"steps of 1-{self.max_rows} rows")]
        if gated:
            out.append(decide(f"{self.name}: activation product in its prologue", self.act_why,
                              f"steps of 1-{self.max_rows} rows"))
        return out

    def _fits(self, x: torch.Tensor, residual: torch.Tensor, gate: torch.Tensor | None) -> bool:
        m = self.layer
        assert isinstance(m, EXL3Linear)
        rows = _rows(x)
        return (x.device == self.device and x.dtype == torch.float16 and residual.dtype == torch.float16
                and rows <= self.max_rows
                and x.shape[-1] in (m.in_features, m.padded_in_features) and m.out_features == residual.shape[-1]
                and residual.numel() == rows * residual.shape[-1] and m.trellis.device == x.device
                and not hooked((m,)) and (gate is None or (gate.shape == x.shape and gate.dtype == torch.float16)))

    def product(self, gate: torch.Tensor, up: torch.Tensor, act_mul: ActMul) -> torch.Tensor:
        """``layer(act(gate) * up)``, the product in the launch's prologue where it fits."""
        m = self.layer
        if (not self.act_why and self.act is not None and isinstance(m, EXL3Linear) and up.device == self.device
                and gate.shape == up.shape and takes_unpadded(up.shape[-1], m.padded_in_features)
                and up.shape[-1] in (m.in_features, m.padded_in_features) and _rows(up) <= self.max_rows
                and up.dtype == torch.float16 and gate.dtype == torch.float16 and not hooked((m,))):
            rows = _rows(up)
            pending = begin_adapters(GatedInput(gate, up, self.act, lambda: act_mul(gate, up)), (m,)) \
                if m.adapters else None
            y = self.kernels.act(m, gate.reshape(rows, -1), up.reshape(rows, -1), self.act)
            if m.bias is not None:
                y = y + m.bias.to(y.dtype)
            y = y[:, : m.out_features].reshape(*up.shape[:-1], m.out_features)
            return pending.finish([y], [y])[0] if pending is not None else y
        return m(act_mul(gate, up))

    def run(self, x: torch.Tensor, residual: torch.Tensor, ss: torch.Tensor, plain: Callable[[], torch.Tensor],
            gate: torch.Tensor | None = None, act_mul: ActMul | None = None) -> torch.Tensor:
        """``residual + layer(x)`` (``layer(act(gate) * x)`` with ``gate``) with the result's row sums of
        squares added into ``ss``; ``plain()`` computes the layer's output (reduced over a tensor-parallel
        group where sharded) where the launch does not apply."""
        m = self.layer
        if not self.why and (gate is None or self.gate_ok) and self._fits(x, residual, gate):
            assert isinstance(m, EXL3Linear)
            h = self.kernels.residual(m, x, residual, ss, gate, self.act if gate is not None else None)
            if m.adapters:  # the adapter's delta joins the stream after the launch, which follows the kernel before
                inp: AdapterInput = x
                if gate is not None and act_mul is not None:  # a gate comes with a fused activation (gate_ok)
                    assert self.act is not None
                    inp = GatedInput(gate, x, self.act, lambda: act_mul(gate, x))
                h = finish_residual(begin_adapters(inp, (m,)), h, ss)
            return h
        return add_residual_ss(residual, plain(), ss)


def fused_ops(device: torch.device) -> bool:
    """Whether the Triton kernels of :mod:`exl3_core.ops` run for tensors on ``device``."""
    return ops.fused_enabled(torch.empty(0, device=device))
