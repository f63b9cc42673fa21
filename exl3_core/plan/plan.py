"""The execution plan: how the engine runs one loaded model on its device, and why.

Built from the model, its device and a :class:`~exl3_core.tuning.Tuning`, the plan matches the
module types it knows (the standard decoder's blocks, :class:`Attention`, :class:`GatedMLP`, EXL3
linears, RMSNorm) and decides once, per module, which fused forms apply: the reasons for every form
it does not take are kept and printed by ``exl3 inspect --plan``. Per step it then picks a form from
host-side values only (rows, phase, dtype), so the forward stays graph-capturable.

Models the plan does not know run their own ``forward_batch``; the plan says so.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from exl3_core import ops
from exl3_core.archkit.batch import BatchMeta, BatchModel
from exl3_core.archkit.decoder import StandardDecoder
from exl3_core.archkit.model import Model
from exl3_core.attention.backend import RoutedBackend
from exl3_core.attention.dispatch import NoAttentionBackend, get_dispatcher
from exl3_core.attention.spec import AttnSpec, CacheView, CallShape, pow2_bucket
from exl3_core.cache.layer import CacheLayers
from exl3_core.kernels.launch import LaunchConfig, launch_config
from exl3_core.nn.module import Communicator
from exl3_core.plan.decoder import Carry, DecoderExecutor
from exl3_core.plan.kernels import CompiledKernels, LinearKernels
from exl3_core.plan.linears import fused_ops
from exl3_core.plan.report import PartReport, decide
from exl3_core.tuning import Tuning


@runtime_checkable
class SpecSource(Protocol):
    """An attention module that states the static spec of its calls (Attention, LatentAttention)."""

    cache_index: int | None

    def attn_spec(self, dtype: torch.dtype, device: torch.device, cache_view: str | None,
                  shape: CallShape, layer: CacheView | None = None) -> AttnSpec: ...


@runtime_checkable
class GraphCheck(Protocol):
    """A module whose forward may not be capturable in a CUDA graph says why (None: it is)."""

    def graph_capturable(self) -> str | None: ...


class ExecutionPlan:
    """The forward of one loaded model as the engine runs it (see the module docstring).

    :param model: a loaded :class:`~exl3_core.archkit.model.Model`, or any
        :class:`~exl3_core.generator.types.BatchModel` (run through its own forward).
    :param tuning: what the plan may do; default :meth:`Tuning.for_device` of the model's device.
    :param kernels: the EXL3 linear kernels to launch (default: the compiled ones; tests pass a stand-in).
    """

    def __init__(self, model: Model | BatchModel, tuning: Tuning | None = None,
                 kernels: LinearKernels | None = None) -> None:
        self.model = model
        dev = torch.device(model.device)
        if dev.type == "cuda" and dev.index is None:  # tensors report an index: compare like with like
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.kernels: LinearKernels = kernels if kernels is not None else CompiledKernels()
        self.tuning = tuning if tuning is not None else Tuning.for_device(self.device)
        self.fused = fused_ops(self.device)
        k = self.tuning.kernels
        self.launch = LaunchConfig(pdl=k.pdl, predecode=k.predecode, predecode_max_kt=k.predecode_max_kt,
                                   xh_min_rows=k.xh_min_rows)
        self._built_for = self._model_key()
        self.executor: DecoderExecutor | None = None
        self.reference_why: list[str] = []
        if not isinstance(model, StandardDecoder):
            self.reference_why.append(f"{type(model).__name__} is not a StandardDecoder: its own forward_batch runs")
        elif not model.standard_forward:
            self.reference_why.append(f"{type(model).__name__} declares its own forward (standard_forward = False)")
        else:
            self.executor = DecoderExecutor(model, self.tuning, self.device, self.fused, self.kernels)

    def _model_key(self) -> tuple[int, int]:
        # the plan holds the loaded modules: a reload (new linears) needs a new plan
        return id(self.model), self.model.load_generation if isinstance(self.model, Model) else 0

    @property
    def current(self) -> bool:
        """False once the model was unloaded or reloaded since this plan was built."""
        loaded = self.model.loaded if isinstance(self.model, Model) else True
        return loaded and self._model_key() == self._built_for

    # -- forward --------------------------------------------------------------------------------------
    def forward(self, meta: BatchMeta, cache: CacheLayers | None = None, *, carry: Carry | None = None,
                fp32_logits: bool = True, comm: Communicator | None = None) -> torch.Tensor:
        """Logits ``[N, vocab]`` for ``meta.logits_indices`` (every row when None), fp32 or (``fp32_logits``
        False) in the head's dtype. ``carry``: the one-step-ahead loop's device-side input ids (the plan
        folds them into the step's first launch where it can)."""
        if not self.current:
            raise RuntimeError(f"this ExecutionPlan was built for an earlier load of {type(self.model).__name__}; "
                               f"build a new one after (re)loading the model")
        with launch_config(self.launch):
            runtime = self.model.parallel if isinstance(self.model, Model) else None
            if runtime is not None and self.executor is not None:
                # every rank runs this step; rank 0's share through this plan, the ids carried in first
                if carry is not None:
                    ops.carry_ids(meta.input_ids, *carry)
                executor = self.executor
                logits = runtime.run(meta, cache, lambda m, c, group: executor.forward(m, c, None, group), self.tuning)
            elif self.executor is not None:
                logits = self.executor.forward(meta, cache, carry, comm)
            else:
                if carry is not None:
                    ops.carry_ids(meta.input_ids, *carry)
                logits = self.model.forward_batch(meta, cache, fp32_logits=False)
        return logits.float() if fp32_logits else logits

    # -- what it decided -------------------------------------------------------------------------------
    def report(self) -> list[PartReport]:
        head = PartReport("plan", f"tuning {self.tuning.name}", [
            decide("fused kernels (Triton)", [] if self.fused else [f"{self.device.type}: none run here"])])
        changed = self.tuning.describe()
        if changed:
            head.kind += " (" + ", ".join(changed) + ")"
        runtime = self.model.parallel if isinstance(self.model, Model) else None
        if runtime is not None:
            head.decisions.append(decide(f"each step drives {runtime.world} tensor-parallel ranks (this plan runs "
                                         f"rank 0's share; the logits are gathered)", []))
        if self.executor is None:
            head.decisions.append(decide("the plan's forward", self.reference_why))
            return [head]
        return [head, *self.executor.report()]

    def cache_report(self, cache: CacheLayers) -> list[str]:
        """Per cache layer type: how a step stores into it (in-kernel target, its write_rotated, or its
        write) and the views attention may read."""
        out = []
        seen: set[tuple[str, tuple[str, ...], bool]] = set()
        for layer in cache.layers:
            target = layer.fused_write_target() is not None
            key = (type(layer).__name__, layer.views(), target)
            if key in seen:
                continue
            seen.add(key)
            how = ("the q/k/v launch stores keys and values in its epilogue (decode sizes)" if target else
                   "no in-kernel write target: RoPE and the store run through its write_rotated / write")
            out.append(f"{type(layer).__name__} ({layer.kind}/{layer.variant}), views {', '.join(layer.views())}: {how}")
        return out

    def attention_choices(self, cache: CacheLayers | None, shapes: list[CallShape]) -> list[str]:
        """One line per (attention layer, call shape): the backend and cache view the dispatcher picks,
        the route inside the backend where it declares one, or why none can run."""
        if not isinstance(self.model, Model):
            return [f"{type(self.model).__name__} is not an exl3 Model: its attention is its own"]
        dispatcher = get_dispatcher(self.model.plugins)
        allowed = self.model.allowed_backends
        out = []
        layers = cache.layers if cache is not None else []
        for attn in self.model.attention_layers():
            if not isinstance(attn, SpecSource):
                out.append(f"{type(attn).__name__}: states no attn_spec(); its backends are its own")
                continue
            layer = layers[attn.cache_index] if attn.cache_index is not None and layers else None
            for shape in shapes:
                label = f"layer {attn.cache_index} {shape.phase} keys<={shape.max_keys} seqs<={shape.num_seqs}" + (
                    f" q/seq={shape.q_per_seq}" if shape.q_per_seq else "")
                try:
                    if layer is None:
                        spec = attn.attn_spec(self.model.dtype, self.device, None, shape)
                        backend, view = dispatcher.select(spec, allowed), "no cache"
                    else:
                        backend, view = dispatcher.select_view(
                            lambda v, a=attn, sh=shape, lay=layer: a.attn_spec(self.model.dtype, self.device, v, sh,
                                                                                lay),
                            layer.views(), allowed)
                        spec = attn.attn_spec(self.model.dtype, self.device, view, shape, layer)
                except NoAttentionBackend as e:
                    out.append(f"{label}: no backend: " + "; ".join(f"{n}: {', '.join(r)}" for n, r in e.rejected.items()))
                    continue
                extra = f", route: {backend.route(spec)}" if isinstance(backend, RoutedBackend) else ""
                out.append(f"{label}: {backend.name} on {view}{extra}")
        return out

    def graph_decline(self, cache: CacheLayers | None, phase: str, shapes: list[CallShape]) -> str | None:
        """Why steps of ``phase`` with these static shapes cannot be captured in CUDA graphs, or None."""
        g = self.tuning.graphs
        if not g.enabled:
            return "CUDA graphs off (EXL3_CUDA_GRAPHS=0 or the tuning)"
        if phase == "prefill" and g.prefill_max_tokens <= 0:
            return "prefill graphs off (the tuning's prefill_max_tokens is 0)"
        if isinstance(self.model, Model) and self.model.parallel is not None:
            return "tensor parallel: the other ranks run each step eagerly, so rank 0 alone cannot capture it"
        if self.device.type != "cuda" or not torch.cuda.is_available():
            return f"model is on {self.device}, not CUDA"
        if not isinstance(self.model, Model):
            return f"{type(self.model).__name__} is not an exl3 Model: its attention's graph safety is unknown"
        if cache is None or not cache.layers:
            return "no allocated cache"
        attns = list(self.model.attention_layers())
        if not attns:
            return "model has no attention layers"
        dispatcher = get_dispatcher(self.model.plugins)
        for attn in attns:
            if not isinstance(attn, SpecSource) or attn.cache_index is None:
                return f"{type(attn).__name__} states no attn_spec(); its backend's graph safety is unknown"
            layer = cache.layers[attn.cache_index]
            for shape in shapes:
                backend, _ = dispatcher.select_view(
                    lambda v, a=attn, sh=shape, lay=layer: a.attn_spec(self.model.dtype, self.device, v, sh, lay),
                    layer.views(), self.model.allowed_backends)
                if not getattr(type(backend), "graph_safe", False):
                    return f"attention backend {backend.name!r} ({phase}) is not graph-safe"
        for m in self.model.modules():
            if isinstance(m, GraphCheck):
                why = m.graph_capturable()
                if why:
                    return why
        return None


def decode_shapes(max_keys: int, max_batch: int, q_per_seq: int = 1) -> list[CallShape]:
    """The static shapes of decode steps up to ``max_batch`` sequences over a ``max_keys`` key bound."""
    out, n = [], 1
    while n <= pow2_bucket(max(max_batch, 1)):
        out.append(CallShape("decode", pow2_bucket(max_keys), n, q_per_seq))
        n *= 2
    return out
