"""Where the time goes on the GPU (device script helper, not a benchmark).

    python bench/profile_gpu.py prefill [--shape 8b] [--tokens 2048]
        torch.profiler kernel table of one prefill forward of the execution plan (random-weight EXL3
        model, 4.0 bpw, 6-bit head, MUL1), GPU time per kernel group, and the forward's wall time.
    python bench/profile_gpu.py host [--shape 1b] [--tokens 128]
        b=1 greedy generator decode: wall time per token vs the replayed graph step, and a cProfile
        of the host side (functions by own time) -- the host work between graph replays.

    python bench/profile_gpu.py loop [--shape 1b] [--tokens 128] [--batch 1]
        the generator's decode loop at --batch: tok/s against the graph step, the overlapped
        pipeline's launches, and what the GPU runs between two replays.

    python bench/profile_gpu.py decode [--shape 8b] [--tokens 256] [--batch 1] [--cache-bits 16] [--lora 0]
        a decode step of --batch sequences (a graph bucket: 1, 2, 4, 8, 16, 32) replayed from its
        CUDA graph at context --tokens over a cache of --cache-bits (exl3 bench's option: 16, 4, 8,4;
        --cache-recent N as there),
        with --lora R: random rank-R adapters on all seven projections (--lora-adapters N of them, row i using
        adapter i mod N):
        GPU time per kernel group per step, and one step's kernel timeline (start, duration, gap after
        the previous kernel's end; with PDL a kernel may start before the previous one ends, so gaps
        can be negative).

Output goes to stdout and, with --out DIR, to DIR/profile_<what>_<shape>.txt.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats
import time
from pathlib import Path
from typing import Any

import torch

from exl3_core.bench.models import build_model, parse_shape
from exl3_core.bench.run import _sync, bench_prefill, decode_meta, graph_step_time, prefill_meta
from exl3_core.cache_bits import CacheBits, add_cache_bits_arg, cache_variants
from exl3_core.lora.bench import load_random_adapters, select_rows
from exl3_core.lora.registry import lora_set
from exl3_core.plan import ExecutionPlan


def _emit(text: str, out: Path | None, name: str) -> None:
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)


def profile_prefill(shape_name: str, tokens: int, out: Path | None, device: str = "cuda",
                    small_tokens: int = 128) -> None:
    from torch.profiler import ProfilerActivity, profile

    shape = parse_shape(shape_name)
    model, cache = build_model(shape, bpw=4.0, head_bits=6, codebook="mul1", device=device,
                               cache_tokens=2 * tokens + 1024)
    r = bench_prefill(model, cache, tokens=tokens)
    plan = ExecutionPlan(model)
    pages = cache.allocator.allocate(-(-tokens // cache.page_size))
    meta = prefill_meta(model, cache, tokens, pages, seed=1)
    plan.forward(meta, cache)
    _sync(model.device)
    cuda = model.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(3):
            plan.forward(meta, cache)
        _sync(model.device)
    table = prof.key_averages().table(sort_by="device_time_total" if cuda else "cpu_time_total", row_limit=30, max_name_column_width=90)
    head = f"prefill {shape_name} {tokens} tokens: {r['tok_s']:.0f} tok/s ({r['seconds'] * 1e3:.2f} ms per forward); 3 forwards profiled\n"
    if cuda:
        head += _host_vs_device(plan, cache, meta, out)
        head += _host_small(plan, cache, small_tokens)
    _emit(head + table, out, f"profile_prefill_{shape_name}.txt")


def _host_small(plan: ExecutionPlan, cache: Any, tokens: int) -> str:
    """The host's own cost of a forward: a ``tokens``-long prefill (same op path as 2048 once above
    64 rows, but little GPU work) timed host-side with the GPU idle at the start, plus a cProfile of
    it by own time. If this enqueue time is far below the 2048-token device time, the host is not
    what bounds the long prefill."""
    pages = cache.allocator.allocate(-(-tokens // cache.page_size))
    try:
        meta = prefill_meta(plan.model, cache, tokens, pages, seed=2)
        fwd = plan.forward
        runs = [_enqueue_vs_device(fwd, meta, cache) for _ in range(6)]
        enq = sorted(e for e, _ in runs)
        dev = sorted(d for _, d in runs)
        pr = cProfile.Profile()
        _sync(torch.device("cuda"))
        pr.enable()
        fwd(meta, cache)
        pr.disable()
        _sync(torch.device("cuda"))
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    finally:
        cache.allocator.release(pages)
    return (f"{tokens}-token forward: host enqueue median {enq[3] * 1e3:.2f} ms, device {dev[3] * 1e3:.2f} ms "
            f"(GPU idle at the start)\n" + s.getvalue())


def _enqueue_vs_device(fwd: Any, meta: object, cache: object) -> tuple[float, float]:
    """Seconds the host takes to enqueue one forward, and its device time by CUDA events, starting
    from an idle GPU."""
    _sync(torch.device("cuda"))
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    e0.record()
    fwd(meta, cache)
    enqueue = time.perf_counter() - t
    e1.record()
    e1.synchronize()
    return enqueue, e0.elapsed_time(e1) / 1e3


def _host_vs_device(plan: ExecutionPlan, cache: Any, meta: Any, out: Path | None) -> str:
    """Why a forward's wall time exceeds its kernels' sum: host enqueue time vs device time, the
    synchronising calls made during one forward (torch's sync debug mode), and a Chrome trace."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    fwd = plan.forward
    enqueue, device = _enqueue_vs_device(fwd, meta, cache)
    lines = [f"host enqueue of one forward {enqueue * 1e3:.2f} ms; device (events) {device * 1e3:.2f} ms\n"]
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fwd(meta, cache)
            _sync(torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    sites: dict[str, int] = {}
    for w in caught:
        key = f"{w.filename}:{w.lineno}: {str(w.message)[:90]}"
        sites[key] = sites.get(key, 0) + 1
    lines.append(f"synchronising calls during one forward: {len(caught)}\n")
    lines += [f"  {n:4d} x {k}\n" for k, n in sorted(sites.items(), key=lambda kv: -kv[1])[:12]]
    if out is not None:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            fwd(meta, cache)
            _sync(torch.device("cuda"))
        prof.export_chrome_trace(str(out / "prefill_trace.json"))
    return "".join(lines)


def profile_host(shape_name: str, tokens: int, out: Path | None, device: str = "cuda") -> None:
    from exl3_core.generator import Generator, Job

    shape = parse_shape(shape_name)
    model, cache = build_model(shape, bpw=4.0, head_bits=6, codebook="mul1", device=device, cache_tokens=8192)
    step = graph_step_time(model, cache, batch=1, ctx=256)
    gen = Generator(model, cache, None, max_batch_size=1, max_chunk_tokens=2048, max_seq_len=256 + tokens + 8)
    prompt = torch.randint(0, shape.vocab, (256,)).tolist()

    def run(n: int) -> float:
        job = Job(prompt, max_new_tokens=n + 1, stop_at_eos=False)
        gen.enqueue(job)
        while job.new_tokens < 1:
            gen.iterate()
        _sync(model.device)
        t = time.perf_counter()
        while gen.num_remaining():
            gen.iterate()
        _sync(model.device)
        return (time.perf_counter() - t) / n

    run(8)
    per_tok = run(tokens)
    pr = cProfile.Profile()
    pr.enable()
    run(tokens)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28)
    head = (f"host {shape_name}: {1 / per_tok:.1f} tok/s = {per_tok * 1e3:.3f} ms per token; graph step "
            f"{(step or 0) * 1e3:.3f} ms; host share {(per_tok - (step or 0)) * 1e3:.3f} ms\n")
    _emit(head + s.getvalue(), out, f"profile_host_{shape_name}.txt")


def between_steps(ev: list[tuple[str, float, float]]) -> list[str]:
    """Report lines for a GPU timeline ``ev`` of (name, start us, end us), sorted by start: per pair of
    consecutive steps (each ends with its greedy pick), the span from pick to pick and what ran after
    the first pick (the copies and the ids cast) up to the next step's first kernel."""
    picks = [i for i, e in enumerate(ev) if "greedy" in e[0].lower()]
    lines = []
    for a, b in itertools.pairwise(picks):
        end = ev[a][2]
        lines.append(f"step: pick to next pick {ev[b][2] - end:.1f} us; after the pick, on the GPU:\n")
        for e in ev[a + 1:b]:
            between = "memcpy" in e[0].lower() or "direct_copy" in e[0]
            lines.append(f"   +{e[1] - end:8.1f} us {e[2] - e[1]:7.2f} us  "
                         f"{e[0][:70] if between else 'the next step: ' + e[0][:55]}\n")
            if not between:
                break
    return lines


def profile_loop(shape_name: str, tokens: int, out: Path | None, device: str = "cuda", batch: int = 1,
                 ctx: int = 256) -> None:
    """The generator's decode loop at ``batch``: tok/s against the replayed graph step, and what the
    GPU runs between two replays (copies, the ids cast, idle gaps) from a profiled stretch of steps."""
    from torch.profiler import ProfilerActivity, profile

    from exl3_core.bench.run import _run_generator
    from exl3_core.generator import Generator, Job

    shape = parse_shape(shape_name)
    model, cache = build_model(shape, bpw=4.0, head_bits=6, codebook="mul1", device=device,
                               cache_tokens=2 * batch * (ctx + tokens + 512))
    step = graph_step_time(model, cache, batch=batch, ctx=ctx) or 0.0
    gen = Generator(model, cache, None, max_batch_size=batch, max_chunk_tokens=2048, max_seq_len=ctx + tokens + 8)
    prompts = [torch.randint(0, shape.vocab, (ctx,)).tolist() for _ in range(batch)]
    _run_generator(gen, [p[:64] for p in prompts], 4)
    gen.capture_graphs()
    p = gen.pipeline
    before = (p.launches, p.spec_launches) if p else (0, 0)
    tok_s = _run_generator(gen, prompts, tokens)
    after = (p.launches, p.spec_launches) if p else (0, 0)
    jobs = [Job(q, max_new_tokens=tokens, stop_at_eos=False) for q in prompts]
    gen.enqueue(jobs)
    while not all(j.new_tokens >= 1 for j in jobs):
        gen.iterate()
    for _ in range(4):
        gen.iterate()
    _sync(model.device)
    walls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            t = time.perf_counter()
            gen.iterate()
            walls.append(time.perf_counter() - t)
        _sync(model.device)
    while gen.num_remaining():
        gen.iterate()
    ev = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda t: t[1])
    lines = [(f"loop {shape_name} b={batch} ctx={ctx}: {tok_s:.1f} tok/s = {batch / tok_s * 1e3:.3f} ms per step; "
              f"graph step {step * 1e3:.3f} ms; pipeline launches {after[0] - before[0]}, of them speculative "
              f"{after[1] - before[1]}\n"),
             "iterate() wall under the profiler (ms): " + " ".join(f"{w * 1e3:.2f}" for w in walls) + "\n"]
    lines += between_steps(ev)
    _emit("".join(lines), out, f"profile_loop_{shape_name}_b{batch}.txt")


#: kernel name fragments -> group, for the decode step table (first match wins)
_DECODE_GROUPS = (("fused_linear", "EXL3 linear (fused)"), ("gemm_kernel", "EXL3 GEMM"),
                  ("_decode_split", "attention (split-KV)"), ("decode_attn", "attention (CUDA)"), ("rms", "norms"),
                  ("rope", "rope"), ("kv_write", "kv write"), ("silu", "act*mul"), ("gelu", "act*mul"),
                  ("sample", "sampling"), ("argmax", "sampling"), ("greedy", "sampling"))


def _group(name: str) -> str:
    low = name.lower()
    return next((g for frag, g in _DECODE_GROUPS if frag.lower() in low), "other")


def profile_decode(shape_name: str, ctx: int, out: Path | None, device: str = "cuda", steps: int = 5,
                   batch: int = 1, bits: CacheBits = CacheBits(), lora: int = 0, lora_adapters: int = 1) -> None:
    from torch.profiler import ProfilerActivity, profile

    from exl3_core.generator.graphs import DecodeGraphs

    shape = parse_shape(shape_name)
    model, cache = build_model(shape, bpw=4.0, head_bits=6, codebook="mul1", device=device,
                               cache_tokens=batch * (ctx + 1024), cache_kwargs=bits.cache_kwargs())
    if lora:
        load_random_adapters(model, lora, lora_adapters)
        lora_set(model).selection.reserve(2048)
    graphs = DecodeGraphs.create(ExecutionPlan(model), cache, cache.max_pages_per_seq(ctx + 1))
    if graphs is None:
        raise SystemExit("decode graphs declined for this model/device: nothing to profile")
    # inputs built on the host, as the generator stages them (a device-built meta takes DecodeGraphs.run's
    # device-fed path, which adds a carry reset kernel before every replay)
    meta, pages = decode_meta(model, cache, batch=batch, ctx=ctx, device="cpu")
    if lora:  # row i uses adapter i mod --lora-adapters; the bucket's padding rows none
        select_rows(model, [{f"a{i % lora_adapters}": 1.0} for i in range(batch)], meta.input_ids.shape[0])
    step = graph_step_time(model, cache, batch=batch, ctx=ctx)
    for _ in range(3):
        graphs.run(meta)
    _sync(model.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graphs.run(meta)
        _sync(model.device)
    kern = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower()
                   and "memset" not in e.name.lower()), key=lambda t: t[1])
    per = len(kern) // steps
    groups: dict[str, list[float]] = {}
    for name, t0, t1 in kern[: per * steps]:
        groups.setdefault(_group(name), []).append(t1 - t0)
    last = kern[per * (steps - 1): per * steps]
    wall = last[-1][2] - last[0][1]
    label = bits.label(model.dtype)
    lines = [(f"decode {shape_name} b={batch} ctx={ctx} cache {label}"
              + (f", LoRA rank {lora} x {lora_adapters}" if lora else "")
              + f": graph step {(step or 0) * 1e3:.3f} ms "
              f"(events); {per} kernels per step; "
              f"last profiled step {wall:.1f} us first start to last end\n"),
             f"{'group':24s} {'kernels/step':>12s} {'us/step (sum of durations)':>28s}\n"]
    for g, ds in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{g:24s} {len(ds) / steps:12.1f} {sum(ds) / steps:28.1f}\n")
    lines.append("\ntimeline of the last step (us): start, duration, gap after the previous kernel's end, end after\n"
                 "the previous kernel's end (a chain of programmatic dependents: each kernel's share of the step)\n")
    prev_end = last[0][1]
    for name, t0, t1 in last:
        lines.append(f"{t0 - last[0][1]:9.1f} {t1 - t0:8.2f} {t0 - prev_end:7.2f} {t1 - prev_end:7.2f}  {name[:90]}\n")
        prev_end = max(prev_end, t1)
    cache.allocator.release(pages)
    graphs.reset()
    _emit("".join(lines), out, f"profile_decode_{shape_name}" + (f"_b{batch}" if batch > 1 else "")
          + (f"_{label}" if bits.quantized else "") + (f"_lora{lora}" if lora else "") + ".txt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["prefill", "host", "decode", "loop"])
    ap.add_argument("--shape", default=None)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=1, help="decode: sequences per step (a captured bucket, <= 32)")
    add_cache_bits_arg(ap)  # decode: the cache, as exl3 bench's options (--cache-bits 16, 4, 8,4; --cache-recent)
    ap.add_argument("--lora", type=int, default=0, help="decode: random adapters of this rank on every projection")
    ap.add_argument("--lora-adapters", type=int, default=1, help="decode: how many (row i uses adapter i mod this)")
    a = ap.parse_args()
    if a.what == "prefill":
        profile_prefill(a.shape or "8b", a.tokens or 2048, a.out, a.device)
    elif a.what == "loop":
        profile_loop(a.shape or "1b", a.tokens or 128, a.out, a.device, batch=a.batch)
    elif a.what == "decode":
        profile_decode(a.shape or "8b", a.tokens or 256, a.out, a.device, batch=a.batch, bits=cache_variants(a)[0],
                       lora=a.lora, lora_adapters=a.lora_adapters)
    else:
        profile_host(a.shape or "1b", a.tokens or 128, a.out, a.device)


if __name__ == "__main__":
    main()
