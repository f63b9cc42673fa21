"""Fused small ops with an implementation switch: Triton kernels on CUDA, pure torch elsewhere.

Public functions take ``impl``:

* ``"auto"`` (default): the Triton kernel when :func:`fused_enabled` says so for the tensor
  (a CUDA tensor, Triton importable, fused ops not switched off), else the torch reference;
* ``"triton"``: the kernel, also on CPU under Triton's interpreter (``TRITON_INTERPRET=1``; tests);
* ``"torch"``: the reference (:mod:`exl3_core.reference.fused`).

Model code calls these only where :func:`fused_enabled` holds and keeps its own torch expressions
otherwise, so CPU results stay what they were before these kernels existed.
"""
from __future__ import annotations

import os
from types import ModuleType
from typing import Literal

import torch

from exl3_core.kernels.codes import ACT_CODES as ACT_CODES
from exl3_core.reference import fused as _ref

Impl = Literal["auto", "triton", "torch"]

_enabled = True
_kernels: ModuleType | None = None
_import_error: str | None = None


def set_enabled(flag: bool) -> bool:
    """Switch the fused CUDA path on or off process-wide (benchmarks, A/B checks); returns the old value."""
    global _enabled
    old, _enabled = _enabled, bool(flag)
    return old


def kernels() -> ModuleType | None:
    """:mod:`exl3_core.kernels.fused`, imported on first use; None when Triton is unavailable."""
    global _kernels, _import_error
    if _kernels is None and _import_error is None:
        try:
            from exl3_core.kernels import fused
        except ImportError as e:  # Triton is optional for the core
            _import_error = f"{type(e).__name__}: {e}"
        else:
            _kernels = fused
    return _kernels


def _interpreting() -> bool:
    # Triton's own switch (not an exl3 setting): kernels run on CPU tensors in its interpreter
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fused_enabled(t: torch.Tensor) -> bool:
    """Whether model code should take the fused path for activations like ``t`` (CUDA + Triton)."""
    return _enabled and t.is_cuda and kernels() is not None


def _use_triton(impl: Impl, t: torch.Tensor, op: str) -> bool:
    if impl == "torch":
        return False
    if impl == "auto":
        return fused_enabled(t)
    if impl != "triton":
        raise ValueError(f"exl3_core.ops.{op}: impl={impl!r}; expected 'auto', 'triton' or 'torch'")
    if kernels() is None:
        raise RuntimeError(f"exl3_core.ops.{op}(impl='triton') needs Triton ({_import_error}); pip install triton "
                           f"or use impl='auto'")
    if not t.is_cuda and not _interpreting():
        raise RuntimeError(f"exl3_core.ops.{op}(impl='triton') got a {t.device.type} tensor: Triton runs on CUDA, "
                           f"or on CPU only with TRITON_INTERPRET=1 set before Triton is imported")
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float = 0.0, *,
             impl: Impl = "auto") -> torch.Tensor:
    """``x / rms(x) * (weight + offset)`` over the last dim (fp32 math, ``x.dtype`` out)."""
    if _use_triton(impl, x, "rms_norm"):
        return kernels().rms_norm_residual(x, None, weight, eps, offset)[0]  # type: ignore[union-attr]
    return _ref.rms_norm(x, weight, eps, offset)


def rms_norm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                      offset: float = 0.0, *, impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, new_residual)`` with ``new_residual = residual + x`` (in ``x.dtype``) and
    ``normed = rms_norm(new_residual)``: a block's residual add fused into the next norm."""
    if _use_triton(impl, x, "rms_norm_residual"):
        normed, new_res = kernels().rms_norm_residual(x, residual, weight, eps, offset)  # type: ignore[union-attr]
        assert new_res is not None
        return normed, new_res
    return _ref.rms_norm_residual(x, residual, weight, eps, offset)


def _gate_up(gate_up: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
             up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(gate_up, tuple):
        return gate_up
    if up is not None:
        return gate_up, up
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up has an odd last dim {gate_up.shape[-1]}; expected [..., 2 * intermediate]")
    half = gate_up.shape[-1] // 2
    return gate_up[..., :half], gate_up[..., half:]


def silu_mul(gate_up: torch.Tensor | tuple[torch.Tensor, torch.Tensor], up: torch.Tensor | None = None, *,
             impl: Impl = "auto") -> torch.Tensor:
    """``silu(gate) * up``; ``gate_up`` is ``[..., 2I]`` (gate first), or pass ``(gate, up)``."""
    g, u = _gate_up(gate_up, up)
    if _use_triton(impl, g, "silu_mul"):
        return kernels().act_mul("silu", g, u)  # type: ignore[union-attr]
    return _ref.silu_mul(g, u)


def gelu_tanh_mul(gate_up: torch.Tensor | tuple[torch.Tensor, torch.Tensor], up: torch.Tensor | None = None, *,
                  impl: Impl = "auto") -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (the tanh approximation), same layouts as :func:`silu_mul`."""
    g, u = _gate_up(gate_up, up)
    if _use_triton(impl, g, "gelu_tanh_mul"):
        return kernels().act_mul("gelu_tanh", g, u)  # type: ignore[union-attr]
    return _ref.gelu_tanh_mul(g, u)


def act_mul(act: str, gate: torch.Tensor, up: torch.Tensor, *, impl: Impl = "auto") -> torch.Tensor:
    """``act(gate) * up`` for ``act`` in :data:`ACT_CODES` ("silu", "gelu_tanh")."""
    if act == "silu":
        return silu_mul((gate, up), impl=impl)
    if act == "gelu_tanh":
        return gelu_tanh_mul((gate, up), impl=impl)
    raise ValueError(f"exl3_core.ops.act_mul: act={act!r}; expected one of {sorted(ACT_CODES)}")


def rope_apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
               interleaved: bool, *, impl: Impl = "auto") -> None:
    """Rotate the first ``rotary_dim`` channels of ``q [T, Hq, D]`` and ``k [T, Hk, D]`` in place by the
    fp32 tables ``cos``/``sin [T, rotary_dim/2]`` (adjacent pairs if ``interleaved``, else halves)."""
    if _use_triton(impl, q, "rope_apply") and q.stride(-1) == 1 and k.stride(-1) == 1:
        kernels().rope_apply(q, k, cos, sin, rotary_dim, interleaved)  # type: ignore[union-attr]
        return
    _ref.rope_apply(q, k, cos, sin, rotary_dim, interleaved)


def kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, *, impl: Impl = "auto") -> None:
    """Write ``k [T, Hk, D]`` and ``v [T, Hk, Dv]`` into the paged caches ``[pages, page_size, Hk, D(v)]``
    at the flat slots ``slot_mapping [T]`` (int64, on the cache's device), cast to the cache dtype.
    One launch for both tensors on CUDA (the decode step's cache write), no host sync either way."""
    if (_use_triton(impl, k, "kv_write") and k.stride(-1) == 1 and v.stride(-1) == 1
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        kernels().kv_write(k_cache, v_cache, k, v, slot_mapping)  # type: ignore[union-attr]
        return
    _ref.kv_write(k_cache, v_cache, k, v, slot_mapping)


def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                  interleaved: bool, *, impl: Impl = "auto") -> None:
    """:func:`rope_apply` (q and k rotated in place) then :func:`kv_write` of the rotated k and v, in one
    launch on CUDA (the decode step's RoPE and cache write: one dependent launch less per layer)."""
    if (_use_triton(impl, q, "rope_kv_write") and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        kernels().rope_kv_write(q, k, v, k_cache, v_cache, slot_mapping, cos, sin, rotary_dim, interleaved)  # type: ignore[union-attr]
        return
    _ref.rope_kv_write(q, k, v, k_cache, v_cache, slot_mapping, cos, sin, rotary_dim, interleaved)


def greedy_pack(logits: torch.Tensor, *, out: torch.Tensor | None = None, impl: Impl = "auto") -> torch.Tensor:
    """float64 ``[2, B]``: greedy ids (first maximum) and "row has a finite logit and no NaN or +inf" flags of
    ``logits [B, V]``, the decode graphs' greedy output. One launch on CUDA. ``out``: a contiguous float64
    ``[2, B]`` on the logits' device to write (and return) instead of a new tensor."""
    if out is not None and (out.dtype != torch.float64 or out.dim() != 2 or out.shape[0] != 2
                            or logits.dim() != 2 or out.shape[1] != logits.shape[0] or not out.is_contiguous()
                            or out.device != logits.device):
        raise ValueError(f"greedy_pack: out must be a contiguous float64 [2, {logits.shape[0] if logits.dim() else '?'}] "
                         f"on {logits.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    if _use_triton(impl, logits, "greedy_pack"):
        return kernels().greedy_pack(logits, out)  # type: ignore[union-attr]
    res = _ref.greedy_pack(logits)
    if out is None:
        return res
    out.copy_(res)
    return out


def _check_carry(what: str, ids: torch.Tensor, carry: torch.Tensor, src: torch.Tensor) -> None:
    if (ids.dtype != torch.int64 or carry.dtype != torch.int32 or src.dtype != torch.float64 or ids.dim() != 1
            or carry.shape != ids.shape or src.dim() != 1 or not (ids.device == carry.device == src.device)
            or not ids.is_contiguous() or not carry.is_contiguous() or not src.is_contiguous()):
        raise ValueError(
            f"{what}: want contiguous int64 ids [B], int32 carry [B] and float64 src [S] on one device, got "
            f"{ids.dtype} {tuple(ids.shape)} on {ids.device}, {carry.dtype} {tuple(carry.shape)} on {carry.device}, "
            f"{src.dtype} {tuple(src.shape)} on {src.device}")


def carry_ids(ids: torch.Tensor, carry: torch.Tensor, src: torch.Tensor, *, impl: Impl = "auto") -> None:
    """In place, for the decode graphs' step start: ``ids[i] = int64(src[carry[i]])`` for every row whose
    ``carry[i]`` indexes ``src`` (the previous step's greedy ids, float64), the other rows unchanged.
    ``ids`` int64 ``[B]``, ``carry`` int32 ``[B]`` (-1: keep), ``src`` float64 ``[S]``, one device. One
    launch on CUDA, so a replayed step takes its ids from the step before without a host round trip."""
    _check_carry("carry_ids", ids, carry, src)
    if _use_triton(impl, ids, "carry_ids"):
        kernels().carry_ids(ids, carry, src)  # type: ignore[union-attr]
        return
    _ref.carry_ids(ids, carry, src)


def embed_ss(ids: torch.Tensor, weight: torch.Tensor, scale: float | None, ss_slots: int, *,
             carry: tuple[torch.Tensor, torch.Tensor] | None = None,
             impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, ss)``: the embedding rows ``weight[ids]`` (times ``scale``, rounded once to the table's
    dtype) and fp32 ``ss [ss_slots, T]``, row 0 their sums of squares and the rest zeros: the decode
    step's lookup, its first norm's input sums and the zeroed sums of the linears after, in one launch.
    ``carry = (carry, src)`` first applies :func:`carry_ids` to ``ids`` (in place) in the same launch."""
    if carry is not None:
        _check_carry("embed_ss", ids, *carry)
    if _use_triton(impl, weight, "embed_ss"):
        return kernels().embed_ss(ids, weight, scale, ss_slots, carry)[:2]  # type: ignore[union-attr]
    if carry is not None:
        _ref.carry_ids(ids, *carry)
    return _ref.embed_ss(ids, weight, scale, ss_slots)


def step_start(ids: torch.Tensor, weight: torch.Tensor, scale: float | None, ss_slots: int, positions: torch.Tensor,
               inv_freq: torch.Tensor, factor: float = 1.0, *, carry: tuple[torch.Tensor, torch.Tensor] | None = None,
               impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(h, ss, cos, sin)``: :func:`embed_ss` (with its ``carry``) and :func:`rope_tables` of ``positions``
    in one launch on CUDA: a decode step's first kernel."""
    if carry is not None:
        _check_carry("step_start", ids, *carry)
    if (positions.dim() != 1 or positions.shape[0] != ids.shape[0] or inv_freq.dim() != 1
            or inv_freq.dtype != torch.float32):
        raise ValueError(f"step_start: want positions [T] for ids [T] and fp32 inv_freq [half]; got "
                         f"{tuple(positions.shape)}, {tuple(ids.shape)}, {tuple(inv_freq.shape)} {inv_freq.dtype}")
    if _use_triton(impl, weight, "step_start"):
        return kernels().embed_ss(ids, weight, scale, ss_slots, carry,  # type: ignore[union-attr, return-value]
                                  (positions, inv_freq, factor))
    # without Triton: exactly the two ops this launch stands for
    return (*embed_ss(ids, weight, scale, ss_slots, carry=carry, impl="torch"),
            *rope_tables(positions, inv_freq, factor, impl="torch"))


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, factor: float = 1.0, *,
                impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` ``[T, half]`` of int ``positions [T]`` times fp32 ``inv_freq [half]``, scaled by
    ``factor`` (the attention factor of YaRN-style RoPE): one launch on CUDA instead of 4-6."""
    if _use_triton(impl, inv_freq, "rope_tables"):
        return kernels().rope_tables(positions, inv_freq, factor)  # type: ignore[union-attr]
    return _ref.rope_tables(positions, inv_freq, factor)
