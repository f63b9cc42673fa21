"""EXL3-quantized linear layer: checkpoint loading, validation and the forward pass (spec 1, 4.3).

The trellis stays the source of truth. The torch reference path decodes Ŵ once (the slow part)
and caches it in fp16 (exact) next to the trellis; the compiled GEMM, when built, decodes on the fly.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from exl3_core import ext
from exl3_core.ops import ACT_CODES
from exl3_core.quant.exl3 import codebook as _cb
from exl3_core.quant.exl3.cuda_ops import reconstruct_full_into_cuda
from exl3_core.quant.exl3.dequant import apply_scales_and_rotations, codebook_from_markers
from exl3_core.quant.exl3.hadamard import EXL3_BLOCK, had_blockwise
from exl3_core.quant.exl3.trellis import MAX_K, decode_inner

if TYPE_CHECKING:
    from exl3_core.nn.norm import DeferredNorm

PAD = EXL3_BLOCK  # quantized in/out features are zero-padded to multiples of 128 (spec 1.4)
CODEBOOK_LABELS = {v: k for k, v in _cb.CODEBOOK_NAMES.items()}


def padded(features: int) -> int:
    """``features`` rounded up to the 128 multiple EXL3 stores."""
    return -(-features // PAD) * PAD


def is_exl3_storage(key: str, names: Collection[str]) -> bool:
    """True iff ``key`` is stored as EXL3: ``trellis`` + (``suh``|``su``) + (``svh``|``sv``) (spec 1.5)."""
    return (
        f"{key}.trellis" in names
        and (f"{key}.suh" in names or f"{key}.su" in names)
        and (f"{key}.svh" in names or f"{key}.sv" in names)
    )


def unpack_sign_bits(packed: torch.Tensor, length: int, name: str) -> torch.Tensor:
    """Legacy ``su``/``sv`` (int16 ``[len/16]``): bit i of word w is element 16w+i, set = -1 (spec 1.5)."""
    if packed.dtype != torch.int16 or packed.dim() != 1:
        raise ValueError(
            f"{name}: legacy packed signs must be 1-D int16, got {packed.dtype} {tuple(packed.shape)}"
        )
    if packed.numel() * 16 != length:
        raise ValueError(
            f"{name}: has {packed.numel()} words, expected {length // 16} (= {length} signs / 16)"
        )
    bits = (
        packed.to(torch.int32).unsqueeze(-1) >> torch.arange(16, dtype=torch.int32, device=packed.device)
    ) & 1
    return (1 - 2 * bits).reshape(length).to(torch.float16)


def _check_trellis(name: str, trellis: torch.Tensor, k: int | None = None, n: int | None = None) -> int:
    """Validate dtype/rank/word count (and padded shape when known); return K."""
    if trellis.dtype != torch.int16:
        raise ValueError(f"{name}: dtype {trellis.dtype}, expected int16 (safetensors I16)")
    if trellis.dim() != 3:
        raise ValueError(f"{name}: shape {tuple(trellis.shape)}, expected 3-D [in/16, out/16, 16*K]")
    words = trellis.shape[-1]
    if words % 16 or not 1 <= words // 16 <= MAX_K:
        raise ValueError(
            f"{name}: last dim {words} gives an impossible K ({words}/16); EXL3 stores 16*K int16 words per "
            f"16x16 tile with K in 1..{MAX_K}, so the tensor is truncated or not an EXL3 trellis"
        )
    K = words // 16
    if k is not None and n is not None and tuple(trellis.shape) != (k // 16, n // 16, 16 * K):
        raise ValueError(
            f"{name}: shape {list(trellis.shape)}, expected [{k // 16}, {n // 16}, {16 * K}] for padded "
            f"in/out features {k}/{n}; the file is truncated or belongs to another layer size"
        )
    return K


class EXL3Linear(torch.nn.Module):
    """``y = x @ W + bias`` with W stored as an EXL3 trellis (``(in, out)`` orientation, padded to 128).

    Buffers keep the checkpoint's names and dtypes: ``trellis`` (int16), ``suh``/``svh`` (fp16) and
    the optional ``bias`` (fp16, padded length). ``in_features``/``out_features`` are the true sizes;
    inputs narrower than the padded width are zero-extended and outputs trimmed.
    """

    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        trellis: torch.Tensor,
        suh: torch.Tensor,
        svh: torch.Tensor,
        codebook: int,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None = None,
        key: str = "exl3_linear",
    ) -> None:
        super().__init__()
        if codebook not in CODEBOOK_LABELS:
            raise ValueError(
                f"{key}: unknown codebook id {codebook!r}; expected 0 (3inst), 1 (mcg) or 2 (mul1)"
            )
        k, n = padded(in_features), padded(out_features)
        self.K = _check_trellis(f"{key}.trellis", trellis, k, n)
        for name, t, size in (("suh", suh, k), ("svh", svh, n)):
            if not t.dtype.is_floating_point or tuple(t.shape) != (size,):
                raise ValueError(f"{key}.{name}: {t.dtype} {list(t.shape)}, expected a float vector [{size}]")
        if bias is not None:
            if not bias.dtype.is_floating_point or bias.dim() != 1 or bias.numel() not in (out_features, n):
                raise ValueError(
                    f"{key}.bias: {bias.dtype} {list(bias.shape)}, expected a float vector "
                    f"[{n}] or [{out_features}]"
                )
            if bias.numel() != n:
                bias = torch.nn.functional.pad(bias, (0, n - bias.numel()))
        self.key = key
        self.codebook = codebook
        self.in_features = in_features
        self.out_features = out_features
        self.padded_in_features = k
        self.padded_out_features = n
        self.cache_decoded = True
        self.register_buffer("trellis", trellis)
        self.register_buffer("suh", suh)
        self.register_buffer("svh", svh)
        self.register_buffer("bias", bias)
        self._inner: torch.Tensor | None = None

    @classmethod
    def from_tensors(
        cls,
        key: str,
        get: Callable[[str], torch.Tensor | None],
        in_features: int,
        out_features: int,
    ) -> EXL3Linear:
        """Build from checkpoint tensors ``<key>.*``; ``get(name)`` returns a tensor or None if absent."""
        trellis = get(f"{key}.trellis")
        if trellis is None:
            raise KeyError(f"{key}.trellis: missing; {key} is not stored as EXL3")
        k, n = padded(in_features), padded(out_features)
        _check_trellis(f"{key}.trellis", trellis, k, n)

        def scales(side: str, size: int) -> torch.Tensor:
            t = get(f"{key}.{side}h")
            if t is not None:
                return t
            legacy = get(f"{key}.{side}")
            if legacy is None:
                raise KeyError(
                    f"{key}.{side}h: missing (and no legacy {key}.{side}); checkpoint is incomplete"
                )
            return unpack_sign_bits(legacy, size, f"{key}.{side}")

        codebook = codebook_from_markers(key, get(f"{key}.mcg"), get(f"{key}.mul1"))
        return cls(
            trellis,
            scales("su", k),
            scales("sv", n),
            codebook,
            in_features,
            out_features,
            bias=get(f"{key}.bias"),
            key=key,
        )

    # ---- decoded weights

    def _apply(self, fn: Callable[..., torch.Tensor], recurse: bool = True) -> EXL3Linear:
        self._inner = None  # .to()/.cuda() move the trellis; the cache follows lazily
        return super()._apply(fn, recurse)

    def clear_cache(self) -> None:
        """Drop the decoded Ŵ (memory); the next reference forward decodes again."""
        self._inner = None

    def inner(self) -> torch.Tensor:
        """Decoded fp16 Ŵ ``[k, n]`` (padded, rotated domain), bit-exact; cached if ``cache_decoded``."""
        if self._inner is not None:
            return self._inner
        w = decode_inner(self.trellis, self.K, self.codebook)
        if self.cache_decoded:
            self._inner = w
        return w

    def dequantize(self) -> torch.Tensor:
        """fp32 W ``[in_features, out_features]`` in the original basis (bias not included)."""
        w = apply_scales_and_rotations(self.inner(), self.suh, self.svh)
        return w[: self.in_features, : self.out_features]

    # ---- forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        if width not in (self.in_features, self.padded_in_features):
            raise ValueError(
                f"{self.key}: input last dim {width}, expected {self.in_features} "
                f"(or padded {self.padded_in_features})"
            )
        if width < self.padded_in_features:
            x = torch.nn.functional.pad(x, (0, self.padded_in_features - width))
        y = exl3_matmul(x, self)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y[..., : self.out_features].to(x.dtype)

    def forward_act(self, gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor | None:
        """``self(act(gate) * up)`` with the activation product computed in the one-launch linear's
        prologue (decode sizes on CUDA: one launch less per gated MLP); ``act`` in
        :data:`exl3_core.ops.ACT_CODES`. None where that path does not apply: the caller forms the product and calls the layer."""
        code = ACT_CODES.get(act)
        width = up.shape[-1]
        rows = up.numel() // max(width, 1)
        if (code is None or not up.is_cuda or gate.shape != up.shape or width != self.padded_in_features
                or rows > FUSED_GROUP_MAX_ROWS or up.dtype != torch.float16 or gate.dtype != torch.float16
                or _hooked((self,)) or not ext.has_op("exl3_linear_act")):
            return None
        y = ext.op("exl3_linear_act")(gate.reshape(rows, width), up.reshape(rows, width), self.trellis, self.suh,
                                      self.svh, self.codebook, code)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y[:, : self.out_features].reshape(*up.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, K={self.K}, "
            f"codebook={CODEBOOK_LABELS[self.codebook]}, bias={self.bias is not None}"
        )


def exl3_matmul_reference(x: torch.Tensor, layer: EXL3Linear) -> torch.Tensor:
    """fp32 ``x @ W`` (padded widths, no bias) via spec 4.3 without intermediate fp16 rounding."""
    xs = x.to(torch.float32) * layer.suh.to(torch.float32)
    xh = had_blockwise(xs, dim=-1)
    z = xh @ layer.inner().to(torch.float32)
    return had_blockwise(z, dim=-1) * layer.svh.to(torch.float32)


def exl3_matmul(x: torch.Tensor, layer: EXL3Linear) -> torch.Tensor:
    """Op-dispatch seam for ``x[..., k] @ W -> [..., n]`` (padded widths, no bias).

    On CUDA with the compiled op present it calls
    ``torch.ops.exl3.exl3_gemm(x2d fp16 [m, k] contiguous, trellis, suh, svh, codebook: int) -> fp16 [m, n]``
    (K from the trellis' last dim; bf16 in and out for a bf16 ``x`` from 65 rows); otherwise the fp32
    torch reference. The result's dtype is the path's (fp16, bf16 or fp32); the caller casts.
    """
    if x.is_cuda and ext.has_op("exl3_gemm"):
        # bf16 from 65 rows (a bf16 prefill, exl3_core.archkit.decoder): the op rebuilds W in bf16 and
        # runs a bf16 GEMM, bf16 out; fp16 otherwise
        bf16 = x.dtype == torch.bfloat16 and x.numel() // max(x.shape[-1], 1) >= GROUP_GEMM_MIN_ROWS \
            and layer.padded_in_features % 128 == 0 and layer.trellis.shape[1] % 8 == 0
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16 if bf16 else torch.float16).contiguous()
        y = ext.op("exl3_gemm")(x2, layer.trellis, layer.suh, layer.svh, layer.codebook)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return exl3_matmul_reference(x, layer)


#: rows up to which the compiled one-launch linear (its grouped, residual and deferred-norm forms)
#: is used, and with it the decode step's fused chain; beyond it the 4-kernel split-k GEMM. The
#: m <= 8 kernel's transposed main loop (one mma per tile) made 8 rows pay: the 8B shape's b=8 step
#: fell from 5.37 ms (4 rows) to 4.04 ms (H200, docs/performance.md, run 13)
FUSED_GROUP_MAX_ROWS = 8


def _groupable(x: torch.Tensor, layers: tuple[torch.nn.Module, ...]) -> bool:
    if not (x.is_cuda and 2 <= len(layers) <= 3 and ext.has_op("exl3_linear_group")) or _hooked(layers):
        return False
    first = layers[0]
    if not isinstance(first, EXL3Linear) or x.numel() // max(x.shape[-1], 1) > FUSED_GROUP_MAX_ROWS:
        return False
    return all(isinstance(m, EXL3Linear) and m.K == first.K and m.codebook == first.codebook
               and m.in_features == first.in_features and m.trellis.device == x.device for m in layers)


#: rows from which exl3_gemm multiplies by W rebuilt in the original basis (csrc FULL_MIN_M); from
#: there, linears that share x are rebuilt side by side into one W and multiplied by one GEMM
GROUP_GEMM_MIN_ROWS = 65


def _hooked(layers: tuple[torch.nn.Module, ...]) -> bool:
    """A grouped launch never calls the layers' own forward, so their hooks (the converter's input
    capture) would see nothing: layers with hooks are called one by one."""
    return any(m._forward_pre_hooks or m._forward_hooks for m in layers)


def _group_gemm_ok(x: torch.Tensor, layers: tuple[torch.nn.Module, ...]) -> bool:
    if not (x.is_cuda and len(layers) >= 2 and ext.has_op("reconstruct_full_into")) or _hooked(layers):
        return False
    first = layers[0]
    if not isinstance(first, EXL3Linear) or x.numel() // max(x.shape[-1], 1) < GROUP_GEMM_MIN_ROWS:
        return False
    return all(isinstance(m, EXL3Linear) and m.padded_in_features == first.padded_in_features
               and m.padded_in_features % 128 == 0 and m.trellis.shape[1] % 8 == 0 and m.trellis.device == x.device
               for m in layers)


def group_gemm(x2: torch.Tensor, lins: list[EXL3Linear]) -> list[torch.Tensor]:
    """``[x2 @ W_i]`` (padded output widths, no bias) for linears sharing ``x2 [m, k_pad]``: every
    W_i rebuilt into its column block of one ``[k, Σ n_i]`` matrix, then one GEMM. At prefill sizes
    this is one cuBLAS call instead of 2-3 (each costs tens of us of host time, and k/v alone are
    narrow), and the outputs are column views of one result. fp16 operands and output, or bf16 when
    ``x2`` is bf16 (W rebuilt in bf16: the bf16 prefill)."""
    widths = [m.trellis.shape[1] * 16 for m in lins]
    dtype = torch.bfloat16 if x2.dtype == torch.bfloat16 else torch.float16
    w = torch.empty((x2.shape[-1], sum(widths)), dtype=dtype, device=x2.device)
    off = 0
    for m, n in zip(lins, widths, strict=True):
        reconstruct_full_into_cuda(m.trellis, m.suh, m.svh, m.K, m.codebook, w[:, off:off + n])
        off += n
    y = x2.to(dtype) @ w
    return list(y.split(widths, dim=1))


def _group_ex_ok(x: torch.Tensor | DeferredNorm, layers: tuple[torch.nn.Module, ...], no_bias: bool = False) -> bool:
    """Whether ``exl3::exl3_linear_group_ex`` takes the linears on ``x`` in one launch (a DeferredNorm:
    the norm in its prologue): 1-3 EXL3 linears of one K and codebook on unpadded fp16 input at decode
    sizes, no hooks; ``no_bias`` for an epilogue that must see the outputs before any bias."""
    d = None if isinstance(x, torch.Tensor) else x
    h = x if d is None else d.h
    if not (h.is_cuda and h.dtype == torch.float16 and 1 <= len(layers) <= 3 and ext.has_op("exl3_linear_group_ex")
            and 1 <= h.numel() // max(h.shape[-1], 1) <= FUSED_GROUP_MAX_ROWS) or _hooked(layers):
        return False
    if d is not None:
        w = d.norm.weight
        if not (d.ss.dtype == torch.float32 and d.ss.device == h.device and d.ss.dim() == 1 and d.ss.stride(0) == 1):
            return False
        if w is not None and (w.dtype != torch.float32 or w.shape != (h.shape[-1],) or w.device != h.device):
            return False
    first = layers[0]
    if not isinstance(first, EXL3Linear):
        return False
    return all(isinstance(m, EXL3Linear) and m.K == first.K and m.codebook == first.codebook
               and m.in_features == m.padded_in_features == h.shape[-1] and m.trellis.device == h.device
               and not (no_bias and m.bias is not None) for m in layers)


@dataclass(frozen=True)
class QKVEpilogue:
    """Attention's RoPE and paged KV write, done by the q/k/v linears' epilogue
    (:func:`project_group` with ``epilogue``): q and k heads rotated by the fp32 tables ``cos``/``sin``
    ``[T, head_dim/2]`` (halves, or adjacent pairs if ``interleaved``), k and v written to the fp16
    caches at the flat ``slots [T]``."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool
    slots: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def qkv_epilogue_ok(x: torch.Tensor | DeferredNorm, layers: tuple[torch.nn.Module, ...], head_dim: int,
                    rotary_dim: int) -> bool:
    """Whether q/k/v can run with a :class:`QKVEpilogue` (three fusable EXL3 linears, no biases, RoPE
    over whole heads of 32, 64 or 128; the caches are the caller's to check)."""
    return (len(layers) == 3 and head_dim in (32, 64, 128) and rotary_dim == head_dim
            and _group_ex_ok(x, layers, no_bias=True)
            and all(m.out_features == m.padded_out_features for m in layers))  # type: ignore[union-attr]


def project_group(x: torch.Tensor | DeferredNorm, layers: tuple[torch.nn.Module, ...],
                  epilogue: QKVEpilogue | None = None) -> list[torch.Tensor]:
    """``[layer(x) for layer in layers]``; one kernel launch for 2-3 EXL3 linears sharing ``x``.

    ``x`` may be a :class:`~exl3_core.nn.norm.DeferredNorm`: at decode sizes the one-launch linear
    then normalises the residual stream in its prologue (1-3 EXL3 linears; no norm kernel); otherwise
    the norm is computed first. ``epilogue`` (q/k/v only, where :func:`qkv_epilogue_ok` holds) rotates
    q and k and writes k and v to the cache in the same launch.

    q/k/v and gate/up read the same input; at decode sizes a launch per linear costs more than the
    small ones' work (measured: q/k/v of the 8B shape 25.4 us as three launches, 14.7 us as one).
    From 65 rows (prefill) EXL3 linears sharing x are rebuilt side by side and multiplied by one
    GEMM (:func:`group_gemm`; K and codebook may differ). Falls back to separate calls whenever the
    layers cannot share a launch (other linear types, K or codebook differ at decode sizes, CPU).
    """
    if epilogue is not None:
        if not qkv_epilogue_ok(x, layers, 2 * epilogue.cos.shape[-1], 2 * epilogue.cos.shape[-1]):
            raise ValueError(f"project_group: these linears cannot take a QKVEpilogue ({', '.join(type(m).__name__ for m in layers)}); "
                             f"check qkv_epilogue_ok first")
        return _project_group_ex(x, layers, epilogue)  # type: ignore[arg-type]
    if not isinstance(x, torch.Tensor):  # a DeferredNorm
        if _group_ex_ok(x, layers):
            return _project_group_ex(x, layers)  # type: ignore[arg-type]
        x = x.materialize()
    big = _group_gemm_ok(x, layers)
    if not big and not _groupable(x, layers):
        return [m(x) for m in layers]
    lins: list[EXL3Linear] = list(layers)  # type: ignore[arg-type]
    first = lins[0]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[-1] < first.padded_in_features:
        x2 = torch.nn.functional.pad(x2, (0, first.padded_in_features - x2.shape[-1]))
    if big:
        ys = group_gemm(x2, lins)
    else:
        ys = ext.op("exl3_linear_group")(x2.to(torch.float16).contiguous(), [m.trellis for m in lins],
                                         [m.suh for m in lins], [m.svh for m in lins], first.codebook, 0)
    return _outputs(lins, ys, tuple(x.shape[:-1]), x.dtype)


def _outputs(lins: list[EXL3Linear], ys: list[torch.Tensor], lead: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    out = []
    for m, y in zip(lins, ys):
        if m.bias is not None:
            y = y + m.bias.to(y.dtype)
        out.append(y[:, : m.out_features].to(dtype).reshape(*lead, m.out_features))
    return out


def _project_group_ex(x: torch.Tensor | DeferredNorm, layers: tuple[EXL3Linear, ...],
                      ep: QKVEpilogue | None = None) -> list[torch.Tensor]:
    d = None if isinstance(x, torch.Tensor) else x
    h = x if d is None else d.h
    h2 = h.reshape(-1, h.shape[-1])
    lins = list(layers)
    norm = d.norm if d is not None else None
    rope = (ep.cos, ep.sin, ep.interleaved, [1, 1, 0], ep.slots, [None, ep.k_cache, ep.v_cache]) if ep is not None \
        else (None, None, False, [], None, [])
    ys = ext.op("exl3_linear_group_ex")(
        h2.contiguous(), [m.trellis for m in lins], [m.suh for m in lins], [m.svh for m in lins], lins[0].codebook,
        d.ss if d is not None else None, norm.weight if norm is not None else None,
        float(norm.eps) if norm is not None else 0.0, float(norm.offset) if norm is not None else 0.0, *rope)
    return _outputs(lins, ys, tuple(h.shape[:-1]), h.dtype)


def residual_fusable(layer: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor,
                     gate: torch.Tensor | None = None) -> bool:
    """Whether :func:`linear_residual` runs ``residual + layer(x)`` as one launch (EXL3, CUDA, decode
    sizes, fp16, unpadded output width, no bias, no hooks)."""
    if not (isinstance(layer, EXL3Linear) and x.is_cuda and x.dtype == torch.float16 and residual.dtype == torch.float16
            and ext.has_op("exl3_linear_residual") and layer.bias is None and not _hooked((layer,))):
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return (rows <= FUSED_GROUP_MAX_ROWS and x.shape[-1] == layer.padded_in_features
            and layer.out_features == layer.padded_out_features == residual.shape[-1]
            and residual.numel() == rows * residual.shape[-1] and layer.trellis.device == x.device
            and (gate is None or (gate.shape == x.shape and gate.dtype == torch.float16)))


def linear_residual(layer: EXL3Linear, x: torch.Tensor, residual: torch.Tensor, ss: torch.Tensor,
                    gate: torch.Tensor | None = None, act: str | None = None) -> torch.Tensor:
    """``residual + layer(x)`` (``layer(act(gate) * x)`` with ``gate``) in one launch, each row's sum of
    squares of the result added into ``ss`` (fp32, zero before) for the next linear's deferred norm.
    Only where :func:`residual_fusable` holds; ``act`` in :data:`exl3_core.ops.ACT_CODES`."""
    rows = x.numel() // x.shape[-1]
    if gate is not None and act not in ACT_CODES:
        raise ValueError(f"{layer.key}: linear_residual with a gate needs act in {sorted(ACT_CODES)}, got {act!r}")
    code = ACT_CODES[act] if gate is not None else 0  # type: ignore[index]
    g = gate.reshape(rows, -1) if gate is not None else None
    y = ext.op("exl3_linear_residual")(x.reshape(rows, -1), g, code, layer.trellis, layer.suh, layer.svh,
                                       layer.codebook, residual.reshape(rows, -1), ss)
    return y.reshape(residual.shape)
