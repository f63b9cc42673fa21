"""Perplexity over fixed, non-overlapping windows.

Every window of ``ctx`` tokens is run alone (no cache, no overlap); position t predicts token
t+1, so a window contributes ``ctx - 1`` predictions. Perplexity is ``exp`` of the mean negative
log-likelihood over all predictions of all windows.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

#: anything mapping ``input_ids [B, S]`` to logits ``[B, S, vocab]`` (an exl3 Model, a wrapped HF model)
LogitsFn = Callable[[torch.Tensor], torch.Tensor]
#: ``progress(done, total, what)``, e.g. an :class:`exl3_core.progress.Progress`
ProgressFn = Callable[[int, int, str], None]


@dataclass(frozen=True)
class PPLResult:
    ppl: float
    nll: float  # mean negative log-likelihood (nats per token)
    tokens: int  # number of predictions
    windows: int


def make_windows(ids: torch.Tensor, ctx: int, rows: int | None = None) -> torch.Tensor:
    """Non-overlapping ``[n, ctx]`` windows of a 1-D id sequence (the tail that does not fill one is dropped)."""
    if ctx < 2:
        raise ValueError(f"--ctx {ctx}: a window needs at least 2 tokens")
    ids = ids.reshape(-1).to(torch.int64)
    n = ids.numel() // ctx
    if rows is not None:
        n = min(n, rows)
    if n == 0:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than one window of {ctx}; use a longer text or "
                         f"a smaller --ctx")
    return ids[: n * ctx].view(n, ctx)


def batched_logits(model: LogitsFn, windows: torch.Tensor, batch: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(windows chunk, fp32 logits chunk)`` over ``windows`` in batches, on the CPU."""
    device = getattr(model, "device", None)
    for i in range(0, windows.shape[0], batch):
        w = windows[i: i + batch]
        with torch.no_grad():
            logits = model(w.to(device) if isinstance(device, torch.device) else w)
        yield w, logits.float().cpu()


def nll_sum(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    """Sum of ``-log p(ids[:, t+1] | ids[:, :t+1])`` over a batch, and the number of predictions."""
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    tgt = ids[:, 1:].unsqueeze(-1)
    return float(-logp.gather(-1, tgt).sum()), int(tgt.numel())


def perplexity(model: LogitsFn, ids: torch.Tensor, ctx: int = 512, rows: int | None = None,
               batch: int = 1, progress: ProgressFn | None = None) -> PPLResult:
    """Perplexity of ``model`` on the 1-D token ids ``ids``, windows of ``ctx`` (at most ``rows`` of them).

    :param progress: called as ``progress(windows_done, windows, "windows")`` after each batch."""
    windows = make_windows(ids, ctx, rows)
    total, count = 0.0, 0
    for w, logits in batched_logits(model, windows, batch):
        s, n = nll_sum(logits, w)
        total += s
        count += n
        if progress is not None:
            progress(count // (ctx - 1), windows.shape[0], "windows")
    nll = total / count
    return PPLResult(ppl=math.exp(nll), nll=nll, tokens=count, windows=windows.shape[0])
