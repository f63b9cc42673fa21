"""CPU generation speed on an idle machine and beside busy processes: does it degrade with the load?

Runs ``exl3 generate`` (the embedded default model unless ``-m``) on the CPU with a fixed seed, first
alone, then while ``--busy`` background processes each spin one CPU (a ``yes > /dev/null``-style
loop that ends by itself after ``--busy-limit`` seconds and is killed when the runs are done). Prints
the decode rate of both (median of ``--repeats`` runs, from ``--stats``) and loaded / idle.

With N busy processes on C cores a well-behaved run keeps about C / (C + N) of its idle speed when it
uses every core, more with fewer threads; a run whose threads spin-wait or outnumber the cores
falls far below that.

Usage:
    python bench/cpu_threads.py [-m MODEL] [--busy 2] [--repeats 3] [--new-tokens 64]
        [--threads N] [--wait-policy PASSIVE|ACTIVE]

``--threads`` sets EXL3_NUM_THREADS and ``--wait-policy`` OMP_WAIT_POLICY for the runs (A/B against
exl3's own choice, which is what runs without them). OMP_NUM_THREADS is removed from the runs'
environment so that exl3's choice is the one measured.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
_RATE = re.compile(r"\btokens_per_s ([0-9.eE+-]+)")
_NEW = re.compile(r"\bnew_tokens (\d+)")
_THREADS = re.compile(r"\bthreads (\d+)")
_SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


def run_once(args: argparse.Namespace, env: dict[str, str]) -> tuple[float, int, str]:
    """One seeded ``exl3 generate`` on the CPU: (decode tok/s, new tokens, thread count). A run that
    outlasts ``--timeout`` counts as ``new_tokens / timeout``, an upper bound of its rate."""
    cmd = [sys.executable, "-m", "exl3_core", "generate", PROMPT, "--device", "cpu", "--seed", str(args.seed),
           "--max-new-tokens", str(args.new_tokens), "--stats"]
    if args.model is not None:
        cmd += ["--model", str(args.model)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        return args.new_tokens / args.timeout, args.new_tokens, "? (timed out: at most this rate)"
    if out.returncode != 0:
        raise SystemExit(f"cpu_threads: exl3 generate failed ({out.returncode}):\n{out.stderr[-2000:]}")
    rate, new, threads = _RATE.search(out.stderr), _NEW.search(out.stderr), _THREADS.search(out.stderr)
    if rate is None or new is None:
        raise SystemExit(f"cpu_threads: no statistics in exl3 generate's output:\n{out.stderr[-2000:]}")
    return float(rate.group(1)), int(new.group(1)), threads.group(1) if threads else "?"


def measure(args: argparse.Namespace, env: dict[str, str], label: str) -> float:
    rates = []
    for i in range(args.repeats):
        r, n, th = run_once(args, env)
        rates.append(r)
        print(f"  {label} run {i + 1}: {r:.2f} tok/s ({n} tokens, {th} threads)", flush=True)
    return statistics.median(rates)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, default=None, help="model folder (default: the embedded model)")
    ap.add_argument("--busy", type=int, default=2, help="busy background processes during the loaded runs")
    ap.add_argument("--busy-limit", type=float, default=600.0,
                    help="seconds after which a busy process ends by itself even if this script dies")
    ap.add_argument("--repeats", type=int, default=3, help="runs per condition (the median is reported)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run")
    ap.add_argument("--seed", type=int, default=7, help="sampling seed (the same run idle and loaded)")
    ap.add_argument("--threads", type=int, default=None, help="EXL3_NUM_THREADS for the runs (default: unset)")
    ap.add_argument("--wait-policy", default=None, help="OMP_WAIT_POLICY for the runs (default: exl3's)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds one run may take; a slower run is reported at this upper-bound rate")
    args = ap.parse_args()
    if args.repeats < 1 or args.busy < 0:
        ap.error("--repeats must be >= 1 and --busy >= 0")

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["EXL3_NO_PROGRESS"] = "1"
    if args.threads is not None:
        env["EXL3_NUM_THREADS"] = str(args.threads)
    if args.wait_policy is not None:
        env["OMP_WAIT_POLICY"] = args.wait_policy
    print(f"cpus {os.cpu_count()}, load average before {os.getloadavg()[0]:.2f}", flush=True)
    idle = measure(args, env, "idle")
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN, str(args.busy_limit)], stdout=subprocess.DEVNULL)
             for _ in range(args.busy)]
    try:
        time.sleep(1.0)  # let the scheduler spread them over the cores
        loaded = measure(args, env, f"{args.busy} busy")
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
    print(f"idle {idle:.2f} tok/s, with {args.busy} busy processes {loaded:.2f} tok/s, "
          f"ratio {loaded / idle:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
