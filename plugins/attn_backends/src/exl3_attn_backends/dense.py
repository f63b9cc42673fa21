"""Dense causal attention of fresh sequences through torch's fused SDPA kernels.

A sequence with no earlier tokens attends to its own new rows only, so it needs no page table: the
attention module hands it to the backends without the cache (``AttnSpec.cache`` None), and

* on CUDA, for one sequence, torch's scaled-dot-product attention (FlashAttention/cuDNN kernels on
  Hopper) outruns the Triton kernel on long causal prefill (``torch_sdpa``);
* on the CPU, for batches of sequences (the converter's calibration rows, a batched ``model(ids)``),
  SDPA's fused kernel over the rows at once replaces the reference's loop over sequences
  (``torch_sdpa_rows``); a single fresh prompt stays with the reference, whose result for it equals
  the cached path's bit for bit.

The dispatcher picks these backends for exactly those specs.
"""
from __future__ import annotations

import itertools
from typing import ClassVar

import torch
import torch.nn.functional as F

from exl3_core.attention.spec import AttnArgs, AttnSpec

_DTYPES = (torch.float16, torch.bfloat16)


def fresh_single_sequence(args: AttnArgs) -> bool:
    """True when ``args`` is one causal sequence of 16-bit q/k/v whose keys are only its new rows.

    ``seq_lens_k[0]`` counts the new rows and any prefix and ``max_seqlen_k`` bounds it from above,
    so ``max_seqlen_k == len(q)`` leaves no room for a prefix.
    """
    s = args.spec
    return (args.k is not None and args.v is not None and s.phase == "prefill"
            and s.dtype in _DTYPES and args.q.dtype == s.dtype
            and s.causal and not s.window and not s.softcap and not s.has_sinks and not s.non_causal_spans
            and s.v_dim == s.head_dim and args.cu_seqlens_q.shape[0] == 2
            and args.max_seqlen_k == args.q.shape[0] == args.k.shape[0])


def dense_causal(args: AttnArgs) -> torch.Tensor:
    """Causal attention of one fresh sequence: ``[T, Hq, D]`` out of ``[T, H, D]`` q, k, v."""
    s = args.spec
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (args.q, args.k, args.v))  # [1, H, T, D] views
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=args.scale,
                                       enable_gqa=s.num_q_heads != s.num_kv_heads)
    return o.squeeze(0).transpose(0, 1).contiguous()


def _plain_causal_reasons(spec: AttnSpec) -> list[str]:
    """Why SDPA's plain causal mask cannot serve ``spec`` (both backends here)."""
    r = []
    if not spec.causal or spec.window or spec.softcap or spec.has_sinks or spec.non_causal_spans:
        r.append("plain causal masks only (no window, softcap, sinks or non-causal spans)")
    if spec.v_dim != spec.head_dim:
        r.append(f"values as wide as keys only (got {spec.head_dim}/{spec.v_dim})")
    return r


class DenseCausalAttention:
    """One fresh sequence's causal prefill (no cache, 16-bit, CUDA) through torch's SDPA."""

    name: ClassVar[str] = "torch_sdpa"
    #: torch's SDPA launches on the current stream and reads nothing back to the host
    graph_safe: ClassVar[bool] = True

    def priority(self, spec: AttnSpec) -> int:
        # above the Triton backend, for the specs it accepts
        return 105

    def unsupported_reasons(self, spec: AttnSpec) -> list[str]:
        r = []
        if spec.device_type != "cuda":
            r.append(f"needs a CUDA device (got {spec.device_type}); on the CPU torch_sdpa_rows takes batches")
        if spec.phase != "prefill" or spec.cache is not None:
            r.append("one fresh sequence's prefill only (no cache: the keys are the new rows)")
        if spec.num_seqs != 1:
            r.append(f"one sequence per call (got up to {spec.num_seqs or 'unknown'})")
        if spec.dtype not in _DTYPES:
            r.append(f"fp16 or bf16 only (got {spec.dtype})")
        return r + _plain_causal_reasons(spec)

    def forward(self, args: AttnArgs) -> torch.Tensor:
        if args.k is None or args.v is None:
            raise ValueError("torch_sdpa: a fresh sequence's call carries its keys and values (args.k, args.v)")
        return dense_causal(args)


def dense_rows(args: AttnArgs) -> torch.Tensor:
    """Causal attention of each fresh sequence of ``args`` over its own rows, in fp32 (as the reference);
    sequences of one length run as one batch."""
    s = args.spec
    cu = args.cu_seqlens_q.tolist()  # a CPU tensor: no device sync
    lens = [b - a for a, b in itertools.pairwise(cu)]
    gqa = s.num_q_heads != s.num_kv_heads
    out = torch.empty((args.q.shape[0], s.num_q_heads, s.v_dim), dtype=args.q.dtype, device=args.q.device)

    def run(rows: slice, n: int, length: int) -> None:
        q, k, v = (t[rows].float().reshape(n, length, -1, t.shape[-1]).transpose(1, 2) for t in (args.q, args.k, args.v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=args.scale, enable_gqa=gqa)
        out[rows] = o.transpose(1, 2).reshape(n * length, s.num_q_heads, s.v_dim).to(out.dtype)

    if lens and min(lens) == max(lens) > 0:
        run(slice(cu[0], cu[-1]), len(lens), lens[0])
    else:
        for a, n in zip(cu, lens):
            if n:
                run(slice(a, a + n), 1, n)
    return out


class DenseRowsAttention:
    """Fresh sequences' causal prefill (no cache) on the CPU through torch's SDPA, all rows of one length at once."""

    name: ClassVar[str] = "torch_sdpa_rows"
    graph_safe: ClassVar[bool] = False  # a CPU backend: it reads the sequence bounds on the host

    def priority(self, spec: AttnSpec) -> int:
        return 105  # above the reference, for the specs it accepts

    def unsupported_reasons(self, spec: AttnSpec) -> list[str]:
        r = [] if spec.device_type == "cpu" else [f"the CPU only (got {spec.device_type}; CUDA has torch_sdpa)"]
        if spec.phase != "prefill" or spec.cache is not None:
            r.append("fresh sequences' prefill only (no cache: the keys are the new rows)")
        if spec.num_seqs < 2:  # a generator's fresh prompt: the reference matches its cached rows bit for bit
            r.append(f"batches of sequences only (got up to {spec.num_seqs or 'unknown'}; one goes to the reference)")
        if spec.num_q_heads % spec.num_kv_heads:
            r.append(f"num_q_heads={spec.num_q_heads} is not a multiple of num_kv_heads={spec.num_kv_heads}")
        return r + _plain_causal_reasons(spec)

    def forward(self, args: AttnArgs) -> torch.Tensor:
        if args.k is None or args.v is None:
            raise ValueError("torch_sdpa_rows: fresh sequences' calls carry their keys and values (args.k, args.v)")
        return dense_rows(args)
