"""Engine benchmark: decode/prefill speed of a random-weight EXL3 model beside its bounds.

Figures (each from the same process, so the bounds are measured on the same card):

* ``decode``: generator tokens/s for b=1 at context 256 and 4096 and for b=8, b=32 at 256
  (greedy, CUDA-graph decode where available, the whole engine loop including host work), and
  ``graph_step_ms``: the replayed decode step alone (GPU time per step, events);
* ``prefill``: tokens/s of one 2048-token prefill of a fresh sequence over the paged cache, as the
  generator runs it (a replayed CUDA graph where :mod:`exl3_core.generator.graphs` accepts it),
  timed back to back and, as ``idle_tok_s``, after a second of idle GPU (a long prefill back to back
  runs at a lower clock); ``eager_tok_s`` without the graph. ``prefills`` holds the same for every
  length asked for (short prompts show the per-forward host cost that the graph removes);
* bounds: ``roofline`` = bytes read per decode token (weights + KV at that context) / measured
  device-to-device copy bandwidth (read + written bytes), and ``decode_ceiling`` = time to decode
  every quantized weight once at the rate of the decode-only kernel (``torch.ops.exl3_bench.decode_only``,
  the GEMV's own decoder with no activations, no attention: the integer-pipeline ceiling of on-the-fly
  decoding) for its shape, K and codebook, measured :data:`CEILING_SAMPLES` times before and as many again
  after the b=1 runs. That kernel is a benchmark, built apart from ``exl3_core._C`` by
  ``python bench/ext/build.py`` (:func:`decode_only_op`); without it the ceiling is left out. One
  measurement moves by about 2% from the next at the same clock, so the fractions use the median of the
  samples; ``strict_fraction_of_decode_ceiling`` divides by the fastest sample instead.
"""
from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from exl3_core.bench.models import BenchShape, build_model, shape_dict
from exl3_core.cache import Cache
from exl3_core.cache_bits import CacheBits


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_median(fn: Callable[[], Any], device: torch.device, *, warmup: int = 2, iters: int = 10) -> float:
    """Median seconds of ``fn()`` (CUDA events on GPU, perf_counter on CPU) after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    n = nbytes or (2 << 30 if device.type == "cuda" else 64 << 20)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_median(lambda: dst.copy_(src), device, warmup=3, iters=10)
    return 2 * n / t


def _exl3_layers(model: torch.nn.Module) -> list[Any]:
    from exl3_core.quant.exl3.linear import EXL3Linear

    return [m for m in model.modules() if isinstance(m, EXL3Linear)]


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes one decode token must read: every weight once (embedding: one row)."""
    total = 0
    emb = getattr(model, "embed", None)
    skip = {id(emb.weight)} if emb is not None and emb.weight is not None else set()
    seen: set[int] = set()
    for m in model.modules():
        for t in list(m._buffers.values()) + list(m._parameters.values()):
            if t is None or id(t) in seen or id(t) in skip:
                continue
            seen.add(id(t))
            total += t.numel() * t.element_size()
    if skip:
        total += emb.weight.shape[1] * emb.weight.element_size()  # type: ignore[union-attr]
    return total


def kv_bytes_per_token(shape: BenchShape, ctx: int, elem: int = 2) -> int:
    """KV-cache bytes one decode token reads at context ``ctx`` (keys and values of every layer)."""
    return shape.layers * 2 * shape.kv_heads * shape.dim_head * elem * ctx


def _graphed_time(fn: Callable[[], Any], device: torch.device, calls: int = 10) -> float:
    """Seconds per call of ``fn`` replayed ``calls`` times in one CUDA graph (no launch gaps:
    small kernels would otherwise time the host)."""
    fn()
    torch.cuda.synchronize(device)
    from exl3_core.generator.graphs import no_gc

    g = torch.cuda.CUDAGraph()
    with no_gc(), torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return time_median(g.replay, device, warmup=2, iters=7) / calls


#: the bench extension (bench/ext) as ``python bench/ext/build.py`` writes it in a source checkout
BENCH_LIB = Path(__file__).resolve().parents[2] / "bench" / "ext" / "build" / "exl3_bench.so"


def decode_only_op(lib: Path | None = None) -> Callable[..., torch.Tensor] | None:
    """``torch.ops.exl3_bench.decode_only(trellis, codebook, kt_per_warp=0)``, the decode-only ceiling kernel,
    loading the bench extension from ``lib`` first when the op is not registered yet. Without ``lib`` the
    checkout's :data:`BENCH_LIB` is tried, and None returned when it was not built; an explicit ``lib`` that
    does not exist is an error."""
    if lib is not None and not Path(lib).is_file():
        raise FileNotFoundError(f"--ceiling-lib {lib}: no such file; build the bench extension with "
                                "`python bench/ext/build.py` (it writes bench/ext/build/exl3_bench.so)")
    if not hasattr(torch.ops.exl3_bench, "decode_only"):
        path = Path(lib) if lib is not None else BENCH_LIB
        if not path.is_file():
            return None
        torch.ops.load_library(str(path))
    return torch.ops.exl3_bench.decode_only


def decode_ceiling(model: torch.nn.Module, op: Callable[..., torch.Tensor] | None) -> dict[str, Any] | None:
    """Seconds to decode every quantized weight once at the decode-only kernel's rates (``op``, from
    :func:`decode_only_op`; None without it or on the CPU)."""
    layers = _exl3_layers(model)
    if op is None or not layers or not layers[0].trellis.is_cuda:
        return None
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for m in layers:
        groups.setdefault((tuple(m.trellis.shape), m.codebook), []).append(m)
    total = 0.0
    rows = []
    dev = layers[0].trellis.device
    for (shape, cb), ms in groups.items():
        trellis: torch.Tensor = ms[0].trellis
        t = _graphed_time(functools.partial(op, trellis, cb), dev)
        weights = shape[0] * shape[1] * 256
        total += t * len(ms)
        rows.append({"trellis": list(shape), "codebook": cb, "count": len(ms), "us": t * 1e6,
                     "tweights_per_s": weights / t / 1e12})
    return {"seconds_per_token": total, "tok_s": 1.0 / total, "per_shape": rows}


#: decode-ceiling measurements taken before the b=1 runs, and again after them
CEILING_SAMPLES = 3


def _ceiling_samples(model: torch.nn.Module, op: Callable[..., torch.Tensor] | None) -> list[dict[str, Any]]:
    """:data:`CEILING_SAMPLES` :func:`decode_ceiling` measurements (none without the op)."""
    return [c for c in (decode_ceiling(model, op) for _ in range(CEILING_SAMPLES)) if c]


def combine_ceilings(samples: list[dict[str, Any]], log: Callable[[str], None] = print) -> dict[str, Any]:
    """One ceiling from several :func:`decode_ceiling` measurements: the median sample with its
    ``per_shape`` rows (of an even count, the faster middle one: the stricter), every sample's rate as
    ``samples_tok_s`` and the fastest as ``strict_tok_s``. The median, not the fastest: a single
    measurement is noisy (+-2% at the same clock), and the fastest of n noisy samples drifts upward
    with n."""
    if not samples:
        raise ValueError("combine_ceilings needs at least one decode_ceiling measurement")
    ranked = sorted(samples, key=lambda c: c["tok_s"])
    mid = dict(ranked[len(ranked) // 2])
    mid["samples_tok_s"] = [c["tok_s"] for c in samples]
    mid["strict_tok_s"] = ranked[-1]["tok_s"]
    log(f"decode-only ceiling, {len(samples)} samples: {min(mid['samples_tok_s']):.0f}-{mid['strict_tok_s']:.0f} tok/s; "
        f"fractions use the median, {mid['tok_s']:.0f}")
    return mid


def decode_rate(gen: Any, jobs: list[Any]) -> tuple[float, dict[Any, list[int]]]:
    """Run ``jobs`` to the end on ``gen``: tokens/s of the decode phase (from every job's first token to the
    last one) and each job's tokens by identifier."""
    gen.enqueue(jobs)
    out: dict[Any, list[int]] = {}
    counted = 0
    t0 = None
    while gen.num_remaining():
        results = gen.iterate()
        for r in results:
            out.setdefault(r["identifier"], []).extend(r["token_ids"])
        if t0 is None:
            if all(j.new_tokens >= 1 for j in jobs):
                _sync(gen.device)
                t0 = time.perf_counter()
            continue
        counted += sum(len(r["token_ids"]) for r in results)
    _sync(gen.device)
    if t0 is None or counted == 0:
        raise RuntimeError("bench: the generator produced no decode tokens")
    return counted / (time.perf_counter() - t0), out


def _run_generator(gen: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens/s of the decode phase: from every job's first token to the last one."""
    from exl3_core.generator import Job

    jobs = [Job(p, max_new_tokens=new_tokens + 1, stop_at_eos=False, identifier=i) for i, p in enumerate(prompts)]
    return decode_rate(gen, jobs)[0]


def bench_decode(model: Any, cache: Any, *, batch: int, ctx: int, new_tokens: int, seed: int = 0) -> dict[str, Any]:
    """Generator decode throughput for ``batch`` jobs with ``ctx``-token prompts."""
    from exl3_core.generator import Generator

    vocab = model.config.hf.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (ctx,), generator=g).tolist() for _ in range(batch)]
    # prompts are prefilled 2048 tokens a step even once some jobs decode, so the jobs start (and end)
    # as close together as the figure has always assumed; the fairness of the step budget is not timed here
    gen = Generator(model, cache, None, max_batch_size=max(batch, 1), max_chunk_tokens=2048, step_tokens=2048,
                    max_seq_len=ctx + new_tokens + 2)
    _run_generator(gen, [p[: min(ctx, 64)] for p in prompts], 4)  # warm-up: compiles
    # the timed jobs end a few steps apart (their prefills are staggered), so the batch shrinks
    # through the smaller buckets at the end: capture them all now, as a server does at start-up
    gen.capture_graphs()
    tok_s = _run_generator(gen, prompts, new_tokens)
    out: dict[str, Any] = {"batch": batch, "ctx": ctx, "new_tokens": new_tokens, "tok_s": tok_s,
                           "graphs": gen.graphs is not None}
    if gen.graphs is not None:
        out["graph_replays"] = gen.graphs.replays
    return out


def decode_meta(model: Any, cache: Any, *, batch: int, ctx: int, rows: int = 1,
                device: Any = None) -> tuple[Any, list[int]]:
    """``(BatchMeta, pages)`` of one decode step of ``batch`` sequences, each ``rows`` tokens after ``ctx``
    cached ones, over pages freshly allocated from ``cache`` (the caller releases them), with the page
    table as wide as a sequence of ``ctx + rows`` tokens needs and, where the cache keeps per-sequence
    rings, ring slots 1 to ``batch``; tensors on ``device`` (default the model's; the host, as the
    generator builds them, for a graph replay that stages them itself)."""
    from exl3_core.generator.batching import Chunk, build_batch

    if cache.ring_slots and batch > cache.ring_slots - 1:
        raise ValueError(f"decode_meta: batch {batch} needs {batch} ring slots, the cache has "
                         f"{cache.ring_slots - 1}; create the Cache with recent_seqs >= {batch}")
    ps = cache.page_size
    each = -(-(ctx + rows) // ps)
    pages = cache.allocator.allocate(each * batch)
    try:
        chunks = [Chunk([1] * rows, ctx, pages[b * each:(b + 1) * each], True, b + 1 if cache.ring_slots else -1)
                  for b in range(batch)]
        meta, _ = build_batch(chunks, page_size=ps, table_width=cache.max_pages_per_seq(ctx + rows),
                              scratch_page=cache.scratch_page, device=model.device if device is None else device,
                              decode=True)
    except BaseException:
        cache.allocator.release(pages)
        raise
    return meta, pages


#: replays per timed run of :func:`graph_step_time`: queued back to back, as the generator's overlapped
#: loop queues them, so the host's share of one call (staging, launch) hides behind the GPU's work
GRAPH_STEP_REPLAYS = 8


def graph_step_time(model: Any, cache: Any, *, batch: int, ctx: int) -> float | None:
    """Seconds of one replayed decode step at context ``ctx`` as the generator runs it (inputs built on
    the host and staged by the replay, :data:`GRAPH_STEP_REPLAYS` replays queued back to back; CUDA
    events around them, divided by their count); None when not graphed."""
    from exl3_core.generator.graphs import DecodeGraphs
    from exl3_core.plan import ExecutionPlan

    graphs = DecodeGraphs.create(ExecutionPlan(model), cache, cache.max_pages_per_seq(ctx + 1))
    if graphs is None:
        return None
    meta, pages = decode_meta(model, cache, batch=batch, ctx=ctx, device="cpu")
    try:
        n = GRAPH_STEP_REPLAYS
        return time_median(lambda: [graphs.run(meta) for _ in range(n)], model.device, warmup=2, iters=9) / n
    finally:
        cache.allocator.release(pages)
        graphs.reset()


def prefill_meta(model: Any, cache: Any, tokens: int, pages: list[int], seed: int = 0, past: int = 0) -> Any:
    """BatchMeta of ``tokens`` random ids after ``past`` cached ones, over the cache ``pages`` (enough
    for both), asking for the logits of the last row only."""
    from exl3_core.archkit.batch import BatchMeta

    vocab = model.config.hf.vocab_size
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    return BatchMeta.from_lists([ids], [past], device=model.device, page_table=torch.tensor([pages], dtype=torch.int32),
                                page_size=cache.page_size, logits_indices=torch.tensor([tokens - 1], device=model.device))


#: graphed prefill is also timed once per repeat after this long with the GPU idle
IDLE_SECONDS = 1.0
IDLE_REPEATS = 3


def bench_prefill(model: Any, cache: Any, *, tokens: int, seed: int = 0, past: int = 0) -> dict[str, Any]:
    """Tokens/s of one ``tokens``-long prefill chunk over the paged cache (logits of the last row
    only), of a fresh sequence or after ``past`` cached tokens (a prefix-cache hit: paged attention
    over them): eager, and replayed as the generator runs it (a CUDA graph of the padded bucket,
    inputs staged from the host each call) when :class:`~exl3_core.generator.graphs.PrefillGraphs`
    accepts it. ``seconds``/``tok_s`` are the generator's path."""
    from exl3_core.generator.graphs import PrefillGraphs
    from exl3_core.plan import ExecutionPlan

    plan = ExecutionPlan(model)
    pages = cache.allocator.allocate(-(-(past + tokens) // cache.page_size))
    try:
        if past:
            plan.forward(prefill_meta(model, cache, past, pages, seed + 1), cache)  # the cached prefix
        meta = prefill_meta(model, cache, tokens, pages, seed, past)
        eager = time_median(lambda: plan.forward(meta, cache), model.device, warmup=2, iters=5)
        out: dict[str, Any] = {"tokens": tokens, "past": past, "eager_seconds": eager, "eager_tok_s": tokens / eager,
                               "path": "eager", "seconds": eager, "tok_s": tokens / eager}
        graphs = PrefillGraphs.create(plan, cache, len(pages), tokens)
        bucket = graphs.bucket(tokens, past, len(pages)) if graphs is not None else None
        if graphs is not None and bucket is not None:
            ids = meta.input_ids.tolist()

            def replay() -> None:
                graphs.run(ids, pages, past)

            t = time_median(replay, model.device, warmup=2, iters=5)
            # the same replay from an idle GPU (a user's prompt): back to back, a long prefill holds the
            # tensor cores busy long enough for the card to lower its clock
            idle = []
            for _ in range(IDLE_REPEATS):
                time.sleep(IDLE_SECONDS)
                idle.append(time_median(replay, model.device, warmup=0, iters=1))
            graphs.reset()
            t_idle = statistics.median(idle)
            out.update(path="graph", bucket=bucket, graph_seconds=t, seconds=t, tok_s=tokens / t,
                       idle_seconds=t_idle, idle_tok_s=tokens / t_idle)
    finally:
        cache.allocator.release(pages)
    return out


def profile_decode(model: Any, cache: Any, *, ctx: int = 256, steps: int = 5, rows: int = 18) -> str:
    """``torch.profiler`` table of eager b=1 decode steps at context ``ctx`` (kernels by total time)."""
    from torch.profiler import ProfilerActivity, profile

    from exl3_core.plan import ExecutionPlan

    plan = ExecutionPlan(model)
    meta, pages = decode_meta(model, cache, batch=1, ctx=ctx)
    try:
        plan.forward(meta, cache)
        _sync(model.device)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(steps):
                plan.forward(meta, cache)
            _sync(model.device)
    finally:
        cache.allocator.release(pages)
    avg = prof.key_averages()
    for key in (("device_time_total", "cuda_time_total") if model.device.type == "cuda" else ("cpu_time_total",)):
        try:
            return str(avg.table(sort_by=key, row_limit=rows))
        except (KeyError, AttributeError, ValueError):
            continue
    return str(avg.table(row_limit=rows))


def _bench_prefills(out: dict[str, Any], model: Any, cache: Any, prefills: tuple[int, ...], longest: int,
                    prefill_past: int, label: str, *, first: bool, log: Callable[[str], None],
                    step: Callable[[str], None]) -> None:
    """Every prefill length (fresh, and after ``prefill_past`` cached tokens) over ``cache``, into
    ``out["prefills"]``; the first cache's longest fresh one is the headline ``out["prefill"]``."""
    for n in prefills:
        for past in (0, prefill_past) if prefill_past else (0,):
            step(f"prefill {n} tokens" + (f" after {past}" if past else "") + (f" {label} cache" if label else ""))
            p = bench_prefill(model, cache, tokens=n, past=past)
            if label:
                p["cache"] = label
            out["prefills"].append(p)
            if n == longest and not past and first:
                out["prefill"] = p
            extra = (f"; from an idle GPU {p['idle_tok_s']:.0f} tok/s ({p['idle_seconds'] * 1e3:.2f} ms); eager "
                     f"{p['eager_tok_s']:.0f} tok/s ({p['eager_seconds'] * 1e3:.2f} ms)") if p["path"] == "graph" else ""
            after = f" after {past} cached" if past else ""
            over = f" {label} cache" if label else ""
            log(f"prefill {n} tokens{after}{over} ({p['path']}): {p['tok_s']:.0f} tok/s ({p['seconds'] * 1e3:.2f} ms)"
                f"{extra}")


def cache_compare(decode: list[dict[str, Any]], prefills: list[dict[str, Any]], base: str) -> list[dict[str, Any]]:
    """Every other cache's decode and prefill rates over the ``base`` cache's at the same batch and context
    (prefill: tokens and cached prefix)."""
    out = []
    ref = {(r["batch"], r["ctx"]): r["tok_s"] for r in decode if r["cache"] == base}
    for r in decode:
        if r["cache"] != base and (r["batch"], r["ctx"]) in ref:
            b = ref[(r["batch"], r["ctx"])]
            out.append({"what": f"decode b={r['batch']} ctx={r['ctx']}", "cache": r["cache"], "batch": r["batch"],
                        "ctx": r["ctx"], "tok_s": r["tok_s"], "base_tok_s": b, "ratio": r["tok_s"] / b})
    pref = {(p["tokens"], p["past"]): p["tok_s"] for p in prefills if p.get("cache", base) == base}
    for p in prefills:
        if p.get("cache", base) != base and (p["tokens"], p["past"]) in pref:
            b = pref[(p["tokens"], p["past"])]
            out.append({"what": f"prefill {p['tokens']} after {p['past']}", "cache": p["cache"], "tokens": p["tokens"],
                        "past": p["past"], "tok_s": p["tok_s"], "base_tok_s": b, "ratio": p["tok_s"] / b})
    return out


def run_bench(shape: BenchShape, *, bpw: float = 4.0, head_bits: int | None = 6, codebook: str = "mcg",
              device: str | torch.device | None = None, contexts: tuple[int, ...] = (256, 4096),
              batches: tuple[int, ...] = (8, 32), prefill_tokens: int | tuple[int, ...] = 2048, prefill_past: int = 0,
              new_tokens: int = 128,
              profile: bool = False, vs_transformers: bool = False, ceiling_lib: Path | None = None,
              cache_bits: Sequence[CacheBits] = (CacheBits(),), cache_memory: int | None = None,
              log: Callable[[str], None] = print,
              progress: Callable[[int, int, str], None] | None = None,
              parallel: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every figure of the module docstring as one dict (see ``exl3 bench --help``); ``ceiling_lib``: the
    bench extension's library (:func:`decode_only_op`); ``parallel``: tensor-parallel ``model.load`` arguments
    (``tensor_parallel_size``, ``expert_parallel``; the per-rank figures, weight bytes and ceilings, are rank 0's).
    ``cache_bits``: the KV caches to measure decode and prefill over, one after the other in this process
    (``cache_compare`` holds each one's rates over the first's); ``capacity`` holds, per cache, the concurrent
    4096-token sequences that ``cache_memory`` bytes of cache hold (default: the device's memory less the
    weights; 16 GiB on the CPU).

    :param progress: called as ``progress(steps_done, steps, next_step)`` before each long step."""
    prefills = tuple(t for t in ((prefill_tokens,) if isinstance(prefill_tokens, int) else prefill_tokens) if t > 0)
    longest = max(prefills, default=0)
    variants = tuple(cache_bits) or (CacheBits(),)
    if len(variants) > 1 and parallel and (parallel.get("tensor_parallel_size") or 1) > 1:
        raise ValueError("exl3 bench: several --cache-bits are measured one after the other in this process; with "
                         "tensor parallelism give one --cache-bits per run")
    n_steps = (1 + len(variants) * (len(contexts) + len(batches) + len(prefills) * (2 if prefill_past else 1))
               + int(profile))
    done = 0

    def next_step(what: str) -> None:
        nonlocal done
        if progress is not None:
            progress(done, n_steps, what)
        done += 1
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    # the ceiling kernel first: a --ceiling-lib that does not exist fails before any work
    op = decode_only_op(ceiling_lib) if dev.type == "cuda" or ceiling_lib is not None else None
    if dev.type == "cuda" and op is None:
        log("decode-only ceiling: left out (build the bench extension: python bench/ext/build.py)")
    out: dict[str, Any] = {"shape": shape_dict(shape), "bpw": bpw, "head_bits": head_bits, "codebook": codebook,
                           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                           "torch": torch.__version__}
    bw = copy_bandwidth(dev)
    out["copy_bandwidth_Bps"] = bw
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + written)")
    from exl3_core import settings

    ps = settings.get().page_size

    def pages(n: int) -> int:
        return -(-n // ps) + 1

    # every bench run at once, in whole pages, twice over (prefix-cached pages stay resident)
    need = pages(max(contexts) + new_tokens + 8) + max(batches, default=1) * pages(min(contexts) + new_tokens + 8)
    cache_tokens = 2 * ps * (need + pages(longest + prefill_past))
    t0 = time.perf_counter()
    next_step("building the random-weight model")
    model, cache = build_model(shape, bpw=bpw, head_bits=head_bits, codebook=codebook, device=dev,
                               cache_tokens=cache_tokens, parallel=parallel,
                               cache_kwargs=variants[0].cache_kwargs())
    out["parallel"] = dict(parallel or {})
    out["build_seconds"] = time.perf_counter() - t0
    out["memory"] = model.memory_report()
    wbytes = weight_bytes_per_token(model)
    out["weight_bytes_per_token"] = wbytes
    ceilings = _ceiling_samples(model, op)
    if ceilings:
        log("decode-only ceiling of the weights: " + ", ".join(f"{c['tok_s']:.0f}" for c in ceilings) + " tok/s")
    decode: list[dict[str, Any]] = []
    ceiling = None
    out["prefills"] = []
    for vi, bits in enumerate(variants):
        if vi:  # the next cache in the memory of the last
            cache.free()
            cache = Cache(model, cache_tokens, **bits.cache_kwargs())
        kv_token = cache.bytes_for(model.dtype) // ((cache.num_pages + 1) * cache.page_size)
        cache_name = bits.label(model.dtype)
        shown = f" {cache_name} cache" if len(variants) > 1 else ""
        rows = []
        for ctx in contexts:
            next_step(f"decode b=1 ctx={ctx}{shown}")
            r = bench_decode(model, cache, batch=1, ctx=ctx, new_tokens=new_tokens)
            step = graph_step_time(model, cache, batch=1, ctx=ctx)
            r["graph_step_ms"] = None if step is None else step * 1e3
            rows.append(r)
        if ceilings and ceiling is None:  # measured again with the card as warm as the b=1 runs left it
            ceiling = combine_ceilings(ceilings + _ceiling_samples(model, op), log)
        for b in batches:
            next_step(f"decode b={b} ctx={min(contexts)}{shown}")
            r = bench_decode(model, cache, batch=b, ctx=min(contexts), new_tokens=new_tokens)
            step = graph_step_time(model, cache, batch=b, ctx=min(contexts)) if b <= 32 else None
            r["graph_step_ms"] = None if step is None else step * 1e3
            rows.append(r)
        for r in rows:
            r["cache"] = cache_name
            r["kv_bytes"] = r["batch"] * kv_token * r["ctx"]
        decode += rows
        _bench_prefills(out, model, cache, prefills, longest, prefill_past, cache_name if len(variants) > 1 else "",
                        first=vi == 0, log=log, step=next_step)
    out["decode_ceiling"] = ceiling
    for r in decode:
        nbytes = wbytes + r.pop("kv_bytes")
        r["bytes_per_step"] = nbytes
        r["roofline_tok_s"] = r["batch"] * bw / nbytes
        r["fraction_of_roofline"] = r["tok_s"] / r["roofline_tok_s"]
        if ceiling:
            r["decode_ceiling_tok_s"] = r["batch"] * ceiling["tok_s"]
            r["fraction_of_decode_ceiling"] = r["tok_s"] / r["decode_ceiling_tok_s"]
            r["strict_fraction_of_decode_ceiling"] = r["tok_s"] / (r["batch"] * ceiling["strict_tok_s"])
        step_s = f", graph step {r['graph_step_ms']:.3f} ms" if r.get("graph_step_ms") else ""
        label = f" {r['cache']} cache" if len(variants) > 1 else ""
        log(f"decode b={r['batch']} ctx={r['ctx']}{label}: {r['tok_s']:.1f} tok/s{step_s} | roofline "
            f"{r['roofline_tok_s']:.0f} ({100 * r['fraction_of_roofline']:.1f}%)"
            + (f" | decode-only ceiling {r['decode_ceiling_tok_s']:.0f} "
               f"({100 * r['fraction_of_decode_ceiling']:.1f}%; fastest sample "
               f"{100 * r['strict_fraction_of_decode_ceiling']:.1f}%)" if ceiling else ""))
    out["decode"] = decode
    base = variants[0].label(model.dtype)
    b1 = [r for r in decode if r["batch"] == 1 and r["ctx"] == min(contexts) and r["cache"] == base]
    if b1:
        out["batch_scaling"] = {str(r["batch"]): r["tok_s"] / b1[0]["tok_s"] for r in decode
                                if r["ctx"] == min(contexts) and r["cache"] == base}
    if not prefills:
        del out["prefills"]
    if len(variants) > 1:
        out["cache_compare"] = cache_compare(decode, out.get("prefills", []), base)
        for c in out["cache_compare"]:
            log(f"{c['what']} {c['cache']} / {base}: {c['ratio']:.3f}x ({c['tok_s']:.1f} vs {c['base_tok_s']:.1f} tok/s)")
    if cache_memory is None:
        cache_memory = (torch.cuda.get_device_properties(dev).total_memory - out["memory"]["allocated"]["weights"]
                        if dev.type == "cuda" else 16 << 30)
    from exl3_core.bench.capacity import max_sequences

    out["capacity"] = max_sequences(model, variants, cache_memory, model.dtype, page_size=cache.page_size)
    for c in out["capacity"]:
        log(f"capacity {c['cache']}: {c['sequences']} concurrent {c['seq_tokens']}-token sequences in "
            f"{c['memory_bytes'] / 2**30:.2f} GiB of cache ({c['tokens']} tokens, {c['bytes_per_token']:.0f} bytes each)")
    if profile:
        next_step("profile")
        out["profile_b1"] = profile_decode(model, cache, ctx=min(contexts))
        log(out["profile_b1"])
    if progress is not None:
        progress(n_steps, n_steps, "done")
    model.unload()
    if vs_transformers:
        from exl3_core.bench.hf import transformers_decode

        try:
            out["transformers"] = transformers_decode(shape, dev, ctx=min(contexts), new_tokens=min(new_tokens, 64),
                                                      prefill_tokens=longest)
        except Exception as e:  # noqa: BLE001 - the comparison is optional; keep the exl3 figures
            out["transformers"] = {"error": f"{type(e).__name__}: {e}"}
        log(f"transformers bf16: {out['transformers']}")
    return out
