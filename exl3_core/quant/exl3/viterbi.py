"""EXL3 tile encoder: tail-biting Viterbi search for trellis states (format spec 3.4 and 5.5).

A tile is 256 fp32 weights in sequence order. The encoder picks 16-bit states ``s_0..s_255`` with
``s_p = ((s_{p-1} << K) | sym_p) & 0xFFFF`` (``s_{-1} = s_255``) that minimise
``sum_p (lut[s_p] - w_p)^2``. Two implementations give **identical** states: the pure-torch
reference here and the compiled op ``exl3::viterbi_encode`` (csrc/cpu/viterbi.cpp). A further
implementation (e.g. CUDA) must follow the definition below exactly to match them.

Exact definition
----------------
Notation: ``NN = 2^(16-K)`` nodes, ``L = 2^K`` candidates per node. All arithmetic is IEEE fp32
with round-to-nearest-even; ``fma(x, y, z)`` is the fused multiply-add ``x*y + z`` rounded once
(C ``fmaf``, CUDA ``__fmaf_rn``), never a separate multiply and add.

* Inputs: ``w`` is used as fp32 (other float dtypes are converted to fp32 first; no rounding to
  fp16, unlike ExLlamaV3, which also accumulates in fp16). It must be finite with
  ``|w| <= 65504``; then every path cost is finite and +inf only marks unreachable nodes.
  ``lut[s]`` = the fp16 codebook value of state ``s`` (``codebook.lut``) converted to fp32 (exact).
* Node ``n`` (0..NN-1) = the low 16-K bits of a state. Candidate ``a`` (0..L-1) of node ``n`` is
  the state ``s = a*NN + n``; its predecessor node is ``s >> K`` (= ``a*2^(16-2K) + (n >> K)``).
* One step with input ``w`` maps costs ``D`` (length NN) to ``D'``::

      d   = lut[s] - w              # fp32 subtract, rounded
      c_a = fma(d, d, D[s >> K])    # one rounding
      D'[n] = min_a c_a;  surv[n] = lowest a with c_a == D'[n]

  i.e. scanning a = 0, 1, ... and replacing only on strict ``<``.
* Pass 1 (unconstrained): ``D = 0`` for every node, steps i = 0..255 over the sequence rotated by
  128 (``w[128..255], w[0..127]``). ``n`` = lowest index of ``min D`` after step 255; then for
  i = 255 down to 128: ``n <- (surv_i[n]*NN + n) >> K``. The final ``n`` (the node at rotated
  index 127 = natural position 255) is the overlap ``O``, the low 16-K bits of ``s_255``.
* Pass 2 (forced): ``D = +inf`` except ``D[O] = 0``; steps over ``w[0..255]`` in natural order.
  Trace back from end node ``O``: ``s_p = surv_p[n]*NN + n``, ``n <- s_p >> K``. Then
  ``s_0 >> K == O == s_255 & (NN-1)``: the tail-biting condition holds for every tile.

Costs are never NaN and never -0, so ``min`` is order-independent: an implementation may reduce
the 2^K candidates in any order (e.g. a tree) as long as the survivor is the lowest ``a`` among
equal minima, and may recover survivors later by recomputing the candidates of the traced node
from stored costs (the C++ op does this for K >= 3).

torch has no exact fp32 FMA on the CPU, so the reference emulates it (:func:`fma32`): the
product of two fp32 numbers is exact in fp64, the fp64 sum is corrected to round-to-odd with the
TwoSum error term, and round-to-odd at 53 bits followed by one rounding to fp32 equals a single
correct rounding (53 >= 24 + 2).

The reference is vectorised over tiles and nodes and processes tiles in chunks so that the
survivor table (256 x NN uint8 per tile, 8 MiB at K=1) stays bounded. It costs ~65536 x 512
fp32 candidate evaluations per tile, so use the compiled op for real work.
"""
from __future__ import annotations

from typing import Literal

import torch

from exl3_core.quant.exl3 import codebook as _cb

SEQ = 256  # weights per tile (one 16x16 tile)
STATES = 65536
FP16_MAX = 65504.0
_SURV_BUDGET = 1 << 26  # bytes of survivor table the torch reference holds at once

Impl = Literal["auto", "torch", "cpp", "cuda"]


def _check_k(K: int) -> int:
    if isinstance(K, bool) or not isinstance(K, int) or not 1 <= K <= 8:
        raise ValueError(f"viterbi: bitrate K={K!r} is invalid; K must be an integer in 1..8")
    return K


def _check_tiles(tiles: torch.Tensor, keep_device: bool = False) -> torch.Tensor:
    if not isinstance(tiles, torch.Tensor):
        raise TypeError(f"viterbi: tiles must be a torch.Tensor [N, 256], got {type(tiles).__name__}")
    if tiles.dim() != 2 or tiles.shape[1] != SEQ:
        raise ValueError(
            f"viterbi: tiles must have shape [N, {SEQ}] (one 16x16 tile per row, sequence order), "
            f"got {tuple(tiles.shape)}; reshape with tiles.reshape(-1, {SEQ})"
        )
    if not tiles.is_floating_point():
        raise TypeError(f"viterbi: tiles must be floating point (fp32 preferred), got {tiles.dtype}")
    t = tiles.detach().to(device=tiles.device if keep_device else "cpu", dtype=torch.float32).contiguous()
    ok = torch.isfinite(t) & (t.abs() <= FP16_MAX)
    if not bool(ok.all()):
        bad = (~ok).nonzero()[0].tolist()
        raise ValueError(
            f"viterbi: tiles[{bad[0]}, {bad[1]}] = {t[bad[0], bad[1]].item()!r} is non-finite or outside "
            f"the fp16 range +-{FP16_MAX:g}; scale the weights (and drop NaN/inf) before encoding"
        )
    return t


def _lut32(codebook: int) -> torch.Tensor:
    return _cb.lut(codebook).to(torch.float32)


def fma32(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Exact fp32 fused multiply-add ``x*y + z`` (one rounding) for fp32 tensors, via fp64.

    ``x*y`` is exact in fp64 (24+24 < 53 bits). The fp64 sum may be inexact; TwoSum gives its exact
    error, which turns the round-to-nearest sum into the round-to-odd one, and that rounds to fp32
    without double-rounding error. Infinite operands give the IEEE result (NaN stays NaN).
    """
    p = x.double() * y.double()
    c = z.double()
    s = p + c
    bb = s - c
    err = (c - (s - bb)) + (p - bb)
    bits = s.view(torch.int64)
    fix = (err != 0) & ((bits & 1) == 0) & torch.isfinite(s)
    step = torch.where((err > 0) == (s > 0), 1, -1)
    return torch.where(fix, bits + step, bits).view(torch.float64).to(torch.float32)


def _viterbi_torch(seq: torch.Tensor, lut: torch.Tensor, K: int, forced: torch.Tensor | None) -> tuple[
    torch.Tensor, torch.Tensor
]:
    """Forward pass over seq [B, T] (T = 256 for a tile); returns final costs [B, NN] and survivors [T, B, NN]
    uint8."""
    B, T = seq.shape
    L, NN = 1 << K, STATES >> K
    M = NN >> K
    lut3 = lut.view(1, L, NN)
    if forced is None:
        D = torch.zeros(B, NN, dtype=torch.float32)
    else:
        D = torch.full((B, NN), float("inf"), dtype=torch.float32)
        D[torch.arange(B), forced] = 0.0
    surv = torch.empty(T, B, NN, dtype=torch.uint8)
    for i in range(T):
        d = lut3 - seq[:, i].view(B, 1, 1)
        # predecessor of (a, n) is a*M + (n >> K): each of D's L*M entries repeated L times
        Dp = D.view(B, L, M, 1).expand(B, L, M, L).reshape(B, L, NN)
        D, arg = fma32(d, d, Dp).min(dim=1)  # first index on ties (documented torch.min behaviour)
        surv[i] = arg.to(torch.uint8)
    return D, surv


def _encode_torch(tiles: torch.Tensor, K: int, codebook: int) -> torch.Tensor:
    N = tiles.shape[0]
    NN = STATES >> K
    lut = _lut32(codebook)
    out = torch.empty(N, SEQ, dtype=torch.int32)
    chunk = max(1, _SURV_BUDGET // (SEQ * NN))
    for c0 in range(0, N, chunk):
        w = tiles[c0 : c0 + chunk]
        B = w.shape[0]
        rows = torch.arange(B)
        # pass 1: rotated by 128, unconstrained; trace the arg-min end node back to rotated index 127
        D, surv = _viterbi_torch(torch.roll(w, -SEQ // 2, dims=1), lut, K, None)
        n = D.argmin(dim=1)  # first index on ties
        for i in range(SEQ - 1, SEQ // 2 - 1, -1):
            n = (surv[i, rows, n].to(torch.int64) * NN + n) >> K
        overlap = n
        # pass 2: natural order, start node forced to the overlap, traced back from it
        _, surv = _viterbi_torch(w, lut, K, overlap)
        n = overlap
        for p in range(SEQ - 1, -1, -1):
            s = surv[p, rows, n].to(torch.int64) * NN + n
            out[c0 : c0 + B, p] = s.to(torch.int32)
            n = s >> K
    return out


def encode_tiles(tiles: torch.Tensor, K: int, codebook: int, *, impl: Impl = "auto") -> torch.Tensor:
    """Encode tiles fp32 ``[N, 256]`` (sequence order) at K bits/weight with codebook id ``codebook``.

    Returns int32 ``[N, 256]``: the full 16-bit state (0..65535) of every position; the symbols to
    pack are the low K bits. ``impl``: ``"cpp"`` the compiled op (error if not built), ``"torch"``
    the reference, ``"auto"`` the compiled op when available. Both give identical states (see the
    module docstring). CUDA inputs use the CUDA kernel when it is built (``"cuda"``; result on the GPU); other
    inputs are copied to the CPU and the result is on the CPU.
    """
    K = _check_k(K)
    if codebook not in (_cb.CB_3INST, _cb.CB_MCG, _cb.CB_MUL1):
        raise ValueError(
            f"viterbi: unknown codebook id {codebook!r}; expected 0 (3inst), 1 (mcg) or 2 (mul1)"
        )
    if impl not in ("auto", "torch", "cpp", "cuda"):
        raise ValueError(f"viterbi: impl={impl!r} is invalid; use 'auto', 'torch', 'cpp' or 'cuda'")
    if impl == "cuda" or (impl == "auto" and tiles.is_cuda and has_cuda()):
        if not has_cuda():
            raise RuntimeError("viterbi: impl='cuda' but exl3::viterbi_encode has no CUDA kernel in this build")
        t = _check_tiles(tiles, keep_device=True)
        from exl3_core import ext

        # identical states to the CPU op; the result stays on the GPU
        return ext.op("viterbi_encode")(t, _lut32(codebook).to(t.device), K)
    t = _check_tiles(tiles)
    if impl == "auto":
        impl = "cpp" if has_cpp() else "torch"
    if impl == "cpp":
        if not has_cpp():
            from exl3_core import ext

            raise RuntimeError(
                "viterbi: impl='cpp' but the compiled op exl3::viterbi_encode is unavailable "
                f"({'; '.join(ext.load_error) or 'extension disabled or built without it'}); build it with "
                "`python setup.py build_ext --inplace` or use impl='torch'"
            )
        from exl3_core import ext, settings

        # EXL3_NUM_THREADS sizes the op's at::parallel_for pool (0 = torch's current setting)
        want, before = settings.get().num_threads, torch.get_num_threads()
        if want > 0 and want != before:
            torch.set_num_threads(want)
        try:
            return ext.op("viterbi_encode")(t, _lut32(codebook), K)
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)
    return _encode_torch(t, K, codebook)


def has_cuda() -> bool:
    """True when ``exl3::viterbi_encode`` has a CUDA kernel (extension built with nvcc)."""
    from exl3_core import ext

    return (ext.has_op("viterbi_encode") and torch.cuda.is_available()
            and torch._C._dispatch_has_kernel_for_dispatch_key("exl3::viterbi_encode", "CUDA"))


def has_cpp() -> bool:
    """True when the compiled ``exl3::viterbi_encode`` op is available."""
    from exl3_core import ext

    return ext.has_op("viterbi_encode")


def decode_states(states: torch.Tensor, codebook: int) -> torch.Tensor:
    """fp16 codebook values of 16-bit states (any integer dtype, same shape)."""
    return _cb.lut(codebook).to(states.device)[states.to(torch.int64) & 0xFFFF]


def tile_mse(tiles: torch.Tensor, states: torch.Tensor, codebook: int) -> torch.Tensor:
    """Per-tile mean squared error ``[N]`` (fp64) between tiles and the decoded states."""
    if tiles.shape != states.shape:
        raise ValueError(
            f"tile_mse: tiles {tuple(tiles.shape)} and states {tuple(states.shape)} differ in shape"
        )
    q = decode_states(states, codebook).to(torch.float64)
    return ((q - tiles.to(torch.float64)) ** 2).mean(dim=-1)


def states_consistent(states: torch.Tensor, K: int) -> torch.Tensor:
    """Bool ``[N]``: every transition, wrap included, has ``s_p >> K == s_{p-1} & (2^(16-K)-1)``."""
    K = _check_k(K)
    s = states.to(torch.int64) & 0xFFFF
    prev = torch.roll(s, 1, dims=-1)
    return ((s >> K) == (prev & ((1 << (16 - K)) - 1))).all(dim=-1)
