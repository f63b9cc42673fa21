"""Model quality evaluation: perplexity, KL divergence against a reference, and bpw plots."""
from __future__ import annotations

from typing import TYPE_CHECKING

from exl3_core.lazy import lazy_attributes, refs_of

if TYPE_CHECKING:
    from exl3_core.eval.kld import KLDResult, kl_divergence
    from exl3_core.eval.ppl import PPLResult, make_windows, perplexity

__getattr__ = lazy_attributes(__name__, {**refs_of("exl3_core.eval.kld", "KLDResult", "kl_divergence"),
                                         **refs_of("exl3_core.eval.ppl", "PPLResult", "make_windows", "perplexity")})

__all__ = ["KLDResult", "PPLResult", "kl_divergence", "make_windows", "perplexity"]
