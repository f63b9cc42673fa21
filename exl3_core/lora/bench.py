"""``exl3 bench --lora``: decode speed with LoRA adapters beside the same model without them.

On a random-weight EXL3 model of the bench shape (:mod:`exl3_core.bench.models`), random rank-``rank``
adapters on all seven projections of every layer (q/k/v/o, gate/up/down; written in PEFT's layout and loaded
as a user would):

* ``b1``: b=1 decode tok/s with one adapter, against no adapter loaded at all;
* ``batch``: b=``batch`` decode throughput with ``adapters`` different adapters (job i uses adapter
  i mod ``adapters``), against no adapter;
* ``graph_step_ms`` of each: the replayed decode step alone (:func:`exl3_core.bench.run.graph_step_time`'s
  way), where graphs run.

The ratios are the figures the LoRA issue asks for (>= 0.9 at b=1, >= 0.8 at b=32 with 8 adapters).
"""
from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from exl3_core.bench.models import BenchShape, build_model


def _linears(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    from exl3_core.nn.linear import LinearBase

    return {m.key: (m.in_features, m.out_features) for m in model.modules()
            if isinstance(m, LinearBase) and ".layers." in m.key}


def load_random_adapters(model: Any, rank: int, count: int) -> None:
    """Load ``count`` random rank-``rank`` adapters ``a0``, ``a1``, ... on all seven projections of every layer of
    ``model``, written in PEFT's layout and loaded as a user would."""
    from exl3_core.testing.lora import random_adapter

    with tempfile.TemporaryDirectory(prefix="exl3-lora-bench-") as tmp:
        linears = _linears(model)
        for i in range(count):
            random_adapter(Path(tmp) / f"a{i}", linears, r=rank, seed=i, dtype=model.dtype)
            model.load_lora(Path(tmp) / f"a{i}", name=f"a{i}")


def select_rows(model: Any, choices: Sequence[dict[str, float] | None], rows: int) -> None:
    """A decode step's choice: row ``i`` (one per sequence) uses ``choices[i]``, the step's rows past them none."""
    from exl3_core.lora.registry import attached

    s = attached(model)
    if s is None:
        return
    s.select([(s.slots_of(c or {}), 1) for c in choices] + [({}, rows - len(choices))])


def _decode_rate(model: Any, cache: Any, prompts: list[list[int]], new_tokens: int,
                 choices: Sequence[dict[str, float] | None]) -> dict[str, Any]:
    """Decode tok/s of one generator run over ``prompts`` (job i with ``choices[i]``), counted from every job's first
    token, after a short warm-up run that compiles and captures."""
    from exl3_core.bench.run import decode_rate
    from exl3_core.generator import Generator, Job

    gen = Generator(model, cache, None, max_batch_size=max(len(prompts), 1), max_chunk_tokens=2048,
                    max_seq_len=max(len(p) for p in prompts) + new_tokens + 2)

    def run(n: int, ps: list[list[int]]) -> float:
        jobs = [Job(p, max_new_tokens=n + 1, stop_at_eos=False, identifier=i, loras=choices[i])
                for i, p in enumerate(ps)]
        return decode_rate(gen, jobs)[0]

    run(4, [p[:64] for p in prompts])
    gen.capture_graphs()
    out: dict[str, Any] = {"tok_s": run(new_tokens, prompts), "graphs": gen.graphs is not None}
    if gen.graphs is not None:
        out["graph_replays"] = gen.graphs.replays
    return out


def _step_ms(model: Any, cache: Any, batch: int, ctx: int, choices: Sequence[dict[str, float] | None]) -> float | None:
    """The replayed decode step alone, with each row's adapters chosen as a generator would."""
    from exl3_core.bench.run import GRAPH_STEP_REPLAYS, decode_meta, time_median
    from exl3_core.generator.graphs import DecodeGraphs
    from exl3_core.lora.registry import attached
    from exl3_core.plan import ExecutionPlan

    s = attached(model)
    if s is not None:
        s.selection.reserve(2048)
    graphs = DecodeGraphs.create(ExecutionPlan(model), cache, cache.max_pages_per_seq(ctx + 1))
    if graphs is None:
        return None
    meta, pages = decode_meta(model, cache, batch=batch, ctx=ctx, device="cpu")
    try:
        select_rows(model, choices, meta.input_ids.shape[0])
        n = GRAPH_STEP_REPLAYS
        return 1e3 * time_median(lambda: [graphs.run(meta) for _ in range(n)], model.device, warmup=2, iters=9) / n
    finally:
        cache.allocator.release(pages)
        graphs.reset()
        if s is not None:
            s.selection.clear()


def run_lora_bench(shape: BenchShape, *, rank: int = 16, adapters: int = 8, batch: int = 32, ctx: int = 256,
                   bpw: float = 4.0, head_bits: int | None = 6, codebook: str = "mcg",
                   device: str | torch.device | None = None, new_tokens: int = 128,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every figure of the module docstring as one dict."""
    from exl3_core import settings

    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    ps = settings.get().page_size
    cache_tokens = 2 * ps * (batch + 1) * (-(-(ctx + new_tokens + 8) // ps) + 1)
    model, cache = build_model(shape, bpw=bpw, head_bits=head_bits, codebook=codebook, device=dev,
                               cache_tokens=cache_tokens)
    vocab = model.config.hf.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (ctx,), generator=g).tolist() for _ in range(batch)]
    out: dict[str, Any] = {"shape": shape.name, "rank": rank, "adapters": adapters, "batch": batch, "ctx": ctx,
                           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    none_b1 = _decode_rate(model, cache, prompts[:1], new_tokens, [None])
    none_bn = _decode_rate(model, cache, prompts, new_tokens, [None] * batch)
    none_b1["graph_step_ms"] = _step_ms(model, cache, 1, ctx, [None])
    none_bn["graph_step_ms"] = _step_ms(model, cache, batch, ctx, [None] * batch)
    t0 = time.perf_counter()
    load_random_adapters(model, rank, adapters)
    out["load_seconds"] = time.perf_counter() - t0
    one = [{"a0": 1.0}]
    mixed = [{f"a{i % adapters}": 1.0} for i in range(batch)]
    lora_b1 = _decode_rate(model, cache, prompts[:1], new_tokens, one)
    lora_bn = _decode_rate(model, cache, prompts, new_tokens, mixed)
    lora_b1["graph_step_ms"] = _step_ms(model, cache, 1, ctx, one)
    lora_bn["graph_step_ms"] = _step_ms(model, cache, batch, ctx, mixed)
    out["b1"] = {"none": none_b1, "lora": lora_b1, "ratio": lora_b1["tok_s"] / none_b1["tok_s"]}
    out["batch_figures"] = {"none": none_bn, "lora": lora_bn, "ratio": lora_bn["tok_s"] / none_bn["tok_s"]}
    for label, r in (("b=1, 1 adapter", out["b1"]), (f"b={batch}, {adapters} adapters", out["batch_figures"])):
        steps = (f"; graph step {r['none']['graph_step_ms']:.3f} -> {r['lora']['graph_step_ms']:.3f} ms"
                 if r["none"].get("graph_step_ms") and r["lora"].get("graph_step_ms") else "")
        log(f"decode {label}, rank {rank} on all 7 projections: {r['lora']['tok_s']:.1f} tok/s vs "
            f"{r['none']['tok_s']:.1f} without ({r['ratio']:.3f}x){steps}")
    model.unload()
    return out
