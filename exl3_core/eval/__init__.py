"""Model quality evaluation: perplexity, KL divergence against a reference, and bpw plots."""
from __future__ import annotations

from exl3_core.eval.kld import KLDResult, kl_divergence
from exl3_core.eval.ppl import PPLResult, make_windows, perplexity

__all__ = ["KLDResult", "PPLResult", "kl_divergence", "make_windows", "perplexity"]
