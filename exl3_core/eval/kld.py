"""KL divergence of a model's next-token distributions from a reference model's, on the same ids."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from exl3_core.eval.ppl import LogitsFn, ProgressFn, batched_logits, make_windows


@dataclass(frozen=True)
class KLDResult:
    kld: float  # mean over tokens of KL(ref ‖ model), nats
    top1: float  # fraction of positions where both models' most likely token agrees
    tokens: int


def kl_per_token(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``KL(softmax(ref) ‖ softmax(logits))`` per position, fp64."""
    lp = torch.log_softmax(ref_logits.double(), dim=-1)
    lq = torch.log_softmax(logits.double(), dim=-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def kl_divergence(model: LogitsFn, ref: LogitsFn, ids: torch.Tensor, ctx: int = 512, rows: int | None = None,
                  batch: int = 1, progress: ProgressFn | None = None) -> KLDResult:
    """Mean ``KL(ref ‖ model)`` per token and top-1 agreement over windows of ``ids`` (1-D, or ``[n, S]`` rows).

    :param progress: called as ``progress(windows_done, windows, "windows")`` after each batch."""
    windows = ids.to(torch.int64) if ids.dim() == 2 else make_windows(ids, ctx, rows)
    total, agree, count = 0.0, 0, 0
    for (w, out), (_, ref_out) in zip(batched_logits(model, windows, batch), batched_logits(ref, windows, batch),
                                      strict=True):
        if out.shape != ref_out.shape:
            raise ValueError(f"the model's logits {list(out.shape)} and the reference's {list(ref_out.shape)} differ "
                             f"in shape; the two models must share a vocabulary")
        total += float(kl_per_token(ref_out, out).sum())
        agree += int((ref_out.argmax(-1) == out.argmax(-1)).sum())
        count += out.shape[0] * out.shape[1]
        if progress is not None:
            progress(count // windows.shape[1], windows.shape[0], "windows")
    return KLDResult(kld=total / count, top1=agree / count, tokens=count)
