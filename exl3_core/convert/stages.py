"""The conversion's unit of work: a *stage* (embedding, one block, final norm, head) of a model.

A model is converted stage by stage in forward order (format spec 5.1). Models built on the
standard decoder (``embed``, ``layers``, ``norm``, ``head``) need nothing extra; any other model
class can define ``conversion_stages() -> list[tuple[name, module, kind]]`` with kinds

* ``"embed"``: ``module(input_ids [T]) -> x [T, H]``
* ``"block"``: ``module(x [T, H], ForwardState) -> x``
* ``"map"``: ``module(x) -> x`` (norms and other state-only steps)
* ``"head"``: ``module(x) -> logits``; its linears all read the stage input, so their Hessian
  is built from the states directly (running a vocabulary-wide projection over every
  calibration token only to observe its input would dominate the conversion).

While the source model loads, :class:`RecordingSource` notes which checkpoint tensors each
stage's modules read: those are exactly the tensors the stage owns in the output.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.nn.mla import LatentAttention
from exl3_core.nn.module import ForwardState, Module
from exl3_core.nn.moe import MoE

StageKind = Literal["embed", "block", "map", "head"]


@dataclass
class Stage:
    index: int
    label: str  # attribute path in the model, e.g. "layers.3" (messages)
    module: torch.nn.Module
    kind: StageKind
    layer: int | None  # position in the block stack (bit allocation), None outside it
    reads: list[str] = field(default_factory=list)  # checkpoint tensors read while loading, in order

    @property
    def name(self) -> str:
        """The stage's checkpoint prefix (longest common dotted prefix of what it reads), or its label."""
        keys = [n.rsplit(".", 1)[0] for n in self.reads]
        if not keys:
            return self.label
        parts = keys[0].split(".")
        for k in keys[1:]:
            other = k.split(".")
            n = 0
            while n < min(len(parts), len(other)) and parts[n] == other[n]:
                n += 1
            parts = parts[:n]
        return ".".join(parts) or self.label


def conversion_stages(model: torch.nn.Module) -> list[Stage]:
    """The model's stages in forward order (see the module docstring)."""
    custom = getattr(model, "conversion_stages", None)
    if callable(custom):
        raw = list(custom())
    elif all(hasattr(model, a) for a in ("embed", "layers", "norm", "head")):
        raw = [("embed", model.embed, "embed")]
        raw += [(f"layers.{i}", blk, "block") for i, blk in enumerate(model.layers)]  # type: ignore[arg-type]
        raw += [("norm", model.norm, "map"), ("head", model.head, "head")]
    else:
        raise TypeError(f"{type(model).__name__} is not a standard decoder (embed/layers/norm/head) and defines no "
                        f"conversion_stages(); add that method to the architecture's model class to convert it")
    stages: list[Stage] = []
    layer = 0
    for i, (label, module, kind) in enumerate(raw):
        if kind not in ("embed", "block", "map", "head"):
            raise ValueError(f"{type(model).__name__}.conversion_stages(): stage {label!r} has unknown kind {kind!r}")
        stages.append(Stage(i, label, module, kind, layer if kind == "block" else None))
        layer += kind == "block"
    return stages


class RecordingSource:
    """A tensor source that remembers, per stage, which tensors were read (in order)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.directory: Path = inner.directory
        self.current: Stage | None = None
        self.unowned: list[str] = []

    def __contains__(self, name: object) -> bool:
        return name in self.inner

    def keys(self) -> list[str]:
        return list(self.inner.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.inner.shape(name))

    def get_tensor(self, name: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                   expect_shape: Collection[int | None] | None = None) -> torch.Tensor:
        reads = self.current.reads if self.current is not None else self.unowned
        if name not in reads:
            reads.append(name)
        return self.inner.get_tensor(name, device=device, dtype=dtype, expect_shape=expect_shape)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def load_recording(model: Any, stages: list[Stage], source: Any, device: torch.device) -> RecordingSource:
    """``model.load(device, fp32)`` through a :class:`RecordingSource`, attributing reads to stages."""
    rec = RecordingSource(source)
    owner: dict[int, Stage] = {}
    for st in stages:
        for m in st.module.modules():
            owner.setdefault(id(m), st)
    patched: list[Module] = []
    for m in model.exl3_modules():
        owner_st = owner.get(id(m))
        orig = m.load_weights

        def tagged(ctx: Any, _orig: Any = orig, _st: Stage | None = owner_st) -> None:
            rec.current = _st
            try:
                _orig(ctx)
            finally:
                rec.current = None

        m.load_weights = tagged  # type: ignore[method-assign]
        patched.append(m)
    try:
        model.load(device=device, dtype=torch.float32, source=rec)
    finally:
        for m in patched:
            del m.load_weights  # back to the class method
    return rec


# -- running a stage ------------------------------------------------------------------------------
def forward_stage(model: Any, stage: Stage, inp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Run one stage on a chunk: ``inp`` is ``ids [B, S]`` for the embedding, else states ``[B, S, H]``."""
    B, S = ids.shape
    m = stage.module
    if stage.kind == "embed":
        y = m(ids.reshape(-1))
    elif stage.kind == "block":
        state = ForwardState(BatchMeta.full(ids), None, model.allowed_backends, model.plugins)
        y = m(inp.reshape(B * S, -1), state)
    else:
        y = m(inp.reshape(B * S, -1))
    return y.reshape(B, S, -1)


def advance_states(model: Any, stage: Stage, x: torch.Tensor, ids: torch.Tensor, chunks: Sequence[slice],
                   device: torch.device, home: Callable[[int], torch.device]) -> torch.Tensor:
    """``x`` through ``stage`` as it is installed now, chunk by chunk, as fp32 states. Float states stay
    on their device; from token ids (the embedding) the states go where ``home(nbytes)`` puts a set of
    their size, chunk by chunk, so a whole set never sits on the compute device twice."""
    outs: list[torch.Tensor] = []
    where: torch.device | None = x.device if x.is_floating_point() else None
    with torch.no_grad():
        for c in chunks:
            y = forward_stage(model, stage, x[c].to(device), ids[c].to(device)).float()
            if where is None:
                where = home(x.numel() * y.shape[-1] * y.element_size())
            outs.append(y.to(where))
    return torch.cat(outs)


def _refresh_moe(m: Any, dtype: torch.dtype, device: torch.device) -> None:
    restack = getattr(m, "_stack_dense_experts", None)
    if restack is not None:
        restack()  # drops stacked dense copies once experts are quantized


def _refresh_latent(m: Any, dtype: torch.dtype, device: torch.device) -> None:
    m.absorb(dtype, device)  # folded kv_b_proj weights must come from the quantized layer


#: building-block class -> how to rebuild state derived from its linears after they are replaced
DERIVED_REFRESH: dict[type, Any] = {MoE: _refresh_moe, LatentAttention: _refresh_latent}


def replace_linear(parent: torch.nn.Module, attr: str, new: torch.nn.Module) -> None:
    parent._modules[attr] = new


def refresh_derived(stage: Stage, dtype: torch.dtype, device: torch.device) -> None:
    for m in stage.module.modules():
        for cls, fn in DERIVED_REFRESH.items():
            if isinstance(m, cls):
                fn(m, dtype, device)


def source_fingerprint(directory: Path) -> dict[str, int]:
    """Sizes of the source's weight and config files: a resumed job must see the same model."""
    out: dict[str, int] = {}
    for p in sorted(directory.iterdir()):
        if p.is_file() and (p.suffix in (".safetensors", ".json")):
            out[p.name] = os.path.getsize(p)
    return out
