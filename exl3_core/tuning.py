"""The engine's tuning, in one typed home: what each component may do and with which sizes.

A :class:`Tuning` is passed to the execution plan (:mod:`exl3_core.plan`), the generator and its
CUDA-graph runners; nothing reads a module global or a process-wide setter for these. The
defaults are the measured best on an H200 (:meth:`Tuning.h200`); :meth:`Tuning.generic` is the
fallback for other devices and the CPU. :meth:`Tuning.for_device` picks between them and applies
the user's knobs from :mod:`exl3_core.settings` (e.g. ``EXL3_CUDA_GRAPHS=0``). Benchmarks and tests
build variants with :func:`dataclasses.replace`.

Everything here is a *permission or a size*: switching a fusion off never changes results beyond
rounding, it only moves work between kernels.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class FusionTuning:
    """Cross-module fusions the execution plan may choose (each still subject to its rules)."""

    #: residual adds run inside the RMSNorm after them (one kernel for add + norm)
    residual_norm: bool = True
    #: q/k/v, gate/up share one launch (decode sizes) or one rebuilt-W GEMM (prefill sizes)
    grouped_projections: bool = True
    #: at decode sizes the RMSNorms run inside the EXL3 linears around them
    deferred_norm: bool = True
    #: at decode sizes RoPE and the KV-cache write run in the q/k/v linear's epilogue
    qkv_epilogue: bool = True
    #: RoPE and the KV-cache write in one kernel where the epilogue does not take them
    rope_cache_write: bool = True
    #: the decode step's embedding lookup, first norm sums and RoPE tables in one launch
    step_start: bool = True
    #: the gated activation's product formed in the down projection's prologue
    act_in_down: bool = True
    #: the last block runs past its attention only on the rows whose logits are wanted
    last_rows: bool = True
    #: a fresh prompt's prefill with bf16 activations and GEMM operands (fp16 models on CUDA)
    prefill_bf16: bool = True


@dataclass(frozen=True, kw_only=True)
class KernelTuning:
    """Launch choices of the compiled EXL3 linear kernels."""

    #: rows up to which the one-launch linear (grouped, residual, deferred-norm forms) runs; its
    #: kernel takes at most 16 (from 9 rows its m16 loop)
    fused_linear_max_rows: int = 16
    #: models whose residual stream is wider than this take the one-launch forms up to
    #: ``fused_linear_wide_max_rows`` rows: past 8 rows their split-k GEMM does as well, while on
    #: narrower models the launches it saves are most of a step
    fused_linear_wide_width: int = 2048
    fused_linear_wide_max_rows: int = 8
    #: programmatic dependent launch between the decode step's kernels (Hopper and newer)
    pdl: bool = True
    #: the decode-size linear decodes its weights before waiting for its input: 0 off, 1 on,
    #: 2 on and the next kernel may start at once
    predecode: int = 2
    #: the longest k chunk (16-row tiles) a pre-decoding launch takes; 0: its ring's length
    predecode_max_kt: int = 0
    #: rows from which a decode-size launch transforms its input once for all its blocks (0: never)
    xh_min_rows: int = 8

    def __post_init__(self) -> None:
        for name in ("fused_linear_max_rows", "fused_linear_wide_max_rows"):
            if not 1 <= getattr(self, name) <= 16:
                raise ValueError(f"KernelTuning.{name}={getattr(self, name)}: the one-launch linear takes 1..16 rows")
        if self.fused_linear_wide_width < 0:
            raise ValueError(f"KernelTuning.fused_linear_wide_width={self.fused_linear_wide_width}: want a width >= 0")
        if self.predecode not in (0, 1, 2):
            raise ValueError(f"KernelTuning.predecode={self.predecode}: want 0 (off), 1 (on) or 2 (on, early signal)")
        if not 0 <= self.predecode_max_kt <= 32:
            raise ValueError(f"KernelTuning.predecode_max_kt={self.predecode_max_kt}: want 0 (the ring's length) "
                             f"to 32 k tiles")
        if not 0 <= self.xh_min_rows <= 16:
            raise ValueError(f"KernelTuning.xh_min_rows={self.xh_min_rows}: want 0 (never) to 16 rows")

    def one_launch_rows(self, width: int) -> int:
        """The most rows the one-launch forms take in a model whose residual stream is ``width`` wide."""
        if width <= self.fused_linear_wide_width:
            return self.fused_linear_max_rows
        return min(self.fused_linear_max_rows, self.fused_linear_wide_max_rows)


#: token buckets of graphed prefill chunks (a chunk runs padded to the smallest that holds it)
PREFILL_BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


@dataclass(frozen=True, kw_only=True)
class GraphTuning:
    """CUDA graphs and the generator's step loop."""

    #: replay decode steps and single-sequence prefill chunks as CUDA graphs
    enabled: bool = True
    #: largest decode batch bucket captured (larger batches are kernel-bound, not launch-bound)
    max_decode_bucket: int = 32
    #: pinned staging buffers per decode bucket, reused round robin
    staging_slots: int = 4
    #: largest prefill chunk (tokens) replayed as a graph; 0: prefill always eager
    prefill_max_tokens: int = 2048
    #: token buckets prefill chunks are padded to
    prefill_buckets: tuple[int, ...] = PREFILL_BUCKETS
    #: above this many tokens a chunk is graphed only when it fills its bucket to ``prefill_min_fill``
    #: (a long forward is no longer host-bound, so padding would cost device time the graph does not win back)
    prefill_loose_max: int = 512
    prefill_min_fill: float = 0.9
    #: run plain greedy decode one step ahead of the host's token handling
    overlap_decode: bool = True
    #: longest run of a draft model's one-token steps replayed as one graph (longer runs, and 0: step by step)
    draft_chain_steps: int = 15
    #: launch a draft model's next proposal before a greedy verification is read, its positions moved on the
    #: device, so that the device drafts while the host reads and commits
    draft_ahead: bool = True

    def __post_init__(self) -> None:
        if self.prefill_max_tokens < 0:
            raise ValueError(f"GraphTuning.prefill_max_tokens={self.prefill_max_tokens} must be >= 0")
        if self.draft_chain_steps < 0:
            raise ValueError(f"GraphTuning.draft_chain_steps={self.draft_chain_steps} must be >= 0")
        if list(self.prefill_buckets) != sorted(set(self.prefill_buckets)) or not self.prefill_buckets:
            raise ValueError(f"GraphTuning.prefill_buckets={self.prefill_buckets} must be increasing")

    def prefill_bucket(self, n: int, max_tokens: int | None = None) -> int | None:
        """The token bucket a prefill chunk of ``n`` tokens is padded to, or None to run it eagerly."""
        top = self.prefill_max_tokens if max_tokens is None else min(max_tokens, self.prefill_max_tokens)
        for b in self.prefill_buckets:
            if b > top:
                return None
            if n <= b:
                return b if b <= self.prefill_loose_max or n >= self.prefill_min_fill * b else None
        return None


@dataclass(frozen=True, kw_only=True)
class Tuning:
    """Everything the engine may be tuned by; see the module docstring."""

    name: str = "generic"
    fusion: FusionTuning = dataclasses.field(default_factory=FusionTuning)
    kernels: KernelTuning = dataclasses.field(default_factory=KernelTuning)
    graphs: GraphTuning = dataclasses.field(default_factory=GraphTuning)

    @classmethod
    def h200(cls) -> Tuning:
        """The measured defaults on an H200 (sm_90, 132 SMs)."""
        return cls(name="h200")

    @classmethod
    def generic(cls) -> Tuning:
        """Other devices: the same fusions (each checks its own kernel's availability), no
        programmatic dependent launch below sm_90 (the instruction does not exist there)."""
        return cls(name="generic", kernels=KernelTuning(pdl=False, predecode=1))

    @classmethod
    def for_device(cls, device: torch.device | str) -> Tuning:
        """The defaults for ``device`` with the user's knobs (:mod:`exl3_core.settings`) applied."""
        from exl3_core import settings

        dev = torch.device(device)
        base = cls.generic()
        if dev.type == "cuda" and torch.cuda.is_available():
            idx = dev.index if dev.index is not None else torch.cuda.current_device()
            if torch.version.hip is None and torch.cuda.get_device_capability(idx) >= (9, 0):
                base = cls.h200()
        s = settings.get()
        graphs = dataclasses.replace(base.graphs, enabled=s.cuda_graphs)
        return dataclasses.replace(base, graphs=graphs)

    def describe(self) -> list[str]:
        """One line per setting that differs from the H200 defaults (for reports)."""
        ref = Tuning.h200()
        out = []
        for part in ("fusion", "kernels", "graphs"):
            mine, theirs = getattr(self, part), getattr(ref, part)
            for f in dataclasses.fields(mine):
                a, b = getattr(mine, f.name), getattr(theirs, f.name)
                if a != b:
                    out.append(f"{part}.{f.name} = {a!r} (h200: {b!r})")
        return out
