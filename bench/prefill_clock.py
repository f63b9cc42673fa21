"""Device script: does a long prefill run slower back to back than from an idle GPU (clock/power)?

Times one replayed 2048-token prefill of the random-weight 8B-shape model (the generator's graph
path, as ``exl3 bench``) two ways: back to back (20 replays after 2 warm-ups; `exl3 bench` takes the median of 5)
and each replay after ``--idle`` seconds of an idle GPU. ``nvidia-smi`` samples the SM clock and power
draw every 50 ms meanwhile; the script prints the median SM clock and power seen during each phase.

    python bench/prefill_clock.py [--shape 8b] [--tokens 2048] [--idle 1.0]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from exl3_core.bench.models import build_model, parse_shape
from exl3_core.bench.run import prefill_meta, time_median
from exl3_core.generator.graphs import PrefillGraphs
from exl3_core.plan import ExecutionPlan

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; only read by type checkers here

# nvidia-smi's clock event (throttle) reason bits, as its documentation lists them
_REASONS = {0x1: "idle", 0x2: "app clocks", 0x4: "SW power cap", 0x8: "HW slowdown", 0x10: "sync boost",
            0x20: "SW thermal", 0x40: "HW thermal", 0x80: "HW power brake", 0x100: "display clocks"}
# the first query this driver accepts: with the reason mask, power limit and temperature, else the basic one
_QUERIES = ("timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active,power.limit,temperature.gpu",
            "timestamp,clocks.sm,power.draw")


def _samples(path: Path, windows: list[tuple[float, float]]) -> tuple[float, float, str]:
    """Median SM clock (MHz) and power (W) of the nvidia-smi rows logged inside any of ``windows``
    (epoch seconds), and the clock event reasons, power limit and temperatures seen there."""
    from datetime import datetime

    rows, mask, limits, temps = [], 0, set(), []
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            ts = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            clk, pw = float(parts[1].split()[0]), float(parts[2].split()[0])
        except (ValueError, IndexError):
            continue
        if not any(a <= ts <= b for a, b in windows):
            continue
        rows.append((clk, pw))
        if len(parts) >= 6:
            try:
                mask |= int(parts[3], 16)
                limits.add(parts[4])
                temps.append(float(parts[5]))
            except ValueError:
                pass
    if not rows:
        return float("nan"), float("nan"), ""
    extra = ""
    if limits:
        names = [n for bit, n in _REASONS.items() if mask & bit] or ["none"]
        extra = (f"; clock event reasons {', '.join(names)} (mask {mask:#x}); power limit {'/'.join(sorted(limits))}; "
                 f"temperature {min(temps):.0f}-{max(temps):.0f} C")
    return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows), extra


def _query() -> str:
    """The richest nvidia-smi query this driver answers."""
    for q in _QUERIES:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True, check=False)
        if r.returncode == 0 and "not a valid field" not in r.stdout + r.stderr:
            return q
    return _QUERIES[-1]


class SmiLog:
    """nvidia-smi sampled every 50 ms into a temporary file while the context is open; ``phase(windows)``
    summarises the rows inside the given (start, end) epoch-second windows (:func:`_samples`)."""

    def __enter__(self) -> Self:
        self.path = Path(tempfile.mkdtemp()) / "smi.csv"
        self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={_query()}", "--format=csv,noheader", "-lms", "50"],
                                     stdout=self.path.open("w"), stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.2)  # the last sample of the last window
        self.proc.terminate()
        self.proc.wait()

    def phase(self, windows: list[tuple[float, float]]) -> tuple[float, float, str]:
        return _samples(self.path, windows)


def back_to_back_and_idle(replay_ms: Callable[[], float], idle: float, runs: int = 20,
                          idle_runs: int = 7) -> list[tuple[str, list[float], tuple[float, float, str]]]:
    """``replay_ms()`` timed ``runs`` times back to back (after 2 warm-ups), then ``idle_runs`` times each after
    ``idle`` seconds of idle GPU, with nvidia-smi logged: ``[(phase name, ms list, (MHz, W, reasons))]``."""
    with SmiLog() as smi:
        for _ in range(2):
            replay_ms()
        t0 = time.time()
        b2b = [replay_ms() for _ in range(runs)]
        t1 = time.time()
        time.sleep(3.0)
        idle_ms, windows = [], []
        for _ in range(idle_runs):
            time.sleep(idle)
            t = time.time()
            idle_ms.append(replay_ms())
            windows.append((t, time.time()))
    return [("back to back", b2b, smi.phase([(t0, t1)])), (f"after {idle:.1f} s idle", idle_ms, smi.phase(windows))]


def prefill_args(extra: bool = False) -> argparse.Namespace:
    """``--shape`` (default 8b), ``--tokens`` (2048) and ``--idle`` (seconds, 1.0): the prefill scripts' options;
    with ``extra`` also prefill_gemm_bound.py's ``--dtype``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--idle", type=float, default=1.0)
    if extra:
        ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    return ap.parse_args()


def main() -> None:
    args = prefill_args()
    model, cache = build_model(parse_shape(args.shape), bpw=4.0, head_bits=6, codebook="mul1", device="cuda",
                               cache_tokens=2 * args.tokens + 1024)
    pages = cache.allocator.allocate(-(-args.tokens // cache.page_size))
    meta = prefill_meta(model, cache, args.tokens, pages)
    graphs = PrefillGraphs.create(ExecutionPlan(model), cache, len(pages), args.tokens)
    assert graphs is not None, "prefill graphs declined"
    ids = meta.input_ids.tolist()

    def run() -> None:
        graphs.run(ids, pages)

    def replay_ms() -> float:  # one replay by CUDA events
        return time_median(run, model.device, warmup=0, iters=1) * 1e3

    phases = back_to_back_and_idle(replay_ms, args.idle)
    n = args.tokens
    for name, ms, (clk, pw, ex) in phases:
        med = statistics.median(ms)
        print(f"{args.shape} prefill {n} (graph) {name}: median {med:.2f} ms = {n / med * 1e3:,.0f} tok/s "
              f"(min {min(ms):.2f}, max {max(ms):.2f}); nvidia-smi median over the phase: SM {clk:.0f} MHz, {pw:.0f} W{ex}")
    cache.allocator.release(pages)
    model.unload()


if __name__ == "__main__":
    main()
