"""The LoRA adapters loaded on one model: load, unload, merge, and the per-row choice of each step.

Loading reads and checks the whole adapter (:func:`~exl3_core.lora.peft_io.read_adapter`), builds every
new stacked tensor on the device, and only then swaps them in (plain assignments that cannot fail):
a load that fails leaves the model exactly as it was. The base weights are never touched.

Every change bumps :attr:`LoraSet.generation`; whoever captured a graph of the model's forward (the
generator) captures it again, since the graph holds the old tensors' addresses.

Each adapter holds a *slot*; a step says which slots each of its rows uses, and with which weight, in
the set's :class:`~exl3_core.lora.selection.Selection`.
"""
from __future__ import annotations

import itertools
import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from exl3_core.lora.config import LoraError, check_choice
from exl3_core.lora.linear import ADAPTER_NAME, LoraLinear
from exl3_core.lora.peft_io import AdapterWeights, FusedParam, LinearShape, read_adapter
from exl3_core.lora.selection import RowGroup, Selection
from exl3_core.lora.stack import LoraStack, StackEntry
from exl3_core.nn.adapters import attach_adapter, detach_adapter
from exl3_core.nn.linear import DenseLinear, LinearBase

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
#: how a job names its adapters: name -> weight of its delta (1.0: as trained)
LoraChoice = Mapping[str, float]


@runtime_checkable
class AdapterRefusals(Protocol):
    """A module some of whose linears cannot carry an adapter says which and why."""

    def adapter_refusals(self) -> dict[str, str]: ...


@runtime_checkable
class FusedTargets(Protocol):
    """A module holding fused expert parameters as per-expert linears (see :class:`~exl3_core.lora.peft_io.FusedParam`)."""

    def fused_adapter_params(self) -> dict[str, tuple[tuple[torch.nn.Module, ...], ...]]: ...


_UIDS = itertools.count(1)


@dataclass(frozen=True)
class LoadedAdapter:
    """One load of an adapter (``uid`` tells it apart from a later load under the same name)."""

    name: str
    slot: int
    path: Path
    rank: int
    modules: tuple[str, ...]
    uid: int = 0


class LoraSet:
    """The adapters of one loaded model (see the module docstring). Built by :func:`lora_set`.

    :param model: the loaded model; its linears are found by their checkpoint keys.
    :param device: the model's device.
    :param dtype: the model's dtype (adapter weights are stored in it).
    """

    def __init__(self, model: LoraModel, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.adapters: dict[str, LoadedAdapter] = {}
        #: linear key -> the LoRA adapter object attached to it
        self.attached: dict[str, LoraLinear] = {}
        self.generation = 0
        self.selection = Selection(device, slots=4)

    # -- the model's linears -------------------------------------------------------------------------
    def linears(self) -> dict[str, torch.nn.Module]:
        """Every linear of the model by checkpoint key."""
        out: dict[str, torch.nn.Module] = {}
        for m in self.model.modules():
            if isinstance(m, LinearBase) and isinstance(m, torch.nn.Module):
                out.setdefault(m.key, m)
        return out

    def refusals(self, linears: Mapping[str, torch.nn.Module]) -> dict[str, str]:
        out: dict[str, str] = {}
        for m in self.model.modules():
            if isinstance(m, AdapterRefusals):
                out.update(m.adapter_refusals())
        for key, lin in linears.items():
            if getattr(lin, "shard", None) is not None:
                out[key] = "it holds a tensor-parallel shard (adapters on sharded linears are not supported)"
            elif any(a.name == ADAPTER_NAME and not isinstance(a, LoraLinear) for a in getattr(lin, "adapters", ())):
                out[key] = f"another adapter named {ADAPTER_NAME!r} is attached to it"
        return out

    def fused(self) -> list[FusedParam]:
        out = []
        for m in self.model.modules():
            if isinstance(m, FusedTargets):
                for key, groups in m.fused_adapter_params().items():
                    if not groups:
                        continue
                    out.append(FusedParam(key, tuple(tuple(_key(lin) for lin in g) for g in groups),
                                          _shape(groups[0][0]).in_features,
                                          tuple(_shape(lin).out_features for lin in groups[0])))
        return out

    # -- load / unload ----------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self.adapters)

    def load(self, path: str | os.PathLike[str], name: str | None = None) -> str:
        """Read the PEFT folder ``path`` and attach it as ``name`` (default: the folder's name); returns the name.

        :raises LoraError: naming the file and tensor; the model is then unchanged.
        """
        folder = Path(path).expanduser()
        name = folder.resolve().name if name is None else name
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise LoraError(f"adapter name {name!r} (from {folder}): use letters, digits, '.', '_' and '-' "
                            f"(a name for the adapter may be given explicitly)")
        if name in self.adapters:
            raise LoraError(f"an adapter named {name!r} is loaded already (from {self.adapters[name].path}); "
                            f"unload it first or choose another name")
        linears = self.linears()
        shapes = {k: _shape(m) for k, m in linears.items()}
        what = str(getattr(getattr(self.model, "config", None), "directory", "this model"))
        weights = read_adapter(folder, shapes, self.refusals(linears), self.fused(), what=f"the model at {what}")
        slot = self._free_slot()
        capacity = self.selection.capacity
        while slot >= capacity:
            capacity *= 2
        stacks = self._stacks_with(weights, slot, capacity)  # every allocation happens here
        self._commit(stacks, linears, capacity)
        self.adapters[name] = LoadedAdapter(name, slot, folder, max(d.rank for d in weights.modules.values()),
                                            tuple(sorted(weights.modules)), next(_UIDS))
        log.info("LoRA %s loaded from %s: %d linears, rank %d", name, folder, len(weights.modules),
                 self.adapters[name].rank)
        return name

    def _free_slot(self) -> int:
        used = {a.slot for a in self.adapters.values()}
        return next(i for i in range(len(used) + 1) if i not in used)

    def _stacks_with(self, weights: AdapterWeights, slot: int, capacity: int) -> dict[str, LoraStack | None]:
        out: dict[str, LoraStack | None] = {}
        for key, d in weights.modules.items():
            entries = list(self.attached[key].stack.entries) if key in self.attached else []
            entries.append(StackEntry(slot, d.a, d.b.t(), d.scale))
            out[key] = LoraStack.build(sorted(entries, key=lambda e: e.slot), capacity, self.device, self.dtype)
        if capacity != self.selection.capacity:
            for key, ad in self.attached.items():
                if key not in out:
                    out[key] = ad.stack.resized(capacity)
        return out

    def _commit(self, stacks: Mapping[str, LoraStack | None], linears: Mapping[str, torch.nn.Module],
                capacity: int) -> None:
        """Swap the new stacks in (nothing here allocates on the device but the selection's buffers, built
        before any linear changes)."""
        selection = self.selection
        if capacity != selection.capacity:
            selection = Selection(self.device, capacity, selection.row_capacity)
        for key, stack in stacks.items():
            ad = self.attached.get(key)
            if stack is None:
                if ad is not None:
                    detach_adapter(linears[key], ADAPTER_NAME)
                    del self.attached[key]
                continue
            if ad is None:
                lin = linears[key]
                shape = _shape(lin)
                ad = LoraLinear(key, shape.in_features, shape.out_features, stack, selection)
                attach_adapter(lin, ad)
                self.attached[key] = ad
            else:
                ad.stack = stack
        if selection is not self.selection:
            self.selection = selection
            for ad in self.attached.values():
                ad.selection = selection
        self.generation += 1

    def unload(self, name: str) -> None:
        """Detach adapter ``name``; jobs still naming it fail at their next step.

        :raises LoraError: when no adapter of that name is loaded."""
        ad = self._get(name)
        linears = self.linears()
        stacks = {key: self.attached[key].stack.without(ad.slot) for key in ad.modules if key in self.attached}
        self._commit(stacks, linears, self.selection.capacity)
        del self.adapters[name]
        self.selection.clear()
        log.info("LoRA %s unloaded", name)

    def _get(self, name: str) -> LoadedAdapter:
        if name not in self.adapters:
            raise LoraError(f"no LoRA adapter named {name!r} is loaded (loaded: {', '.join(self.names()) or 'none'})")
        return self.adapters[name]

    # -- merge -----------------------------------------------------------------------------------------
    def merge(self, name: str, weight: float = 1.0) -> None:
        """Fold adapter ``name`` (times ``weight``) into the dense weights it targets and unload it: every
        job then runs with it, at no per-token cost.

        :raises LoraError: when any target is an EXL3 (quantized) linear: its weights are a trellis code that
            only re-quantizing can change (convert the base with the adapter merged: ``exl3 convert --lora``);
            nothing is merged then.
        """
        ad = self._get(name)
        linears = self.linears()
        quantized = [k for k in ad.modules if not isinstance(linears.get(k), DenseLinear)]
        if quantized:
            shown = ", ".join(quantized[:4]) + (f" and {len(quantized) - 4} more" if len(quantized) > 4 else "")
            raise LoraError(f"cannot merge LoRA {name!r}: {shown} {'is' if len(quantized) == 1 else 'are'} EXL3-"
                            f"quantized, and a trellis code cannot absorb a delta without re-quantizing. Keep the "
                            f"adapter loaded (it runs beside the quantized weights), or quantize the base with the "
                            f"adapter merged: exl3 convert -i BASE_HF_DIR -o OUT -b BITS --lora {ad.path}")
        for key in ad.modules:
            lin = linears[key]
            assert isinstance(lin, DenseLinear)
            entry = next(e for e in self.attached[key].stack.entries if e.slot == ad.slot)
            _merge_into(lin.weight, entry, weight)
        self.unload(name)

    # -- choosing per row --------------------------------------------------------------------------------
    def slots_of(self, loras: LoraChoice) -> dict[int, float]:
        """``{slot: weight}`` of a job's ``{name: weight}``.

        :raises LoraError: naming an adapter that is not loaded."""
        out: dict[int, float] = {}
        for n, w in loras.items():
            out[self._get(n).slot] = out.get(self._get(n).slot, 0.0) + float(w)
        return out

    def select(self, groups: Sequence[RowGroup]) -> None:
        """The next forward's choice: ``groups`` of ``({slot: weight}, rows)`` in row order."""
        self.selection.fill(groups)

    @contextmanager
    def using(self, loras: LoraChoice | Sequence[LoraChoice | None] | None, rows_each: int, count: int = 1) -> Iterator[None]:
        """Within the block, a forward of ``count`` sequences of ``rows_each`` rows uses ``loras`` (one choice for
        all, or one per sequence); afterwards no row uses an adapter."""
        per = [loras] * count if loras is None or isinstance(loras, Mapping) else list(loras)
        if len(per) != count:
            raise LoraError(f"loras: {len(per)} choices for a batch of {count} sequences; give one per sequence "
                            f"or a single mapping for all")
        groups = [(self.slots_of(check_choice(c)), rows_each) for c in per]
        self.select(groups)
        try:
            yield
        finally:
            self.selection.clear()


def _merge_into(w: torch.Tensor, e: StackEntry, weight: float, chunk: int = 4096) -> None:
    """``w [out, in] += weight * scale * B A`` in fp32, a block of rows at a time (bounded extra memory)."""
    a = e.a.float()
    for r0 in range(0, w.shape[0], chunk):
        b = e.bt[:, r0:r0 + chunk].float().t()  # [rows, r]
        w[r0:r0 + chunk] = (w[r0:r0 + chunk].float() + (b @ a) * (e.scale * weight)).to(w.dtype)


def _shape(lin: torch.nn.Module) -> LinearShape:
    assert isinstance(lin, LinearBase)
    return LinearShape(lin.in_features, lin.out_features)


def _key(lin: torch.nn.Module) -> str:
    assert isinstance(lin, LinearBase)
    return lin.key


@runtime_checkable
class LoraModel(Protocol):
    """What an adapter set needs of its model: a loaded module tree on one device, in one dtype."""

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def modules(self) -> Iterator[torch.nn.Module]: ...


def attached(model: torch.nn.Module) -> LoraSet | None:
    """The model's adapter set, or None when no adapter was ever loaded on its current load."""
    s = model.__dict__.get("_lora_set")
    return s if isinstance(s, LoraSet) else None


def lora_set(model: torch.nn.Module) -> LoraSet:
    """The model's adapter set, created on first use (the model must be loaded)."""
    s = attached(model)
    if s is None:
        assert isinstance(model, LoraModel), f"{type(model).__name__} is not a loaded model"
        s = LoraSet(model, torch.device(model.device), model.dtype)
        model.__dict__["_lora_set"] = s
    return s


def forget(model: torch.nn.Module) -> None:
    """Drop the model's adapter set (its linears are gone: the model was unloaded)."""
    model.__dict__.pop("_lora_set", None)
