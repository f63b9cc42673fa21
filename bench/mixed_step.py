"""Device script: wall time of the generator step in which a new prompt joins decoding jobs.

Random-weight EXL3 model (``--shape``, 4.0 bpw, MUL1), ``--decoding`` jobs decoding after 256-token
prompts; then a ``--prompt``-token prompt is enqueued and the next ``iterate()`` (the mixed step) is
timed on the host with a device sync. Graphed: the step runs as a decode replay plus a prefill replay
(:meth:`Generator._graph_parts`); eager: one mixed forward. Median of ``--reps`` mixed steps.

    python bench/mixed_step.py [--shape 8b] [--decoding 1] [--prompt 128] [--reps 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from exl3_core.bench.models import build_model, parse_shape
from exl3_core.generator import Generator, Job


def mixed_step_ms(gen: Generator, decoding: int, prompt: int, vocab: int, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    for _ in range(decoding):
        gen.enqueue(Job(torch.randint(0, vocab, (256,), generator=g).tolist(), max_new_tokens=64, stop_at_eos=False))
    for _ in range(4):  # prefill, then decode steps
        gen.iterate()
    gen.enqueue(Job(torch.randint(0, vocab, (prompt,), generator=g).tolist(), max_new_tokens=2, stop_at_eos=False))
    torch.cuda.synchronize()
    t = time.perf_counter()
    gen.iterate()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) * 1e3
    while gen.num_remaining():
        gen.iterate()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--decoding", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    model, cache = build_model(parse_shape(args.shape), bpw=4.0, head_bits=6, codebook="mul1", device="cuda",
                               cache_tokens=8192)
    vocab = model.config.hf.vocab_size
    for graphed in (True, False):
        gen = Generator(model, cache, None, max_batch_size=8, max_seq_len=1024, overlap_decode=False)
        if not graphed:
            gen.graphs = gen.prefill_graphs = None
        mixed_step_ms(gen, args.decoding, args.prompt, vocab, 99)  # warm-up: capture, compile
        times = [mixed_step_ms(gen, args.decoding, args.prompt, vocab, r) for r in range(args.reps)]
        print(f"{args.shape}: {args.decoding} decoding + {args.prompt}-token prompt, mixed step "
              f"{'graphed (decode + prefill replay)' if graphed else 'eager (one forward)'}: "
              f"median {statistics.median(times):.2f} ms (min {min(times):.2f})")
        cache.allocator.clear_prefix_cache()
    model.unload()


if __name__ == "__main__":
    main()
