"""Finding a module's linears, grouping them by the tensor they read, and capturing ``H = Σ XᵀX``.

Nothing here knows a model family. The linears of a stage are found by walking its module tree;
which of them share an input (q/k/v read the same normed hidden state, gate/up the same MLP
input, every routed expert of a MoE the same tokens) is *observed* with forward pre-hooks during
the capture pass: linears that receive the same live tensor form one group and share one Hessian
(format spec 5.1/5.2). Two structural facts cannot be observed that way, and are declared in two
small tables keyed by building-block class:

* :data:`UNQUANTIZED_SLOTS`: linears that stay dense (MoE routers and shared-expert gates, as the
  reference quantizer keeps them);
* :data:`INPUT_ALIASES`: linears whose forward is never called because the block folds their
  weight into another computation (latent attention absorbs ``kv_b_proj``), with the submodule
  whose *output* is their input.

MoE blocks are captured with every expert seeing every token (the reference activates all
experts during capture), while the block's own output stays the normally routed one.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from exl3_core.nn.linear import DenseLinear
from exl3_core.nn.mla import LatentAttention
from exl3_core.nn.moe import MoE
from exl3_core.quant.exl3.hessian import HessianAccumulator

#: building-block class -> slots whose linears are never quantized
UNQUANTIZED_SLOTS: dict[type, tuple[str, ...]] = {MoE: ("router", "shared_gate")}
#: building-block class -> {linear slot: sibling slot whose output is that linear's input}
INPUT_ALIASES: dict[type, dict[str, str]] = {LatentAttention: {"kv_b_proj": "kv_a_norm"}}


@dataclass
class LinearSlot:
    """One linear of a stage: where it sits, its checkpoint key and whether it gets quantized."""

    key: str
    parent: torch.nn.Module
    attr: str
    path: str
    module: torch.nn.Module
    quantize: bool
    group: str | None = None  # key of the group leader (first linear seen reading the same input)

    @property
    def in_features(self) -> int:
        return int(self.module.in_features)  # type: ignore[arg-type]

    @property
    def out_features(self) -> int:
        return int(self.module.out_features)  # type: ignore[arg-type]

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features


def _is_linear(m: torch.nn.Module) -> bool:
    return isinstance(m, (DenseLinear, torch.nn.Linear))


def _expert_key(moe: MoE, index: int, attr: str, expert: torch.nn.Module) -> str | None:
    """Per-expert checkpoint key ``<experts>.<e>.<proj>`` (spec 1.4), also for fused source tensors."""
    names = ("gate", "up", "down")
    if attr not in names:
        return None
    return f"{moe.experts_key}.{index}.{moe.expert_proj_keys[names.index(attr)]}"


def find_linears(stage: torch.nn.Module, prefix: str = "") -> list[LinearSlot]:
    """Every dense linear under ``stage`` (pre-order, each module once), with its checkpoint key."""
    out: list[LinearSlot] = []
    seen: set[int] = set()

    def visit(parent: torch.nn.Module, path: str) -> None:
        for attr, child in parent._modules.items():
            if child is None:
                continue
            cpath = f"{path}.{attr}" if path else attr
            if _is_linear(child):
                if id(child) in seen:
                    continue
                seen.add(id(child))
                key = getattr(child, "key", None) or cpath
                moe = _owning_moe(stage, parent)
                if moe is not None and moe.experts is not None and parent in list(moe.experts):
                    key = _expert_key(moe, list(moe.experts).index(parent), attr, parent) or key
                skip = any(isinstance(parent, cls) and attr in slots for cls, slots in UNQUANTIZED_SLOTS.items())
                out.append(LinearSlot(key=key, parent=parent, attr=attr, path=cpath, module=child, quantize=not skip))
            else:
                visit(child, cpath)

    visit(stage, prefix)
    return out


def _owning_moe(stage: torch.nn.Module, parent: torch.nn.Module) -> MoE | None:
    for m in stage.modules():
        if isinstance(m, MoE) and m.experts is not None and any(parent is e for e in m.experts):
            return m
    return None


def _signature(x: torch.Tensor) -> tuple[Any, ...]:
    return (x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype, x.device)


@dataclass
class _Entry:
    ref: Any  # weakref to the tensor first seen with this signature
    leader: str


@dataclass
class HessianCapture:
    """Forward hooks that accumulate one ``Σ XᵀX`` per input group of a stage's quantized linears.

    Use as a context manager around forward passes of the *unquantized* stage; call
    :meth:`next_batch` before each pass. After the first pass :attr:`groups` maps each group
    leader's key to the keys of every linear reading that input.
    """

    stage: torch.nn.Module
    slots: list[LinearSlot]
    accumulators: dict[str, HessianAccumulator] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)
    _by_id: dict[int, LinearSlot] = field(default_factory=dict)
    _seen: dict[tuple[Any, ...], _Entry] = field(default_factory=dict)
    _suppress: set[int] = field(default_factory=set)
    _aliased: set[int] = field(default_factory=set)
    _alive: list[torch.Tensor] = field(default_factory=list)  # linears observed through INPUT_ALIASES only
    _handles: list[Any] = field(default_factory=list)
    #: called with (leader key, input) for every group input accumulated (error propagation's cross term)
    observer: Callable[[str, torch.Tensor], None] | None = None
    #: while True the hooks record nothing (a pass through the stage that must not count)
    paused: bool = False

    def __post_init__(self) -> None:
        self._by_id = {id(s.module): s for s in self.slots if s.quantize}

    # -- hooks ------------------------------------------------------------------------------------
    def _observe(self, slot: LinearSlot, x: torch.Tensor) -> None:
        if self.paused:
            return
        sig = _signature(x)
        entry = self._seen.get(sig)
        if entry is not None and entry.ref() is None:
            entry = None  # that tensor died and its memory was reused: a different input
        if entry is None:
            entry = self._seen[sig] = _Entry(weakref.ref(x), slot.key)
        if slot.group is None:
            slot.group = entry.leader
            self.groups.setdefault(entry.leader, []).append(slot.key)
        elif slot.group != entry.leader:
            # every pass must reproduce the first pass's sharing, or one Hessian would mix inputs
            raise RuntimeError(f"{slot.key}: its input is no longer the one {slot.group} reads (it was in the "
                               f"first calibration pass); the module's forward shares tensors inconsistently")
        if slot.group == slot.key:
            acc = self.accumulators.get(slot.key)
            if acc is None:
                acc = self.accumulators[slot.key] = HessianAccumulator(slot.in_features, name=f"{slot.key} input")
            acc.add(x)
            if self.observer is not None:
                self.observer(slot.key, x.reshape(-1, slot.in_features))

    def _pre_hook(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if id(module) in self._suppress or id(module) in self._aliased or not args:
            return
        self._observe(self._by_id[id(module)], args[0])

    def _alias_hook(self, slot: LinearSlot) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if isinstance(output, torch.Tensor):
                self._observe(slot, output.reshape(-1, output.shape[-1]))
        return hook

    def _moe_pre_hook(self, moe: MoE) -> Any:
        expert_ids = {id(m) for ex in (moe.experts or []) for m in ex.modules() if _is_linear(m)}

        def pre(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].reshape(-1, args[0].shape[-1])
            self._alive.append(x)  # the view must outlive this hook, or later readers of it look new
            with torch.no_grad():
                for ex in moe.experts or []:  # every expert sees every token (spec 5.1)
                    ex(x)
            self._suppress |= expert_ids  # the routed forward that follows must not count twice

        def post(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            self._suppress -= expert_ids
            self._alive.clear()
        return pre, post

    # -- lifetime ---------------------------------------------------------------------------------
    def __enter__(self) -> HessianCapture:  # noqa: PYI034 - a dataclass, Self adds nothing here
        for slot in self.slots:
            if slot.quantize:
                self._handles.append(slot.module.register_forward_pre_hook(self._pre_hook))
        for m in self.stage.modules():
            if isinstance(m, MoE):
                pre, post = self._moe_pre_hook(m)
                self._handles.append(m.register_forward_pre_hook(pre))
                self._handles.append(m.register_forward_hook(post))
            for cls, aliases in INPUT_ALIASES.items():
                if not isinstance(m, cls):
                    continue
                for lin_attr, src_attr in aliases.items():
                    lin, src = m._modules.get(lin_attr), getattr(m, src_attr, None)
                    target = self._by_id.get(id(lin)) if lin is not None else None
                    if target is not None and isinstance(src, torch.nn.Module):
                        self._aliased.add(id(lin))  # e.g. an identity probe that re-derives folded weights
                        self._handles.append(src.register_forward_hook(self._alias_hook(target)))
        return self

    def next_batch(self) -> None:
        """Start a new forward pass (call before each one)."""
        self._seen.clear()

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._seen.clear()
        self._suppress.clear()
        self._aliased.clear()

    def unseen(self) -> list[str]:
        """Keys of quantized linears that never received an input (they get no Hessian)."""
        return [s.key for s in self.slots if s.quantize and s.group is None]
