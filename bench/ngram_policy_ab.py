"""Two dynamic draft-length policies, alternated on one n-gram generator: the product's
``exl3_core.generator.draft_policy.DraftLength`` against another version of that module (a candidate's copy).

The default model rewrites the n-gram bench's paragraph (``exl3_core.bench.spec.PARAGRAPH``); each batch size gets
one plain generator and one n-gram generator (graphs captured once), and the policies take turns on the n-gram
generator (ABAB..., a fresh policy per run) so that both see the same machine state. The runs decode the answer
alone (up to its end-of-turn token, as the plain run writes it), then, with ``--tokens N``, N tokens. Printed per
batch and span: the plain rate, each policy's median rate and speedup, its drafts, speculative and plain steps.

    python bench/ngram_policy_ab.py --candidate /tmp/cand/exl3_core/generator/draft_policy.py [--batches 1,16]
        [--rounds 3] [--k 4] [--tokens 128] [--device cuda] [--product exl3_core/generator/draft_policy.py]
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from exl3_core import Cache, Config, Generator, Model, Tokenizer
from exl3_core.bench.spec import _decode_tokens, answer_length, rewrite_prompt
from exl3_core.convert.default_model import default_model_dir
from exl3_core.generator.draft_policy import DraftLength
from exl3_core.generator.speculative import SpecStats


def load_policy(path: Path, name: str) -> type[DraftLength]:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python module")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while being built
    spec.loader.exec_module(mod)
    return mod.DraftLength


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--candidate", type=Path, required=True, help="a draft_policy.py to compare with the product's")
    ap.add_argument("--product", type=Path, default=None,
                    help="the product's draft_policy.py (default: the one this interpreter imports)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each policy per batch size and span")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=0, help="also decode this many tokens (past the answer)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    policies: dict[str, type[DraftLength]] = {
        "product": DraftLength if a.product is None else load_policy(a.product, "product_draft_policy"),
        "candidate": load_policy(a.candidate, "candidate_draft_policy")}
    dev = torch.device(a.device)
    d = default_model_dir(progress=False)
    cfg = Config.from_directory(d)
    model = Model.from_config(cfg)
    batches = [int(b) for b in a.batches.split(",")]
    cache = Cache(model, max_num_tokens=max(batches) * 1024)
    model.load(device=dev, dtype=torch.float16 if dev.type == "cuda" else torch.float32, caches=[cache])
    tok = Tokenizer.from_config(cfg)
    prompt = rewrite_prompt(tok)
    for b in batches:
        plain = Generator(model, cache, tok, max_batch_size=b)
        _decode_tokens(plain, [prompt] * b, 8)
        plain.capture_graphs()
        _, ref = _decode_tokens(plain, [prompt] * b, max(a.tokens, 160))
        answer = answer_length(ref[0], tok)
        spans = ([answer] if answer else []) + ([a.tokens] if a.tokens else [])
        gen = Generator(model, cache, tok, max_batch_size=b, ngram_draft_tokens=a.k)
        assert gen.spec is not None
        _decode_tokens(gen, [prompt] * b, 8)
        gen.capture_graphs()
        for n in spans:
            base = statistics.median(_decode_tokens(plain, [prompt] * b, n)[0] for _ in range(a.rounds))
            rates: dict[str, list[float]] = {p: [] for p in policies}
            last: dict[str, dict[str, Any]] = {}
            for _ in range(a.rounds):
                for name, cls in policies.items():
                    gen.spec.length = cls(a.k, dynamic=True)
                    gen.spec.stats = SpecStats()
                    rate, got = _decode_tokens(gen, [prompt] * b, n)
                    if any(got[i][:n] != ref[i][:n] for i in got):
                        raise SystemExit(f"{name}: b={b}, {n} tokens: output differs from the plain generator's")
                    rates[name].append(rate)
                    last[name] = {**gen.spec.stats.as_dict(), "policy": gen.spec.length.estimates()}
            print(f"b={b}, {n} tokens{' (the answer)' if n == answer else ''}: plain {base:.1f} tok/s",
                  flush=True)
            for name in policies:
                r, st = statistics.median(rates[name]), last[name]
                print(f"  {name:<9} {r:9.1f} tok/s x{r / base:.2f} (runs: {', '.join(f'{x:.0f}' for x in rates[name])}); "
                      f"{st['draft_tokens']} drafts, {st['spec_steps']} speculative / {st['plain_steps']} plain steps, "
                      f"acceptance {st['acceptance_rate']:.2f}; estimates {st['policy']}", flush=True)
    model.unload()


if __name__ == "__main__":
    main()
