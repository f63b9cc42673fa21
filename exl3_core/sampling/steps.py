"""The stock sampling steps. Each is a pure function of the logits and per-row parameters."""
from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from exl3_core.sampling.step import SamplerValueError, SamplingStep, StepContext

NEG_INF = float("-inf")
#: a bias at least this large is +inf in float32
_F32_MAX = float(torch.finfo(torch.float32).max)


def _keep_argmax(logits: torch.Tensor) -> torch.Tensor:
    am = logits.argmax(-1, keepdim=True)
    out = torch.full_like(logits, NEG_INF)
    return out.scatter_(1, am, logits.gather(1, am))


def _keep_sorted_prefix(logits: torch.Tensor, keep_sorted: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Mask the tokens whose entry in ``keep_sorted`` (indexed like the sort ``order``) is False."""
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    return logits.masked_fill(~keep, NEG_INF)


def _counts(ctx: StepContext, window: torch.Tensor) -> torch.Tensor:
    """Occurrences of each token among each row's last ``window`` history tokens: ``[B, V]``."""
    hist = ctx.history
    B = window.shape[0]
    V = ctx.vocab_size
    if hist is None or hist.shape[1] == 0:
        return torch.zeros((B, V), dtype=torch.float32, device=window.device)
    W = hist.shape[1]
    col = torch.arange(W, device=hist.device)[None, :]
    valid = (hist >= 0) & (col >= W - window.to(hist.device).long())
    idx = torch.where(valid, hist, torch.full_like(hist, V))  # invalid entries land in a spill column
    c = torch.zeros((B, V + 1), dtype=torch.float32, device=hist.device)
    c.scatter_add_(1, idx, valid.float())
    return c[:, :V]


class Greedy(SamplingStep):
    """Keep only the most likely token (first on ties)."""

    name: ClassVar[str] = "greedy"

    @classmethod
    def apply(cls, logits: torch.Tensor, params: Any, ctx: StepContext) -> torch.Tensor:
        return _keep_argmax(logits)


class Temperature(SamplingStep):
    """Divide logits by ``temperature``; 0 means greedy (keep only the argmax)."""

    name: ClassVar[str] = "temperature"
    defaults: ClassVar[dict[str, Any]] = {"temperature": 1.0}
    preset: ClassVar[dict[str, Any]] = {"temperature": 1.0}

    def validate(self) -> None:
        self._number("temperature", 0.0)

    @classmethod
    def apply(cls, logits: torch.Tensor, params: Any, ctx: StepContext) -> torch.Tensor:
        t = params["temperature"]
        greedy = t == 0
        scaled = logits / torch.where(greedy, torch.ones_like(t), t)
        return torch.where(greedy, _keep_argmax(logits), scaled)


class TopK(SamplingStep):
    """Keep the ``top_k`` most likely tokens; 0 disables."""

    name: ClassVar[str] = "top_k"
    defaults: ClassVar[dict[str, Any]] = {"top_k": 0}
    preset: ClassVar[dict[str, Any]] = {"top_k": 40}

    def validate(self) -> None:
        self._number("top_k", 0, integer=True)

    @classmethod
    def apply(cls, logits: torch.Tensor, params: Any, ctx: StepContext) -> torch.Tensor:
        k = params["top_k"]
        _, order = logits.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(logits.shape[1], device=logits.device)[None, :]
        keep_sorted = (rank < k) | (k == 0)
        return _keep_sorted_prefix(logits, keep_sorted, order)


class TopP(SamplingStep):
    """Nucleus: keep the smallest most-likely set whose probability mass reaches ``top_p``."""

    name: ClassVar[str] = "top_p"
    defaults: ClassVar[dict[str, Any]] = {"top_p": 1.0}
    preset: ClassVar[dict[str, Any]] = {"top_p": 0.9}

    def validate(self) -> None:
        self._number("top_p", 0.0, 1.0, lo_open=True)

    @classmethod
    def apply(cls, logits: torch.Tensor, params: Any, ctx: StepContext) -> torch.Tensor:
        p = params["top_p"]
        probs = torch.softmax(logits, dim=-1)
        sp, order = probs.sort(dim=-1, descending=True, stable=True)
        before = sp.cumsum(-1) - sp  # mass of strictly more likely tokens
        keep_sorted = (before < p) | (p >= 1)
        keep_sorted[:, 0] = True  # the nucleus holds the top token, even for a top_p that is 0 in float32
        return _keep_sorted_prefix(logits, keep_sorted, order)


class MinP(SamplingStep):
    """Keep tokens with probability at least ``min_p`` times the top token's."""

    name: ClassVar[str] = "min_p"
    defaults: ClassVar[dict[str, Any]] = {"min_p": 0.0}
    preset: ClassVar[dict[str, Any]] = {"min_p": 0.05}

    def validate(self) -> None:
        self._number("min_p", 0.0, 1.0)

    @classmethod
    def apply(cls, logits: torch.Tensor, params: Any, ctx: StepContext) -> torch.Tensor:
        probs = torch.softmax(logits, dim=-1)
        thresh = probs.amax(-1, keepdim=True) * params["min_p"]
        return logits.masked_fill(probs < thresh, NEG_INF)


class Typical(SamplingStep):
    """Locally typical sampling (Meister et al. 2022): keep tokens whose surprisal is closest
    to the entropy until their mass reaches ``typical``; 1 disables."""

    name: ClassVar[str] = "typical"
    defaults: ClassVar[dict[str, Any]] = {"typical": 1.0}
    preset: ClassVar[dict[str, Any]] = {"typical": 0.95}

    def validate(self) -> None:
        self._number("typical", 0.0, 1.0, lo_open=True)

    @classmethod
    def apply(cls, logits: torch.Tensor, params: Any, ctx: StepContext) -> torch.Tensor:
        tau = params["typical"]
        logp = torch.log_softmax(logits, dim=-1)
        p = logp.exp()
        ent = -(torch.where(p > 0, p * logp, torch.zeros_like(p))).sum(-1, keepdim=True)
        score = torch.where(p > 0, (-logp - ent).abs(), torch.full_like(p, float("inf")))
        _, order = score.sort(dim=-1, stable=True)
        sp = p.gather(1, order)
        before = sp.cumsum(-1) - sp
        keep_sorted = (before < tau) | (tau >= 1)
        keep_sorted[:, 0] = True  # the most typical token stays, even for a tau that is 0 in float32
        return _keep_sorted_prefix(logits, keep_sorted, order)


class RepetitionPenalty(SamplingStep):
    """CTRL-style: for tokens seen in the last ``window`` tokens, divide positive logits by
    ``penalty`` and multiply negative ones by it."""

    name: ClassVar[str] = "repetition_penalty"
    defaults: ClassVar[dict[str, Any]] = {"penalty": 1.0, "window": 1024}
    preset: ClassVar[dict[str, Any]] = {"penalty": 1.1, "window": 1024}
    history_param: ClassVar[str | None] = "window"

    def validate(self) -> None:
        self._number("penalty", 0.0, lo_open=True)
        self._number("window", 0, integer=True)

    @classmethod
    def apply(cls, logits: torch.Tensor, params: Any, ctx: StepContext) -> torch.Tensor:
        seen = _counts(ctx, params["window"]) > 0
        pen = params["penalty"]
        penalised = torch.where(logits > 0, logits / pen, logits * pen)
        return torch.where(seen, penalised, logits)


class FrequencyPenalty(SamplingStep):
    """Subtract ``penalty`` times the token's count in the last ``window`` tokens."""

    name: ClassVar[str] = "frequency_penalty"
    defaults: ClassVar[dict[str, Any]] = {"penalty": 0.0, "window": 1024}
    preset: ClassVar[dict[str, Any]] = {"penalty": 0.1, "window": 1024}
    history_param: ClassVar[str | None] = "window"

    def validate(self) -> None:
        self._number("penalty")
        self._number("window", 0, integer=True)

    @classmethod
    def apply(cls, logits: torch.Tensor, params: Any, ctx: StepContext) -> torch.Tensor:
        return logits - params["penalty"] * _counts(ctx, params["window"])


class PresencePenalty(SamplingStep):
    """Subtract ``penalty`` from every token present in the last ``window`` tokens."""

    name: ClassVar[str] = "presence_penalty"
    defaults: ClassVar[dict[str, Any]] = {"penalty": 0.0, "window": 1024}
    preset: ClassVar[dict[str, Any]] = {"penalty": 0.1, "window": 1024}
    history_param: ClassVar[str | None] = "window"

    def validate(self) -> None:
        self._number("penalty")
        self._number("window", 0, integer=True)

    @classmethod
    def apply(cls, logits: torch.Tensor, params: Any, ctx: StepContext) -> torch.Tensor:
        return logits - params["penalty"] * (_counts(ctx, params["window"]) > 0).float()


def _sparse_rows(entries: list[list[tuple[int, float]]], device: torch.device) -> tuple[torch.Tensor, ...]:
    rows = [r for r, e in enumerate(entries) for _ in e]
    cols = [t for e in entries for t, _ in e]
    vals = [v for e in entries for _, v in e]
    return (torch.tensor(rows, dtype=torch.int64, device=device), torch.tensor(cols, dtype=torch.int64, device=device),
            torch.tensor(vals, dtype=torch.float32, device=device))


def _check_token_ids(step: SamplingStep, ids: list[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise SamplerValueError(f"sampler step {step.name!r}: token id(s) {bad[:8]} outside the vocabulary "
                                f"[0, {vocab_size})")


class LogitBias(SamplingStep):
    """Add ``bias[token]`` to each listed token's logit. ``+inf`` forces the token: only the tokens
    biased by ``+inf`` stay possible (equally likely), unless an earlier step banned them; ``-inf``
    bans it."""

    name: ClassVar[str] = "logit_bias"
    defaults: ClassVar[dict[str, Any]] = {"bias": {}}

    def validate(self) -> None:
        b = self.params["bias"]
        if not isinstance(b, dict):
            raise self._err("bias", "it must be a dict {token_id: bias}")
        for t, v in b.items():
            if isinstance(t, bool) or not isinstance(t, int) or not isinstance(v, (int, float)) or math.isnan(v):
                raise SamplerValueError(f"sampler step 'logit_bias': entry {t!r}: {v!r} must map an int token id "
                                        f"to a number")
        self.params["bias"] = dict(b)

    def check_vocab(self, vocab_size: int) -> None:
        _check_token_ids(self, list(self.params["bias"]), vocab_size)

    @classmethod
    def batch_params(cls, steps: list[SamplingStep], device: torch.device) -> Any:
        entries = [[(int(t), float(v)) for t, v in s.params["bias"].items()] for s in steps]
        # decided on the host, so the common finite case costs no extra device work or sync
        forcing = any(v >= _F32_MAX for e in entries for _, v in e)
        return (*_sparse_rows(entries, device), forcing)

    @classmethod
    def apply(cls, logits: torch.Tensor, params: Any, ctx: StepContext) -> torch.Tensor:
        rows, cols, vals, forcing = params
        out = logits.index_put((rows, cols), vals, accumulate=True)
        if not forcing:
            return out
        # a float32 +inf added to a logit: keep only the forced tokens, an earlier ban (-inf) winning
        force = torch.zeros_like(out, dtype=torch.bool).index_put((rows, cols), torch.isposinf(vals))
        force &= ~torch.isneginf(logits)
        out = out.masked_fill(torch.isnan(out), NEG_INF)  # -inf + inf: the ban stands
        return torch.where(force.any(-1, keepdim=True), torch.where(force, 0.0, NEG_INF), out)


class TokenBan(SamplingStep):
    """Never sample the listed token ids."""

    name: ClassVar[str] = "token_ban"
    defaults: ClassVar[dict[str, Any]] = {"tokens": ()}

    def validate(self) -> None:
        toks = self.params["tokens"]
        try:
            ids = [int(t) for t in toks]
        except (TypeError, ValueError):
            raise self._err("tokens", "it must be a list of int token ids") from None
        self.params["tokens"] = tuple(ids)

    def check_vocab(self, vocab_size: int) -> None:
        _check_token_ids(self, list(self.params["tokens"]), vocab_size)

    @classmethod
    def batch_params(cls, steps: list[SamplingStep], device: torch.device) -> Any:
        return _sparse_rows([[(t, 0.0) for t in s.params["tokens"]] for s in steps], device)[:2]

    @classmethod
    def apply(cls, logits: torch.Tensor, params: Any, ctx: StepContext) -> torch.Tensor:
        rows, cols = params
        return logits.index_put((rows, cols), torch.tensor(NEG_INF, device=logits.device))


STEPS: tuple[type[SamplingStep], ...] = (Greedy, Temperature, TopK, TopP, MinP, Typical, RepetitionPenalty,
                                         FrequencyPenalty, PresencePenalty, LogitBias, TokenBan)
