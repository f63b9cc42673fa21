"""EXL3-quantized linear layer: checkpoint loading, validation, the forward pass (spec 1, 4.3) and
the compiled kernels' entry points.

The trellis stays the source of truth. The torch reference path decodes Ŵ once (the slow part)
and caches it in fp16 (exact) next to the trellis; the compiled GEMM, when built, decodes on the fly.

The ``launch_*`` functions call the compiled one-launch kernels with explicit arguments and
check nothing but what the kernels require (:func:`launch_unsupported`); *when* to use them is
the execution plan's decision (:mod:`exl3_core.plan`), which states its reasons.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from exl3_core import ext
from exl3_core.kernels import launch as _launch
from exl3_core.kernels.codes import ACT_CODES
from exl3_core.quant.exl3 import codebook as _cb
from exl3_core.quant.exl3.cuda_ops import reconstruct_full_into_cuda
from exl3_core.quant.exl3.dequant import apply_scales_and_rotations, codebook_from_markers
from exl3_core.quant.exl3.hadamard import EXL3_BLOCK, had_blockwise
from exl3_core.quant.exl3.trellis import MAX_K, decode_inner

if TYPE_CHECKING:
    from exl3_core.nn.adapters import LinearAdapter
    from exl3_core.nn.shard import LinearShard

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
        #: side computations added to the output (:mod:`exl3_core.nn.adapters`)
        self.adapters: tuple[LinearAdapter, ...] = ()
        #: the tensor-parallel part this layer holds (:mod:`exl3_core.nn.shard`); None: all of it
        self.shard: LinearShard | None = None

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
        y = self.forward_base(x)
        if self.adapters:
            from exl3_core.nn.adapters import adapted

            y = adapted(y, x[..., : self.in_features], self.adapters, owned=True)
        return y

    def forward_base(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's own output, without its adapters' deltas (a caller that adds them itself, grouped)."""
        width = x.shape[-1]
        if width not in (self.in_features, self.padded_in_features):
            raise ValueError(
                f"{self.key}: input last dim {width}, expected {self.in_features} "
                f"(or padded {self.padded_in_features})"
            )
        y = exl3_matmul(x, self)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y[..., : self.out_features].to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, K={self.K}, "
            f"codebook={CODEBOOK_LABELS[self.codebook]}, bias={self.bias is not None}"
        )


def exl3_matmul_reference(x: torch.Tensor, layer: EXL3Linear) -> torch.Tensor:
    """fp32 ``x @ W`` (padded output width, no bias) via spec 4.3 without intermediate fp16 rounding; an input
    narrower than the padded width is padded with zeros."""
    if x.shape[-1] < layer.padded_in_features:
        x = torch.nn.functional.pad(x, (0, layer.padded_in_features - x.shape[-1]))
    xs = x.to(torch.float32) * layer.suh.to(torch.float32)
    xh = had_blockwise(xs, dim=-1)
    z = xh @ layer.inner().to(torch.float32)
    return had_blockwise(z, dim=-1) * layer.svh.to(torch.float32)


#: rows from which the compiled exl3_gemm multiplies by W rebuilt in the original basis (its FULL_MIN_M): there
#: linears sharing x can be rebuilt side by side (:func:`group_gemm`), and a bf16 x gets a bf16 GEMM
REBUILD_MIN_ROWS = 65


def takes_unpadded(width: int, padded_width: int) -> bool:
    """Whether the compiled ops take an input (or a residual stream) of ``width`` columns for a layer padded to
    ``padded_width``, reading the missing columns as zeros: a multiple of 4 within 128 of it."""
    return width == padded_width or (padded_width - 128 < width < padded_width and width % 4 == 0)


def exl3_matmul(x: torch.Tensor, layer: EXL3Linear) -> torch.Tensor:
    """Op-dispatch seam for ``x[..., k] @ W -> [..., n]`` (``k``: the padded input width, or the layer's own,
    padded here where the path needs it; ``n`` padded; no bias).

    On CUDA with the compiled op present it calls
    ``torch.ops.exl3.exl3_gemm(x2d fp16 [m, k] contiguous, trellis, suh, svh, codebook: int, launch) -> fp16 [m, n]``
    (K from the trellis' last dim; bf16 in and out for a bf16 ``x`` from :data:`REBUILD_MIN_ROWS` rows; ``launch``:
    the running forward's :class:`~exl3_core.kernels.launch.LaunchConfig`, for the few rows it sends to the
    one-launch kernel); otherwise the fp32 torch reference. The result's dtype is the path's (fp16, bf16 or
    fp32); the caller casts.
    """
    k = layer.padded_in_features
    if x.shape[-1] < k and not (x.is_cuda and takes_unpadded(x.shape[-1], k)):
        x = torch.nn.functional.pad(x, (0, k - x.shape[-1]))
    if x.is_cuda and ext.has_op("exl3_gemm"):
        bf16 = x.dtype == torch.bfloat16 and x.numel() // max(x.shape[-1], 1) >= REBUILD_MIN_ROWS \
            and layer.padded_in_features % 128 == 0 and layer.trellis.shape[1] % 8 == 0
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16 if bf16 else torch.float16).contiguous()
        y = ext.op("exl3_gemm")(x2, layer.trellis, layer.suh, layer.svh, layer.codebook, _launch.current().ints())
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return exl3_matmul_reference(x, layer)


# -- the compiled one-launch kernels ---------------------------------------------------------------
# Each ``launch_*`` passes the launch options of the forward running in this context
# (:func:`exl3_core.kernels.launch.current`, set by the execution plan from its tuning) as the op's
# trailing ``launch`` argument: PDL, pre-decoding and the x-once threshold are per call, not per process.

#: the most rows the one-launch kernels take
LAUNCH_MAX_ROWS = 8


def rebuild_unsupported(layers: Sequence[torch.nn.Module]) -> list[str]:
    """Why ``layers`` cannot be rebuilt side by side into one W for :func:`group_gemm` ([]: they can)."""
    if not all(isinstance(m, EXL3Linear) for m in layers):
        return [f"not all EXL3 ({', '.join(type(m).__name__ for m in layers)})"]
    lins: list[EXL3Linear] = list(layers)  # type: ignore[arg-type]
    r = []
    if len({m.padded_in_features for m in lins}) != 1:
        r.append("input widths differ")
    if any(m.padded_in_features % 128 or m.trellis.shape[1] % 8 for m in lins):
        r.append("widths not multiples of 128")
    return r


def launch_unsupported(layers: Sequence[torch.nn.Module], pads_input: bool = False) -> list[str]:
    """Why the one-launch kernels cannot take ``layers`` as one problem group ([]: they can): 1-3 EXL3
    linears of one K and codebook sharing an input the kernels take unpadded (:func:`takes_unpadded`;
    ``pads_input``: any width, the caller pads it; the norm prologue cannot)."""
    if not 1 <= len(layers) <= 3:
        return [f"{len(layers)} linears (the kernel takes 1 to 3)"]
    if not all(isinstance(m, EXL3Linear) for m in layers):
        return [f"not all EXL3 ({', '.join(type(m).__name__ for m in layers)})"]
    lins: list[EXL3Linear] = list(layers)  # type: ignore[arg-type]
    r = []
    if len({(m.K, m.codebook) for m in lins}) != 1:
        r.append("bitrates or codebooks differ (" + ", ".join(f"K={m.K}/{CODEBOOK_LABELS[m.codebook]}" for m in lins) + ")")
    if len({m.in_features for m in lins}) != 1:
        r.append("input widths differ")
    if not pads_input and any(not takes_unpadded(m.in_features, m.padded_in_features) for m in lins):
        r.append("input width not a multiple of 4")
    return r


def launch_outputs(lins: Sequence[EXL3Linear], ys: Sequence[torch.Tensor], lead: tuple[int, ...],
                   dtype: torch.dtype) -> list[torch.Tensor]:
    """The kernels' padded fp16 outputs as each linear's result: bias added, trimmed, shaped ``lead + (out,)``."""
    out = []
    for m, y in zip(lins, ys):
        if m.bias is not None:
            y = y + m.bias.to(y.dtype)
        out.append(y[:, : m.out_features].to(dtype).reshape(*lead, m.out_features))
    return out


def launch_group(x2: torch.Tensor, lins: Sequence[EXL3Linear]) -> list[torch.Tensor]:
    """``[x2 @ W_i]`` (padded widths, no bias) for 2-3 linears on ``x2 [m <= 8, k_pad]`` in one launch."""
    return ext.op("exl3_linear_group")(x2.to(torch.float16).contiguous(), [m.trellis for m in lins],
                                       [m.suh for m in lins], [m.svh for m in lins], lins[0].codebook, 0,
                                       _launch.current().ints())


@dataclass(frozen=True)
class NormPrologue:
    """RMSNorm done in a launch's prologue: the rows' fp32 sums of squares ``ss`` (from the kernel that
    produced them), the norm's fp32 weight (None: no weight), eps and weight offset."""

    ss: torch.Tensor
    weight: torch.Tensor | None
    eps: float
    offset: float


@dataclass(frozen=True)
class RopeCacheEpilogue:
    """q/k/v's RoPE and paged cache write in the launch's epilogue: q and k heads rotated by the fp32 tables
    ``cos``/``sin`` ``[T, head_dim/2]`` (halves, or adjacent pairs if ``interleaved``), k and v stored to the
    fp16 caches at the flat ``slots [T]``."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool
    slots: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def launch_group_ex(h2: torch.Tensor, lins: Sequence[EXL3Linear], norm: NormPrologue | None = None,
                    epilogue: RopeCacheEpilogue | None = None) -> list[torch.Tensor]:
    """``[norm(h2) @ W_i]`` (padded, no bias) for 1-3 linears on ``h2 [m <= 8, k]`` in one launch, the norm
    in the prologue and RoPE + the cache write in the epilogue where given (each cache slot as wide as its
    linear's unpadded output)."""
    rope = (epilogue.cos, epilogue.sin, epilogue.interleaved, [1, 1, 0], epilogue.slots,
            [None, epilogue.k_cache, epilogue.v_cache]) if epilogue is not None else (None, None, False, [], None, [])
    return ext.op("exl3_linear_group_ex")(
        h2.contiguous(), [m.trellis for m in lins], [m.suh for m in lins], [m.svh for m in lins], lins[0].codebook,
        norm.ss if norm is not None else None, norm.weight if norm is not None else None,
        float(norm.eps) if norm is not None else 0.0, float(norm.offset) if norm is not None else 0.0, *rope,
        _launch.current().ints(), [m.out_features for m in lins] if epilogue is not None else [])


def launch_act(layer: EXL3Linear, gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """``layer(act(gate) * up)`` (padded output, no bias) with the product formed in the launch's prologue;
    ``gate``/``up`` fp16 ``[m <= 8, k_pad]``."""
    return ext.op("exl3_linear_act")(gate, up, layer.trellis, layer.suh, layer.svh, layer.codebook, ACT_CODES[act],
                                     _launch.current().ints())


def launch_residual(layer: EXL3Linear, x: torch.Tensor, residual: torch.Tensor, ss: torch.Tensor,
                    gate: torch.Tensor | None = None, act: str | None = None) -> torch.Tensor:
    """``residual + layer(x)`` (``layer(act(gate) * x)`` with ``gate``) in one launch, each row's sum of
    squares of the result added into ``ss`` (fp32, zero before) for the next linear's norm; fp16, unpadded
    output equal to the residual's width, no bias; ``act`` in :data:`exl3_core.kernels.codes.ACT_CODES`."""
    rows = x.numel() // x.shape[-1]
    if gate is not None and act not in ACT_CODES:
        raise ValueError(f"{layer.key}: launch_residual with a gate needs act in {sorted(ACT_CODES)}, got {act!r}")
    code = ACT_CODES[act] if gate is not None and act is not None else 0
    g = gate.reshape(rows, -1) if gate is not None else None
    y = ext.op("exl3_linear_residual")(x.reshape(rows, -1), g, code, layer.trellis, layer.suh, layer.svh,
                                       layer.codebook, residual.reshape(rows, -1), ss, _launch.current().ints())
    return y.reshape(residual.shape)


def group_gemm(x2: torch.Tensor, lins: Sequence[EXL3Linear]) -> list[torch.Tensor]:
    """``[x2 @ W_i]`` (padded output widths, no bias) for linears sharing ``x2 [m, k]`` (padded or not): every
    W_i rebuilt into its column block of one ``[k, Σ n_i]`` matrix, then one GEMM. At prefill sizes
    this is one cuBLAS call instead of 2-3 (each costs tens of us of host time, and k/v alone are
    narrow), and the outputs are column views of one result. fp16 operands and output, or bf16 when
    ``x2`` is bf16 (W rebuilt in bf16)."""
    widths = [m.trellis.shape[1] * 16 for m in lins]
    dtype = torch.bfloat16 if x2.dtype == torch.bfloat16 else torch.float16
    w = torch.empty((lins[0].padded_in_features, sum(widths)), dtype=dtype, device=x2.device)
    off = 0
    for m, n in zip(lins, widths, strict=True):
        reconstruct_full_into_cuda(m.trellis, m.suh, m.svh, m.K, m.codebook, w[:, off:off + n])
        off += n
    y = x2.to(dtype) @ w[: x2.shape[-1]]  # an unpadded x skips the rows its zero columns would multiply
    return list(y.split(widths, dim=1))


# -- tensor-parallel cuts ------------------------------------------------------------------------------
def shard_exl3(layer: EXL3Linear, kind: Literal["column", "row"], start: int, stop: int, *,
               keep_bias: bool) -> EXL3Linear:
    """The part of ``layer`` holding output (column) or input (row) features ``start:stop``, cut at 128-feature
    blocks: the Hadamard rotations act within 128-feature blocks, so each block's trellis tiles and scales are
    self-contained, and a row cut's outputs add up to the whole layer's. A row cut keeps the bias only with
    ``keep_bias`` (one rank adds it).

    :raises ValueError: for bounds that are not multiples of 128 or fall outside the layer.
    """
    n = layer.out_features if kind == "column" else layer.in_features
    if start % PAD or (stop % PAD and stop != n) or not 0 <= start < stop <= n:
        raise ValueError(f"{layer.key}: cannot cut {kind} features {start}:{stop} of {n}: EXL3 stores 128-feature "
                         f"blocks, so shard bounds must be multiples of 128 (or the end)")
    a, b = start // 16, padded(stop) // 16
    if kind == "column":
        bias = layer.bias[start:padded(stop)] if layer.bias is not None else None
        out = EXL3Linear(layer.trellis[:, a:b].contiguous(), layer.suh, layer.svh[start:padded(stop)].contiguous(),
                         layer.codebook, layer.in_features, stop - start, bias=bias, key=layer.key)
    else:
        bias = layer.bias if keep_bias else None
        out = EXL3Linear(layer.trellis[a:b].contiguous(), layer.suh[start:padded(stop)].contiguous(), layer.svh,
                         layer.codebook, stop - start, layer.out_features, bias=bias, key=layer.key)
    return out
