"""A stand-in for the compiled EXL3 linear kernels, computed with torch on any device.

:class:`EmulatedKernels` implements :class:`exl3_core.plan.kernels.LinearKernels` from the kernels'
documented contracts (fp32 math, fp16 in and out, norms in the prologue, RoPE and the cache write
in the epilogue), so an :class:`~exl3_core.plan.ExecutionPlan` built with it takes every fused form
on a CPU: its choices and the data it hands the kernels are then checked against the reference
forward without a GPU. The kernels' own arithmetic is checked against these contracts on the GPU
(tests/gpu).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F

from exl3_core.quant.exl3.linear import EXL3Linear, NormPrologue, RopeCacheEpilogue, exl3_matmul_reference


def _act(name: str, g: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(g)
    if name == "gelu_tanh":
        return F.gelu(g, approximate="tanh")
    raise ValueError(f"EmulatedKernels: unknown activation {name!r}")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Whole heads of ``x [m, H, D]`` rotated by fp32 tables ``[m, D/2]``, in fp32."""
    c, s = cos[:, None, :], sin[:, None, :]
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    a, b = xf[..., :half], xf[..., half:]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1)


class EmulatedKernels:
    """The :class:`~exl3_core.plan.kernels.LinearKernels` contract in torch (see the module docstring).

    ``calls`` counts each method's calls, so a test can tell which forms a step took."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def _count(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1

    def unavailable(self, device: torch.device, op: str) -> list[str]:
        return []

    @staticmethod
    def _mm(x: torch.Tensor, m: EXL3Linear) -> torch.Tensor:
        return exl3_matmul_reference(x.float(), m)

    def group(self, x2: torch.Tensor, lins: Sequence[EXL3Linear]) -> list[torch.Tensor]:
        self._count("group")
        x = x2.half()
        return [self._mm(x, m).half() for m in lins]

    def group_ex(self, h2: torch.Tensor, lins: Sequence[EXL3Linear], norm: NormPrologue | None,
                 epilogue: RopeCacheEpilogue | None) -> list[torch.Tensor]:
        self._count("group_ex" if epilogue is None else "group_ex_epilogue")
        x = h2
        if norm is not None:
            rows = h2.shape[0]
            scale = torch.rsqrt(norm.ss[:rows, None] / h2.shape[-1] + norm.eps)
            xf = h2.float() * scale
            if norm.weight is not None:
                xf = xf * (norm.weight.float() + norm.offset)
            x = xf.half()
        ys = [self._mm(x, m).half() for m in lins]
        if epilogue is not None:
            d = 2 * epilogue.cos.shape[-1]
            rows = h2.shape[0]
            for i in (0, 1):  # q and k rotate; v does not
                heads = ys[i].view(rows, -1, d)
                ys[i] = _rotate(heads, epilogue.cos, epilogue.sin, epilogue.interleaved).half().view(rows, -1)
            for y, cache in ((ys[1], epilogue.k_cache), (ys[2], epilogue.v_cache)):
                flat = cache.view(-1, *cache.shape[2:])  # slots of the linear's unpadded width: y's first columns
                width = cache.shape[2:].numel()
                flat.index_copy_(0, epilogue.slots, y[:, :width].reshape(rows, *cache.shape[2:]).to(cache.dtype))
        return ys

    def act(self, layer: EXL3Linear, gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
        self._count("act")
        return self._mm((_act(act, gate.float()) * up.float()).half(), layer).half()

    def residual(self, layer: EXL3Linear, x: torch.Tensor, residual: torch.Tensor, ss: torch.Tensor,
                 gate: torch.Tensor | None, act: str | None) -> torch.Tensor:
        self._count("residual" if gate is None else "residual_gated")
        rows = x.numel() // x.shape[-1]
        inp = x.reshape(rows, -1)
        if gate is not None:
            assert act is not None
            inp = (_act(act, gate.reshape(rows, -1).float()) * inp.float()).half()
        y = self._mm(inp, layer)[:, : residual.shape[-1]]
        out = (residual.reshape(rows, -1).float() + y).half()
        ss[:rows] += out.float().pow(2).sum(-1)
        return out.reshape(residual.shape)

    def rebuild_gemm(self, x2: torch.Tensor, lins: Sequence[EXL3Linear]) -> list[torch.Tensor]:
        self._count("rebuild_gemm")
        dtype = torch.bfloat16 if x2.dtype == torch.bfloat16 else torch.float16
        return [self._mm(x2.to(dtype), m).to(dtype) for m in lins]


def random_exl3_problem(k: int, n: int, K: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor,
                                                                                      torch.Tensor]:
    """Random packed trellis ``[k / 16, n / 16, 16 K]`` (int16) and sign-random fp16 input / output scales of
    magnitude 0.025-0.1 / 0.5-2, for kernel tests that need an EXL3 linear of any content."""
    def scales(size: int) -> torch.Tensor:
        sign = torch.randint(0, 2, (size,), device=device) * 2 - 1
        return (sign * (0.5 + 1.5 * torch.rand(size, device=device))).to(torch.float16)

    t = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=torch.int16, device=device)
    return t, scales(k) * 0.05, scales(n)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms, in fp64)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def assert_workspace_clean(ops: object) -> None:
    """The fused linears' shared workspace and arrival counters are back to zero (every launch cleans up after
    itself, which the next launch relies on); ``ops`` is ``torch.ops.exl3``."""
    z, counters = ops.exl3_linear_workspace(torch.empty(1, device="cuda"))  # type: ignore[attr-defined]
    assert z.count_nonzero().item() == 0 and counters.count_nonzero().item() == 0, "fused workspace left dirty"


T = TypeVar("T")


def captured(launch: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """``launch()`` run once on a side stream (compiles, workspaces and first-use attributes happen off the capture),
    then captured into a CUDA graph: ``(graph, what the captured call returned)``, its tensors the graph's static
    buffers, refreshed by each replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch()
    return graph, out
