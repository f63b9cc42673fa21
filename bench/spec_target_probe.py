"""Does the speculative bench's self-predicting target step slower than the plain bench model of its shape?

The speculative bench measured its 8B target (``self_predicting=True``: damped residual writers, an embedding
copied from the head) at 2.5x the plain bench model's step time, on one H100 call. Both build the same modules
from the same source class; only weight values differ. This builds both, alternately, and times one decode
step at 1, 2 and 9 rows per sequence exactly as ``exl3 bench --draft`` does (``exl3_core.bench.spec.step_time``).

    python bench/spec_target_probe.py [SHAPE]      # default 8b
"""
from __future__ import annotations

import sys

import torch

from exl3_core.bench.models import build_model, parse_shape
from exl3_core.bench.spec import step_time

shape = parse_shape(sys.argv[1] if len(sys.argv) > 1 else "8b")
dev = "cuda" if torch.cuda.is_available() else "cpu"
for self_predicting in (True, False, False, True):
    model, cache = build_model(shape, bpw=4.0, head_bits=6, codebook="mul1", device=dev, cache_tokens=4096,
                               self_predicting=self_predicting)
    times = [step_time(model, cache, batch=1, ctx=256, rows=r) for r in (1, 2, 9)]
    print(f"self_predicting={self_predicting}: step at 1 / 2 / 9 rows " + " / ".join(f"{t * 1e3:.3f}" for t in times)
          + " ms", flush=True)
    model.unload()
    del model, cache
