"""Rotary position embedding for every normalised RoPE type.

Frequencies (``inv_freq``) follow the published formulas:

* ``default``: ``theta ** (-2i/d)`` for ``i < d/2`` (d = rotary dim).
* ``linear`` (position interpolation): ``inv_freq / factor``.
* ``dynamic`` (NTK-aware): the base grows with the length L = p + 1 a token at position p ends
  (never below ``max_position_embeddings``):
  ``theta * (factor * L / max_pos - (factor - 1)) ** (d / (d - 2))``, per token, so a token is
  rotated the same however it is batched, chunked, reused from the prefix cache or verified as a
  drafted token. This is what transformers computes when it generates token by token; its forward
  over a whole prompt longer than ``max_pos`` instead rotates every position with the prompt's
  length, which would make a token depend on the tokens after it and on other sequences in a batch.
  The tables are computed on the device from the positions tensor (no host sync).
* ``yarn``: blend of interpolated (``/factor``) and extrapolated frequencies through a linear ramp
  between the dims that make ``beta_fast`` and ``beta_slow`` rotations over the original context;
  ``truncate`` floors/ceils the ramp bounds; cos/sin are scaled by the attention factor
  (``0.1 * mscale * ln(factor) + 1``, or a ratio of two such terms with ``mscale_all_dim``).
* ``llama3``: wavelengths longer than ``orig / low_freq_factor`` are divided by ``factor``,
  shorter than ``orig / high_freq_factor`` kept, and the band between interpolated smoothly.

Layouts: only the first ``rotary_dim`` channels of each head rotate (partial rotary), either as
adjacent pairs ``(2i, 2i+1)`` ("interleaved", GPT-J style) or as halves ``(i, i + r/2)``
("neox"/half-split, the usual HF layout).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from exl3_core import ops
from exl3_core.nn.module import LoadContext, Module

if TYPE_CHECKING:  # archkit imports nn; at runtime only the settings' attributes are read
    from exl3_core.archkit.config import RopeSettings


def _base_inv_freq(theta: float | torch.Tensor, dim: int, device: torch.device | None = None) -> torch.Tensor:
    exps = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (theta ** exps)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(s: RopeSettings) -> float:
    if s.attention_factor is not None:
        return s.attention_factor
    if s.mscale and s.mscale_all_dim:
        return _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    return _yarn_mscale(s.factor)


def _original_max(s: RopeSettings, what: str) -> int:
    n = s.original_max_position_embeddings or s.max_position_embeddings
    if not n:
        raise ValueError(f"RoPE type {what!r} needs original_max_position_embeddings (or max_position_embeddings) "
                         f"in config.json's rope_scaling/rope_parameters")
    return int(n)


def compute_inv_freq(s: RopeSettings, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """Static ``(inv_freq [rotary_dim/2] fp32, attention_factor)`` for ``s`` (dynamic: at max_pos)."""
    d = rotary_dim
    inv = _base_inv_freq(s.theta, d)
    if s.type in ("default", "dynamic"):
        return inv, 1.0
    if s.type == "linear":
        return inv / s.factor, 1.0
    if s.type == "llama3":
        orig = _original_max(s, "llama3")
        low_wl, high_wl = orig / s.low_freq_factor, orig / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / s.factor, inv)
        smooth = (orig / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(medium, smoothed, scaled), 1.0
    if s.type == "yarn":
        orig = _original_max(s, "yarn")

        def corr_dim(rotations: float) -> float:
            # the dim index whose wavelength fits `rotations` times into the original context
            return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(s.theta))

        low, high = corr_dim(s.beta_fast), corr_dim(s.beta_slow)
        if s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp  # 1 for high-frequency dims: keep them as they are
        return (inv / s.factor) * (1 - extrapolate) + inv * extrapolate, yarn_attention_factor(s)
    raise NotImplementedError(f"RoPE type {s.type!r} is not implemented (rope_scaling.rope_type in config.json); "
                              f"supported: default, linear, dynamic, yarn, llama3")


class RotaryEmbedding(Module):
    """cos/sin tables from a positions tensor, and their application to q and k.

    :param settings: normalised RoPE settings (``exl3_core.archkit.config.normalise_rope``).
    :param head_dim: full head size; ``settings.rotary_dim(head_dim)`` channels rotate.
    """

    inv_freq: torch.Tensor
    static_buffers = ("inv_freq",)

    def __init__(self, settings: RopeSettings, head_dim: int) -> None:
        super().__init__()
        self.settings = settings
        self.head_dim = head_dim
        self.rotary_dim = settings.rotary_dim(head_dim)
        self.interleaved = settings.interleaved
        if self.rotary_dim <= 0 or self.rotary_dim > head_dim:
            raise ValueError(f"partial_rotary_factor={settings.partial_rotary_factor} gives rotary dim "
                             f"{self.rotary_dim} for head_dim {head_dim}; it must be in (0, 1]")
        inv_freq, self.attention_factor = compute_inv_freq(settings, self.rotary_dim)
        self._inv_freq_cpu = inv_freq
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.dynamic = settings.type == "dynamic" and settings.factor != 1.0
        if self.dynamic and not settings.max_position_embeddings:
            raise ValueError("dynamic RoPE needs max_position_embeddings in config.json")

    def load_weights(self, ctx: LoadContext) -> None:
        # no checkpoint tensors: just place the table where the positions will be
        self.inv_freq = self._inv_freq_cpu.to(ctx.device)

    def unload_weights(self) -> None:
        self.inv_freq = self._inv_freq_cpu

    def _dynamic_inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        """Dynamic NTK: fp32 ``inv_freq [T, rotary_dim/2]``, each token's for the length its position ends."""
        s = self.settings
        max_pos = float(s.max_position_embeddings)  # type: ignore[arg-type]
        length = (positions.to(torch.float64) + 1).clamp_min(max_pos)
        d = self.rotary_dim
        theta = s.theta * (s.factor * length / max_pos - (s.factor - 1)) ** (d / (d - 2))
        return _base_inv_freq(theta[:, None], d, positions.device).float()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(cos, sin)`` of shape ``[T, rotary_dim/2]`` for int positions ``[T]``."""
        if self.dynamic:  # per-token tables computed on the device: torch ops
            f = positions.float()[:, None] * self._dynamic_inv_freq(positions)
            return f.cos() * self.attention_factor, f.sin() * self.attention_factor
        return ops.rope_tables(positions, self.inv_freq, self.attention_factor)  # CUDA: one launch instead of 4-6

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, H, D]`` by the per-token tables from :meth:`cos_sin`."""
        return apply_rotary(x, cos, sin, self.rotary_dim, self.interleaved)

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k; on CUDA in place, both in one kernel (the caller must own q and k)."""
        if ops.fused_enabled(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
            ops.rope_apply(q, k, cos, sin, self.rotary_dim, self.interleaved)
            return q, k
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)

    def extra_repr(self) -> str:
        return f"type={self.settings.type}, rotary_dim={self.rotary_dim}/{self.head_dim}, " \
               f"interleaved={self.interleaved}, attention_factor={self.attention_factor:.4g}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                 interleaved: bool) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` channels of ``x [T, H, D]``; cos/sin are ``[T, rotary_dim/2]``.

    The rotation is done in fp32 and cast back, so bf16/fp16 activations lose nothing extra.
    """
    c, s = cos[:, None, :], sin[:, None, :]
    xr = x[..., :rotary_dim].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        half = rotary_dim // 2
        x1, x2 = xr[..., :half], xr[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    out = out.to(x.dtype)
    if rotary_dim < x.shape[-1]:
        out = torch.cat((out, x[..., rotary_dim:]), dim=-1)
    return out
