"""Where a speculative step's host time goes: one `exl3 bench --draft` configuration under cProfile (GPU).

The bench (exl3_core.bench.spec) reports host time per speculative step as the wall time less the measured
device time of the verification and the k draft forwards. This runs one alpha and one k of it (the same
self-predicting target, oracle draft and prompts) under cProfile and prints the functions that hold the
host, by own time and by cumulative time, with the step count so that per-step figures can be read off.

    python bench/spec_profile.py [--shape 8b] [--draft 1b] [--alpha 0.9] [--k 3] [--batch 1] [--out DIR]
    (``--device cpu --shape 'custom(64,128,2,4,2,256)' --draft 'custom(64,128,1,4,2,256)'``: a smoke run of the
    script itself; the draft shares the target's vocabulary)

Then, without the profiler, events just before and after each launch of a step (the draft's first step, its
chain, the verification) give each launch's device time in the step and the device time between launches, and
the host clock the time each launch call (and each graph launch alone) holds the host. On CUDA it last runs a
few more steps under torch.profiler with the step's phases marked (draft, verification, acceptance, commits) and
prints the device's idle gaps with the host phase running when each began, and the device time by the phase
that launched it and by kernel.
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
from exl3_core.generator import Generator, Job
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
    spans(gen, prompts, dev)
    if dev.type == "cuda":
        gaps(gen, prompts, a.out)


class _HostEvent:
    """A CUDA event's interface on the host clock (the CPU smoke run)."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.t - self.t) * 1e3


def spans(gen: Generator, prompts: list[list[int]], dev: torch.device, steps: int = 48) -> None:
    """Without the profiler: events on the stream just before and just after each launch of a speculative step
    (the draft's first step, its chain, the verification), so that the device time between two events is either
    a launch's own time in the step or what passed between two launches (eager kernels, and the device waiting
    for the host). Printed per step, beside the step's wall time."""
    assert gen.spec is not None
    drafter = gen.spec.drafter
    marks: list[tuple[str, object]] = []

    def event() -> object:
        e = torch.cuda.Event(enable_timing=True) if dev.type == "cuda" else _HostEvent()
        e.record()
        return e

    host: dict[str, float] = {}

    def wrapped(fn, label):
        def inner(*args, **kw):
            marks.append((label + "<", event()))
            t = time.perf_counter()
            out = fn(*args, **kw)
            host[label] = host.get(label, 0.0) + time.perf_counter() - t
            marks.append((label + ">", event()))
            return out
        return inner

    targets = [(drafter, "_step", "draft_step"), (drafter, "_chain", "draft_chain")]
    if getattr(drafter, "propose_shifted", None) is not None:  # drafts launched before the read-back
        targets.append((drafter, "propose_shifted", "draft_ahead"))
    if gen.graphs is not None:
        targets.append((gen.graphs, "run", "verify"))
    else:
        targets.append((gen.plan, "forward", "verify"))
    for obj, name, label in targets:
        setattr(obj, name, wrapped(getattr(obj, name), label))
    replay = torch.cuda.CUDAGraph.replay

    def timed_replay(graph: torch.cuda.CUDAGraph) -> None:  # the graph launch alone
        t = time.perf_counter()
        replay(graph)
        host["graph launches"] = host.get("graph launches", 0.0) + time.perf_counter() - t

    torch.cuda.CUDAGraph.replay = timed_replay  # type: ignore[method-assign]
    jobs = [Job(p, max_new_tokens=min(steps * 8, gen.max_seq_len - len(p) - 1), stop_at_eos=False, identifier=i)
            for i, p in enumerate(prompts)]
    gen.enqueue(jobs)
    for _ in range(4):
        gen.iterate()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    marks.clear()
    host.clear()
    spec_steps = gen.spec.stats.steps
    t0 = time.perf_counter()
    for _ in range(steps):
        gen.iterate()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    n = max(gen.spec.stats.steps - spec_steps, 1)
    for obj, name, _ in targets:
        delattr(obj, name)
    torch.cuda.CUDAGraph.replay = replay  # type: ignore[method-assign]
    while gen.num_remaining():
        gen.iterate()
    sums: dict[str, float] = {}
    for (a, ea), (b, eb) in zip(marks, marks[1:]):
        key = a[:-1] if a[-1] == "<" and b == a[:-1] + ">" else f"{a[:-1]} -> {b[:-1]}"
        sums[key] = sums.get(key, 0.0) + ea.elapsed_time(eb)  # type: ignore[attr-defined]
    total = sum(sums.values())
    print(f"\nunprofiled spans over {n} speculative steps: {wall / n * 1e3:.3f} ms wall a step; device time between "
          f"the first and last event {total / n:.3f} ms a step:")
    for k, v in sorted(sums.items(), key=lambda x: -x[1]):
        print(f"  {k:32s} {v / n:.3f} ms")
    # a launch's host time (metadata, staging, the graph launch itself) runs ahead of the device only where
    # the device is still busy with the launch before
    print("host time inside each launch call a step: " + ", ".join(f"{k} {v / n * 1e3:.3f} ms" for k, v in host.items()))


# host phases marked in the timeline: (object, method name, label)
def _phases(gen: Generator) -> list[tuple[object, str, str]]:
    assert gen.spec is not None
    spec, drafter = gen.spec, gen.spec.drafter
    out: list[tuple[object, str, str]] = [
        (spec, "_propose", "propose"), (spec, "_verify", "verify"), (spec, "_accept_drafts", "accept"),
        (spec, "_commit", "commit"), (spec, "_trim_pages", "trim"), (spec, "_record_times", "record_times"),
        (drafter, "_step", "draft_step"), (drafter, "_chain", "draft_chain"), (drafter, "_forced", "forced"),
        (drafter, "commit", "draft_commit"), (gen, "_step", "gen_step")]
    if getattr(drafter, "propose_shifted", None) is not None:
        out.append((drafter, "propose_shifted", "draft_ahead"))
    if gen.graphs is not None:
        out.append((gen.graphs, "run", "verify_replay"))
    return out


def gaps(gen: Generator, prompts: list[list[int]], out: Path | None, steps: int = 24) -> None:
    """Device idle gaps over ``steps`` speculative steps, with the host phase running at each gap's start."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def marked(fn, label):
        def inner(*args, **kw):
            with record_function("phase:" + label):
                return fn(*args, **kw)
        return inner

    saved = []
    for obj, name, label in _phases(gen):
        fn = getattr(obj, name)
        saved.append((obj, name))
        setattr(obj, name, marked(fn, label))
    jobs = [Job(p, max_new_tokens=steps * 8, stop_at_eos=False, identifier=i) for i, p in enumerate(prompts)]
    for j in jobs:
        gen.enqueue(j)
    for _ in range(4):  # prefill and the first steps outside the window
        gen.iterate()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            gen.iterate()
        torch.cuda.synchronize()
    for obj, name in saved:
        delattr(obj, name)  # back to the class's method
    while gen.num_remaining():
        gen.iterate()
    if out is not None:
        prof.export_chrome_trace(str(out / "spec_trace.json"))
    _report(prof.profiler.kineto_results.events(), len(prompts))


def _report(events, batch: int) -> None:
    """Device busy and idle time per generator step from profiler (kineto) events: the idle gaps with the host
    phase running at each one's start, and the device time by the host phase that launched it and by kernel."""
    host = [(e.start_ns(), e.end_ns(), e.name()[6:]) for e in events if e.name().startswith("phase:")]
    steps_iv = sorted((s, t) for s, t, n in host if n == "gen_step")
    # kernels and copies only: the phases' own ranges also appear on the device's timeline (as annotations)
    dev = [e for e in events if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0
           and not e.name().startswith("phase:")]
    if not dev or not steps_iv:
        print("no device activity recorded")
        return
    t0, t1 = steps_iv[0][0], steps_iv[-1][1]
    dev = [e for e in dev if t0 <= e.start_ns() <= t1]
    n = len(steps_iv)

    def phase_at(t: float) -> str:
        inner = [(e - s, name) for s, e, name in host if s <= t <= e]
        return min(inner)[1] if inner else "(none)"

    iv = sorted((e.start_ns(), e.end_ns()) for e in dev)
    busy, idle = 0, []
    cur_s, cur_e = iv[0]
    for s, e in iv[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            idle.append((cur_e, s))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    ms = 1e6 * n  # ns -> ms per step
    print(f"\ntimeline over {n} generator steps (b={batch}): {(t1 - t0) / ms:.3f} ms wall a step, device busy "
          f"{busy / ms:.3f} ms, idle {sum(e - s for s, e in idle) / ms:.3f} ms in {len(idle) / n:.1f} gaps")
    by_phase: dict[str, float] = {}
    for s, e in idle:
        k = phase_at(s)
        by_phase[k] = by_phase.get(k, 0.0) + (e - s)
    print("device idle a step, by the innermost host phase at the gap's start:")
    for k, v in sorted(by_phase.items(), key=lambda x: -x[1]):
        print(f"  {k:14s} {v / ms:.3f} ms")
    print("longest gaps (us, host phase):",
          ", ".join(f"{(e - s) / 1e3:.0f} {phase_at(s)}" for s, e in sorted(idle, key=lambda x: x[0] - x[1])[:12]))
    # device time by the phase whose host code launched it (runtime calls share a correlation id with their work)
    launch = {e.correlation_id(): e.start_ns() for e in events
              if e.device_type() == torch.autograd.DeviceType.CPU and e.name().startswith("cu")}
    by_launch: dict[str, list[float]] = {}
    for e in dev:
        t = launch.get(e.correlation_id())
        k = phase_at(t) if t is not None else "(unmatched)"
        by_launch.setdefault(k, [0, 0.0])
        by_launch[k][0] += 1
        by_launch[k][1] += e.duration_ns()
    print("device time a step (sum of durations), by the innermost host phase that launched it:")
    for k, (c, d) in sorted(by_launch.items(), key=lambda x: -x[1][1]):
        print(f"  {k:14s} {d / ms:.3f} ms in {c / n:.1f} kernels/copies")
    by_name: dict[str, list[float]] = {}
    for e in dev:
        by_name.setdefault(e.name()[:90], [0, 0.0])
        by_name[e.name()[:90]][0] += 1
        by_name[e.name()[:90]][1] += e.duration_ns()
    print("device time a step by kernel (top 25):")
    for k, (c, d) in sorted(by_name.items(), key=lambda x: -x[1][1])[:25]:
        print(f"  {d / ms:8.3f} ms {c / n:6.1f}x  {k}")


if __name__ == "__main__":
    main()
