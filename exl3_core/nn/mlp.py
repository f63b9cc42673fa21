"""Feed-forward blocks: gated (``down(act(gate(x)) * up(x))``) and plain (``down(act(up(x)))``)."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from exl3_core import ops
from exl3_core.nn.module import LoadContext, Module
from exl3_core.nn.norm import DeferredNorm, add_residual_ss
from exl3_core.quant.exl3.linear import linear_residual, project_group, residual_fusable

Activation = Callable[[torch.Tensor], torch.Tensor]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# HF ``hidden_act`` names -> function. gelu_new/gelu_fast/gelu_pytorch_tanh are all the tanh
# approximation 0.5x(1+tanh(sqrt(2/pi)(x+0.044715x^3))), written differently.
ACTIVATIONS: dict[str, Activation] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "relu": F.relu,
}


# activations with a fused ``act(gate) * up`` kernel (exl3_core.ops), and their names for a down
# projection that can form the product itself (a linear's ``forward_act``)
_FUSED_ACT_MUL: dict[Activation, Callable[..., torch.Tensor]] = {F.silu: ops.silu_mul, _gelu_tanh: ops.gelu_tanh_mul}
_ACT_NAMES: dict[Activation, str] = {F.silu: "silu", _gelu_tanh: "gelu_tanh"}


def activation(name: str) -> Activation:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"hidden_act={name!r} in config.json is not supported; supported: "
                         f"{', '.join(sorted(ACTIVATIONS))}") from None


class GatedMLP(Module):
    """``down(act(gate(x)) * up(x))``.

    :param keys: checkpoint keys of the ``gate``, ``up`` and ``down`` linears.
    :param bias: whether the linears carry biases (None: use them if present).
    """

    gate: torch.nn.Module
    up: torch.nn.Module
    down: torch.nn.Module

    def __init__(self, *, hidden_size: int, intermediate_size: int, act: str, gate_key: str, up_key: str,
                 down_key: str, bias: bool | None = False) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.act_name = act
        self.act = activation(act)
        self.keys = (gate_key, up_key, down_key)
        self.bias = bias
        self.declare_slots("gate", "up", "down")

    def load_weights(self, ctx: LoadContext) -> None:
        g, u, d = self.keys
        h, i = self.hidden_size, self.intermediate_size
        self.attach_loaded("gate", ctx.linear(g, h, i, bias=self.bias))  # type: ignore[arg-type]
        self.attach_loaded("up", ctx.linear(u, h, i, bias=self.bias))  # type: ignore[arg-type]
        self.attach_loaded("down", ctx.linear(d, i, h, bias=self.bias))  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.gate is not None and self.up is not None and self.down is not None, "MLP is not loaded"
        gate, up = project_group(x, (self.gate, self.up))  # one launch when they can share it
        return self._down(gate, up)

    def forward_residual(self, x: torch.Tensor | DeferredNorm, residual: torch.Tensor, ss: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)`` with each row's sum of squares of the result added into ``ss`` (see
        :meth:`exl3_core.nn.attention.Attention.forward_residual`); the down projection forms the
        activation product in its prologue and adds the residual in its epilogue."""
        gate, up = project_group(x, (self.gate, self.up))
        name = _ACT_NAMES.get(self.act)
        if name is not None and ops.fused_enabled(up) and residual_fusable(self.down, up, residual, gate):
            return linear_residual(self.down, up, residual, ss, gate=gate, act=name)  # type: ignore[arg-type]
        return add_residual_ss(residual, self._down(gate, up), ss)

    def _down(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        fused = _FUSED_ACT_MUL.get(self.act) if ops.fused_enabled(up) else None
        if fused is not None:  # CUDA: act, cast and mul in one kernel, or inside the down projection's
            forward_act = getattr(self.down, "forward_act", None)
            y = forward_act(gate, up, _ACT_NAMES[self.act]) if forward_act is not None else None
            return y if y is not None else self.down(fused(gate, up))
        return self.down(self.act(gate) * up)

    #: the forward that :meth:`forward_residual` computes (see Attention.residual_forward_of)
    residual_forward_of = forward


class MLP(Module):
    """``down(act(up(x)))`` (no gate)."""

    up: torch.nn.Module
    down: torch.nn.Module

    def __init__(self, *, hidden_size: int, intermediate_size: int, act: str, up_key: str, down_key: str,
                 bias: bool | None = False) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.act_name = act
        self.act = activation(act)
        self.keys = (up_key, down_key)
        self.bias = bias
        self.declare_slots("up", "down")

    def load_weights(self, ctx: LoadContext) -> None:
        u, d = self.keys
        self.attach_loaded("up", ctx.linear(u, self.hidden_size, self.intermediate_size, bias=self.bias))  # type: ignore[arg-type]
        self.attach_loaded("down", ctx.linear(d, self.intermediate_size, self.hidden_size, bias=self.bias))  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.up is not None and self.down is not None, "MLP is not loaded"
        return self.down(self.act(self.up(x)))
