"""Where a speculative step's host time goes: one `exl3 bench --draft` configuration under cProfile (GPU).

The bench (exl3_core.bench.spec) reports host time per speculative step as the wall time less the measured
device time of the verification and the k draft forwards. This runs one alpha and one k of it (the same
self-predicting target, oracle draft and prompts) under cProfile and prints the functions that hold the
host, by own time and by cumulative time, with the step count so that per-step figures can be read off.

    python bench/spec_profile.py [--shape 8b] [--draft 1b] [--alpha 0.9] [--k 3] [--batch 1] [--out DIR]
    (``--device cpu --shape 'custom(64,128,2,4,2,256)'``: a smoke run of the script itself)
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from exl3_core.bench.models import build_model, parse_shape
from exl3_core.bench.spec import OracleDrafter, _decode_tokens
from exl3_core.generator import Generator
from exl3_core.generator.draft_policy import DraftLength
from exl3_core.generator.speculative import SpecStats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--draft", default="1b")
    ap.add_argument("--alpha", type=float, default=0.9)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=None, help="also write the .prof file here")
    a = ap.parse_args()
    dev = torch.device(a.device)
    shape, dshape = parse_shape(a.shape), parse_shape(a.draft)
    tokens = 2 * 16 * 64 * a.batch * 4
    target, cache = build_model(shape, codebook="mul1", device=dev, cache_tokens=tokens,
                                self_predicting=True)
    draft, dcache = build_model(dshape, codebook="mul1", device=dev, cache_tokens=tokens, seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, shape.vocab, (a.ctx,), generator=g).tolist() for _ in range(a.batch)]
    max_seq = a.ctx + a.new_tokens + a.k + 8
    plain = Generator(target, cache, None, max_batch_size=a.batch, max_seq_len=max_seq)
    plain.capture_graphs()
    base, ref = _decode_tokens(plain, prompts, a.new_tokens)
    gen = Generator(target, cache, None, max_batch_size=a.batch, max_seq_len=max_seq, draft_model=draft,
                    draft_cache=dcache, num_draft_tokens=a.k, dynamic_draft=False)
    assert gen.spec is not None
    oracle = OracleDrafter(draft, dcache, max_seq_len=gen.max_seq_len, alpha=a.alpha, reference=ref,
                           vocab=shape.vocab, seed=7)
    gen.spec.drafter = oracle
    gen.capture_graphs()
    _decode_tokens(gen, [p[:64] for p in prompts], 4)
    gen.spec.length = DraftLength(a.k, dynamic=False)
    gen.spec.stats = SpecStats()
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    tok_s, _ = _decode_tokens(gen, prompts, a.new_tokens)
    pr.disable()
    wall = time.perf_counter() - t0
    st = gen.spec.stats
    print(f"plain {base:.1f} tok/s; speculative {tok_s:.1f} tok/s (x{tok_s / base:.2f}), alpha {a.alpha} k={a.k} "
          f"b={a.batch}: {st.steps} speculative steps, {st.plain_steps} plain, acceptance "
          f"{st.accepted / max(st.drafted, 1):.2f}, {wall / max(st.steps, 1) * 1e3:.2f} ms wall per step (profiled)")
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(40)
        print(s.getvalue())
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        pr.dump_stats(str(a.out / "spec_profile.prof"))


if __name__ == "__main__":
    main()
