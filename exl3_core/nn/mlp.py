"""Feed-forward blocks: gated (``down(act(gate(x)) * up(x))``) and plain (``down(act(up(x)))``)."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from exl3_core import ops
from exl3_core.nn.linear import shard_granularity, shard_linear
from exl3_core.nn.module import ForwardState, LoadContext, Module
from exl3_core.nn.shard import LinearShard, block_split

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


#: activations with a fused ``act(gate) * up`` kernel, by their kernel name (exl3_core.kernels.codes)
FUSED_ACT_NAMES: dict[Activation, str] = {F.silu: "silu", _gelu_tanh: "gelu_tanh"}


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

    def forward(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        y = self.down(self.act_mul(self.gate(x), self.up(x)))
        return state.all_reduce(y) if state is not None and self.down.shard is not None else y

    def apply_shard(self, rank: int, world: int) -> None:
        """Keep ``rank``'s share of the intermediate features (whole 128-feature blocks for EXL3 linears, as
        evenly as they go): gate/up cut by output, down by input (a partial sum that :meth:`forward` reduces).
        Call after loading, before attaching adapters."""
        g = shard_granularity(self.gate, self.up, self.down)
        start, stop = block_split(self.intermediate_size, world, g, f"intermediate features of {self.keys[2]}")[rank]
        self.attach_loaded("gate", shard_linear(self.gate, LinearShard("column", rank, world, start, stop)))
        self.attach_loaded("up", shard_linear(self.up, LinearShard("column", rank, world, start, stop)))
        self.attach_loaded("down", shard_linear(self.down, LinearShard("row", rank, world, start, stop)))

    def act_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up``: one kernel where the activation has one (:data:`FUSED_ACT_NAMES`)."""
        name = FUSED_ACT_NAMES.get(self.act)
        if name is not None and ops.fused_enabled(up):
            return ops.act_mul(name, gate, up)
        return self.act(gate) * up


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

    def forward(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        y = self.down(self.act(self.up(x)))
        return state.all_reduce(y) if state is not None and self.down.shard is not None else y

    def apply_shard(self, rank: int, world: int) -> None:
        """Keep ``rank``'s share of the intermediate features: up cut by output, down by input (reduced in
        :meth:`forward`)."""
        g = shard_granularity(self.up, self.down)
        start, stop = block_split(self.intermediate_size, world, g, f"intermediate features of {self.keys[1]}")[rank]
        self.attach_loaded("up", shard_linear(self.up, LinearShard("column", rank, world, start, stop)))
        self.attach_loaded("down", shard_linear(self.down, LinearShard("row", rank, world, start, stop)))
