"""Typed wrappers over the EXL3 CUDA ops (csrc/exl3), each with a pure-torch fallback.

The compiled ops live under ``torch.ops.exl3`` when ``exl3_core._C`` was built with nvcc:

* ``reconstruct(trellis, K, codebook) -> fp16 Ŵ [k, n]`` (bit-exact, spec 3)
* ``reconstruct_full(trellis, suh, svh, K, codebook) -> fp16 W [k, n]``: the weight in the original
  basis, ``diag(suh)·BD_k·Ŵ·BD_n·diag(svh)`` (spec 4.2), fp32 inside, rounded once; ``exl3_gemm``
  multiplies by it with one cuBLAS GEMM for m > 64
* ``reconstruct_full_into(trellis, suh, svh, K, codebook, out)``: the same into a strided fp16 or bf16
  view (bf16: the bf16 prefill's W)
* ``exl3_gemm(x fp16 [m, k], trellis, suh, svh, codebook, launch=[]) -> fp16 [m, n]`` (spec 4.3, the
  ``linear.exl3_matmul`` seam): Hadamard-in, on-the-fly-decode GEMM, Hadamard-out; from 65 rows x may
  be bf16 (W rebuilt in bf16, a bf16 result); up to 4 rows go to the one-launch kernel, with ``launch``
* ``exl3_gemm_xh(xh fp16 [m, k], trellis, K, codebook, kt_per_warp=0) -> fp32 [m, n]`` (z = xh @ Ŵ)
* ``had128(x, pre_scale=None, post_scale=None, out_fp16=True)`` (blockwise H128/sqrt(128))
* ``exl3_linear(x fp16 [m <= 16, k], trellis, suh, svh, codebook, kt_per_chunk=0, launch=[]) -> fp16 [m, n]``:
  ``exl3_gemm``'s decode path in one launch (csrc/exl3/exl3_fused.cuh); ``exl3_gemm`` itself
  routes m <= 4 here
* ``exl3_linear_group(x, trellis[], suh[], svh[], codebook, kt_per_chunk=0, launch=[]) -> fp16 [m, n_i][]``:
  up to 3 problems sharing x, K and codebook (q/k/v, gate/up) in one launch
* ``exl3_linear_act(gate, up, trellis, suh, svh, codebook, act, launch=[]) -> fp16 [m, n]``: the linear of
  ``act(gate) * up``, the product formed in the prologue (a gated MLP's down projection)
* ``exl3_linear_group_ex(x, trellis[], suh[], svh[], codebook, norm_ss?, norm_w?, eps, offset, rope_cos?,
  rope_sin?, rope_interleaved, rope_on[], slots?, caches[], launch=[]) -> fp16 [m, n_i][]``: the group with
  a deferred RMSNorm in the prologue and q/k/v's RoPE + paged KV write in the epilogue (the plan's
  ``Projection``, through ``linear.launch_group_ex``)
* ``exl3_linear_residual(x, gate?, act, trellis, suh, svh, codebook, res, ss, launch=[]) -> fp16 [m, n]``:
  ``res + linear(x)`` (or of ``act(gate) * x``), each row's sum of squares added into ``ss`` (the plan's
  ``ResidualOut``, through ``linear.launch_residual``)
* ``exl3_linear_workspace(like) -> (z, counters)``: copies of the fused op's per-device workspace,
  all zeros between calls (tests)

The fallbacks run anywhere (CPU included) and compute the same functions in fp32.

``launch`` (the one-launch ops and ``exl3_gemm``) is ``[]`` for the defaults or
:meth:`LaunchConfig.ints() <exl3_core.kernels.launch.LaunchConfig.ints>`, ``[pdl, predecode,
predecode_max_kt, xh_min_rows]``: per call, so two plans with different tunings launch with their own.
The wrappers below pass the running forward's (:func:`exl3_core.kernels.launch.current`) unless given one.

The one-launch ops share a per-device workspace that grows, eagerly, to the widest call so far. A call
wider than that while a CUDA graph is being captured cannot grow it and silently takes the unfused
ATen/4-kernel path (same results, slower replays); run the captured shapes once eagerly first, as the
generator's graph code does. There is no warning, because a c10 warning raised inside an extension crashes
the process when a broken compiler wrapper built it (bench/device_env.sh avoids one);
tests/gpu/test_deferred_norm_gpu.py covers this path.
"""
from __future__ import annotations

import torch

from exl3_core import ext
from exl3_core.kernels.launch import LaunchConfig, current
from exl3_core.quant.exl3.hadamard import had_blockwise
from exl3_core.quant.exl3.trellis import decode_inner, k_from_trellis


def _compiled(name: str, *tensors: torch.Tensor) -> bool:
    return all(t.is_cuda for t in tensors) and ext.has_op(name)


def _check(trellis: torch.Tensor, K: int | None, codebook: int, what: str) -> int:
    """Validate in Python before calling the op, so that bad input raises even where an exception thrown
    from inside the extension would crash the process (an extension built by a broken compiler wrapper)."""
    found = k_from_trellis(trellis, what)
    if trellis.dtype != torch.int16 or trellis.dim() != 3:
        raise ValueError(f"{what}: trellis must be int16 [k/16, n/16, 16K], got {trellis.dtype} {tuple(trellis.shape)}")
    if K is not None and K != found:
        raise ValueError(f"{what}: K={K} but the trellis last dim {trellis.shape[-1]} means K={found}")
    if codebook not in (0, 1, 2):
        raise ValueError(f"{what}: codebook {codebook!r} unknown; expected 0 (3inst), 1 (mcg) or 2 (mul1)")
    if trellis.is_cuda and trellis.data_ptr() % 16:
        # the kernels stream tiles with 16-byte cp.async; fresh allocations are always aligned
        raise ValueError(f"{what}: trellis data is not 16-byte aligned (a view at an odd offset); pass "
                         f"trellis.clone()")
    return found


#: the ``launch`` ranges the compiled ops accept (csrc/exl3/exl3_ops.cu, launch_opts): the longest chunk is
#: at most the kernels' 32 k tiles, the x-once threshold at most the 16 rows of one launch
PREDECODE_MAX_KT_MAX = 32
XH_MIN_ROWS_MAX = 16


def launch_ints(launch: LaunchConfig | None, what: str) -> list[int]:
    """The ops' ``launch`` argument for ``launch`` (None: the running forward's), checked here so that a bad
    value raises a ValueError even where an exception from inside the extension would crash the process."""
    cfg = current() if launch is None else launch
    pdl, predecode, max_kt, xh_rows = cfg.ints()
    if pdl not in (0, 1):
        raise ValueError(f"{what}: LaunchConfig.pdl={cfg.pdl!r}; expected a bool")
    if predecode not in (0, 1, 2):
        raise ValueError(f"{what}: LaunchConfig.predecode={predecode}; expected 0 (off), 1 (on) or 2 (on, early signal)")
    if not 0 <= max_kt <= PREDECODE_MAX_KT_MAX:
        raise ValueError(f"{what}: LaunchConfig.predecode_max_kt={max_kt}; expected 0 (the ring's length) to "
                         f"{PREDECODE_MAX_KT_MAX} k tiles")
    if not 0 <= xh_rows <= XH_MIN_ROWS_MAX:
        raise ValueError(f"{what}: LaunchConfig.xh_min_rows={xh_rows}; expected 0 (never) to {XH_MIN_ROWS_MAX} rows")
    return [pdl, predecode, max_kt, xh_rows]


def reconstruct_cuda(trellis: torch.Tensor, K: int | None, codebook: int) -> torch.Tensor:
    """fp16 Ŵ ``[k, n]`` from a trellis ``[k/16, n/16, 16K]``; bit-exact on either path."""
    K = _check(trellis, K, codebook, "reconstruct_cuda")
    if _compiled("reconstruct", trellis):
        return ext.op("reconstruct")(trellis.contiguous(), K, codebook)
    return decode_inner(trellis, K, codebook)


def _check_full(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, K: int | None, codebook: int,
                what: str) -> int:
    """:func:`_check` plus the full reconstruction's own rules: k, n multiples of 128, scale vectors."""
    K = _check(trellis, K, codebook, what)
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    if k % 128 or n % 128:
        raise ValueError(f"{what}: trellis {tuple(trellis.shape)} gives k={k}, n={n}; both must be multiples of 128")
    for name, s, size in (("suh", suh, k), ("svh", svh, n)):
        if not isinstance(s, torch.Tensor) or s.dim() != 1 or s.numel() != size or not s.dtype.is_floating_point:
            got = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"{what}: {name} must be a floating-point vector of {size} elements, got {got}")
        if s.device != trellis.device:
            raise ValueError(f"{what}: {name} is on {s.device}, the trellis on {trellis.device}; move them together")
    return K


def reconstruct_full_cuda(
    trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, K: int | None, codebook: int
) -> torch.Tensor:
    """fp16 ``W = diag(suh)·BD_k·Ŵ·BD_n·diag(svh)`` ``[k, n]`` (spec 4.2, padded ``(in, out)``).

    ``k`` and ``n`` (16 x the trellis' first two dims) must be multiples of 128. The CUDA op reads
    ``suh``/``svh`` as fp16 (their storage type) and computes in fp32 with one final rounding; the
    fallback rounds the fp32 oracle ``dequantize_padded`` once, so both paths return fp16.
    """
    K = _check_full(trellis, suh, svh, K, codebook, "reconstruct_full_cuda")
    if _compiled("reconstruct_full", trellis, suh, svh):
        return ext.op("reconstruct_full")(trellis.contiguous(), suh, svh, K, codebook)
    from exl3_core.quant.exl3.quantize import dequantize_padded  # heavy module, needed only here

    return dequantize_padded(trellis, suh, svh, K, codebook).to(torch.float16)


def reconstruct_full_into_cuda(
    trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, K: int | None, codebook: int, out: torch.Tensor
) -> None:
    """:func:`reconstruct_full_cuda` written into ``out``: an fp16 or bf16 ``[k, n]`` view with unit
    column stride, e.g. a column block of a wider matrix (linears that share an input, side by side,
    for one GEMM). On CUDA the row stride must be a multiple of 8 and the view 16-byte aligned. A bf16
    ``out`` gets the fp16 result converted (K <= 6; for K = 7, 8 the CUDA op rounds its fp32 result
    once, to bf16)."""
    what = "reconstruct_full_into_cuda"
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    if (not isinstance(out, torch.Tensor) or out.dtype not in (torch.float16, torch.bfloat16)
            or tuple(out.shape) != (k, n)):
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{what}: out must be an fp16 or bf16 [{k}, {n}] tensor for this trellis, got {got}")
    if out.device != trellis.device:
        raise ValueError(f"{what}: out is on {out.device}, the trellis on {trellis.device}; move them together")
    if _compiled("reconstruct_full_into", trellis, suh, svh):
        if out.stride(1) != 1 or out.stride(0) % 8 or out.data_ptr() % 16 or out.stride(0) >= 2**31:
            raise ValueError(f"{what}: out needs a unit column stride, a row stride that is a multiple of 8 "
                             f"(got strides {out.stride()}) and a 16-byte aligned start")
        K = _check_full(trellis, suh, svh, K, codebook, what)
        ext.op("reconstruct_full_into")(trellis.contiguous(), suh, svh, K, codebook, out)
        return
    out.copy_(reconstruct_full_cuda(trellis, suh, svh, K, codebook))


def had128_cuda(
    x: torch.Tensor,
    pre_scale: torch.Tensor | None = None,
    post_scale: torch.Tensor | None = None,
    out_fp16: bool = True,
) -> torch.Tensor:
    """Blockwise H128/sqrt(128) over the last dim, with optional fp16 scale vectors before/after.

    Rounding follows spec 4.3: fp16 input times ``pre_scale`` is rounded to fp16 before the fp32
    butterfly; with fp16 output the result is rounded, then multiplied by ``post_scale`` in fp16.
    """
    if x.shape[-1] % 128:
        raise ValueError(f"had128_cuda: last dim {x.shape[-1]} is not a multiple of 128; zero-pad it first")
    if _compiled("had128", x):
        pre = pre_scale.to(torch.float16).contiguous() if pre_scale is not None else None
        post = post_scale.to(torch.float16).contiguous() if post_scale is not None else None
        return ext.op("had128")(x, pre, post, out_fp16)
    v = x.to(torch.float32)
    if pre_scale is not None:
        v = (x * pre_scale.to(x.dtype)).to(torch.float32)
    y = had_blockwise(v, dim=-1)
    if out_fp16:
        y = y.to(torch.float16)
        return y * post_scale.to(torch.float16) if post_scale is not None else y
    return y * post_scale.to(torch.float32) if post_scale is not None else y


def exl3_gemm_xh_cuda(xh: torch.Tensor, trellis: torch.Tensor, codebook: int, kt_per_warp: int = 0) -> torch.Tensor:
    """fp32 ``z = xh @ Ŵ`` for fp16 ``xh [m, k]`` (already rotated), decoding Ŵ on the fly."""
    K = _check(trellis, None, codebook, "exl3_gemm_xh_cuda")
    if xh.shape[-1] != trellis.shape[0] * 16 or trellis.shape[1] % 8:
        raise ValueError(
            f"exl3_gemm_xh_cuda: xh [.., {xh.shape[-1]}] and trellis {tuple(trellis.shape)} disagree (need k = 16*"
            f"trellis.shape[0] and n a multiple of 128)"
        )
    if _compiled("exl3_gemm_xh", xh, trellis):
        return ext.op("exl3_gemm_xh")(xh.to(torch.float16).contiguous(), trellis.contiguous(), K, codebook, kt_per_warp)
    return xh.to(torch.float32) @ decode_inner(trellis, K, codebook).to(torch.float32)


def exl3_gemm_cuda(
    x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: int,
    launch: LaunchConfig | None = None,
) -> torch.Tensor:
    """``x[..., k] @ W -> [..., n]`` (padded widths, no bias), fp16 out on CUDA, fp32 on the fallback.
    ``launch``: the one-launch kernel's options for the few rows the op sends to it (None: the running
    forward's)."""
    _check(trellis, None, codebook, "exl3_gemm_cuda")
    ints = launch_ints(launch, "exl3_gemm_cuda")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[-1] != trellis.shape[0] * 16:
        raise ValueError(f"exl3_gemm_cuda: x has {x2.shape[-1]} features, the trellis {trellis.shape[0] * 16}")
    if _compiled("exl3_gemm", x2, trellis):
        y = ext.op("exl3_gemm")(x2.to(torch.float16).contiguous(), trellis.contiguous(), suh, svh, codebook, ints)
    else:
        xh = had_blockwise(x2.to(torch.float32) * suh.to(torch.float32), dim=-1)
        z = xh @ decode_inner(trellis, k_from_trellis(trellis), codebook).to(torch.float32)
        y = had_blockwise(z, dim=-1) * svh.to(torch.float32)
    return y.reshape(*x.shape[:-1], y.shape[-1])


FUSED_MAX_M = 16  # rows the one-launch op takes (one m16 block)
FUSED_MAX_PROBLEMS = 3


def _fallback_linear(x2: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: int) -> torch.Tensor:
    xh = had_blockwise(x2.to(torch.float32) * suh.to(torch.float32), dim=-1)
    z = xh @ decode_inner(trellis, k_from_trellis(trellis), codebook).to(torch.float32)
    return had_blockwise(z, dim=-1) * svh.to(torch.float32)


def _check_problem(x2: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, what: str) -> None:
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    if x2.shape[-1] != k:
        raise ValueError(f"{what}: x has {x2.shape[-1]} features, the trellis {tuple(trellis.shape)} needs k = {k}")
    if k % 128 or n % 128:
        raise ValueError(f"{what}: trellis {tuple(trellis.shape)} gives k={k}, n={n}; both must be multiples of 128")
    if suh.numel() != k or svh.numel() != n:
        raise ValueError(f"{what}: suh/svh have {suh.numel()}/{svh.numel()} elements, the trellis needs {k}/{n}")


def exl3_linear_cuda(
    x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: int, kt_per_chunk: int = 0,
    launch: LaunchConfig | None = None,
) -> torch.Tensor:
    """``x[..., k] @ W -> [..., n]`` (spec 4.3, padded widths, no bias) in one kernel launch.

    On CUDA with the op built and at most 16 rows: ``exl3::exl3_linear`` (fp16 out). More rows go
    through :func:`exl3_gemm_cuda`; without the op, the fp32 torch reference. ``kt_per_chunk``
    (k tiles per block; 0 = one wave) is for tests and benchmarks; ``launch``: PDL, pre-decoding and the
    x-once threshold (None: the running forward's, :func:`exl3_core.kernels.launch.current`).
    """
    _check(trellis, None, codebook, "exl3_linear_cuda")
    ints = launch_ints(launch, "exl3_linear_cuda")
    x2 = x.reshape(-1, x.shape[-1])
    _check_problem(x2, trellis, suh, svh, "exl3_linear_cuda")
    if x2.shape[0] <= FUSED_MAX_M and _compiled("exl3_linear", x2, trellis, suh, svh):
        y = ext.op("exl3_linear")(x2.to(torch.float16).contiguous(), trellis.contiguous(), suh, svh, codebook,
                                  kt_per_chunk, ints)
    elif _compiled("exl3_gemm", x2, trellis):
        y = ext.op("exl3_gemm")(x2.to(torch.float16).contiguous(), trellis.contiguous(), suh, svh, codebook, ints)
    else:
        y = _fallback_linear(x2, trellis, suh, svh, codebook)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def exl3_linear_group_cuda(
    x: torch.Tensor,
    trellis: list[torch.Tensor],
    suh: list[torch.Tensor],
    svh: list[torch.Tensor],
    codebook: int,
    kt_per_chunk: int = 0,
    launch: LaunchConfig | None = None,
) -> list[torch.Tensor]:
    """Up to 3 linears sharing the input ``x[..., k]`` (same K and codebook; n may differ) in one launch.

    Same contract per problem (and ``launch``) as :func:`exl3_linear_cuda`; returns ``[..., n_i]`` per problem.
    """
    what = "exl3_linear_group_cuda"
    ints = launch_ints(launch, what)
    if not 1 <= len(trellis) <= FUSED_MAX_PROBLEMS or len(suh) != len(trellis) or len(svh) != len(trellis):
        raise ValueError(
            f"{what}: takes 1..{FUSED_MAX_PROBLEMS} problems with one suh and one svh each, got "
            f"{len(trellis)} trellis, {len(suh)} suh, {len(svh)} svh"
        )
    x2 = x.reshape(-1, x.shape[-1])
    K = _check(trellis[0], None, codebook, what)
    for i, (t, su, sv) in enumerate(zip(trellis, suh, svh)):
        _check(t, K, codebook, f"{what} (problem {i}: all problems share K={K})")
        _check_problem(x2, t, su, sv, f"{what} (problem {i})")
    if x2.shape[0] <= FUSED_MAX_M and _compiled("exl3_linear_group", x2, *trellis, *suh, *svh):
        ys = ext.op("exl3_linear_group")(
            x2.to(torch.float16).contiguous(), [t.contiguous() for t in trellis], list(suh), list(svh), codebook,
            kt_per_chunk, ints,
        )
    else:
        ys = [exl3_linear_cuda(x2, t, su, sv, codebook, launch=launch) for t, su, sv in zip(trellis, suh, svh)]
    return [y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys]
