"""The protocol every attention backend implements."""
from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import torch

from exl3_core.attention.spec import AttnArgs, AttnSpec


@runtime_checkable
class AttentionBackend(Protocol):
    """An attention implementation, instantiated once per plugin set by the dispatcher.

    Optional class attribute ``graph_safe: ClassVar[bool]`` (default False when absent): True
    promises that :meth:`forward` never synchronises with the host (no ``.item()``, ``.tolist()``,
    ``.cpu()`` or data-dependent Python shapes), allocates only through torch's caching allocator
    and launches on the current stream, so a decode step through it can be captured in a CUDA
    graph and replayed (:mod:`exl3_core.generator.graphs`). It is not a protocol member, so
    backends written before it still satisfy ``isinstance(b, AttentionBackend)``.
    """

    name: ClassVar[str]

    def priority(self, spec: AttnSpec) -> int:
        """Rank for ``spec``; higher is tried first. The torch reference is 0, Triton 100.

        Called by the dispatcher once per distinct spec; may depend on ``spec.device_cc``.
        """
        ...

    def unsupported_reasons(self, spec: AttnSpec) -> list[str]:
        """``[]`` when every call matching ``spec`` will succeed; else human-readable reasons.

        Called once per distinct spec (the dispatcher caches the decision), so it may do
        moderately expensive checks, but must not touch the GPU.
        """
        ...

    def forward(self, args: AttnArgs) -> torch.Tensor:
        """Attention output ``[T, num_q_heads, v_dim]`` in ``args.q.dtype``. Never None.

        Must succeed for any args whose spec passed :meth:`unsupported_reasons`.
        """
        ...


@runtime_checkable
class RoutedBackend(Protocol):
    """A backend with several kernels that picks one per spec states which, for reports (optional)."""

    def route(self, spec: AttnSpec) -> str:
        """The kernel (route) calls matching ``spec`` take, in words; static per spec."""
        ...
