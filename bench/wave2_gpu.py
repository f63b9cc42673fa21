"""``python bench/wave2_gpu.py summary DIR [SHAPE]``: the A/B of ``bench/wave2_gpu.sh ab SHAPE`` side by side
(every shape found in DIR, or SHAPE's alone).

Reads ``ab_<shape>_<base|head><round>.json`` (``exl3 bench --json`` of each tree and round) and prints, per
decode row (batch, context) and for the prefill, the median over rounds of each tree, HEAD's ratio to the
baseline and whether it is within the 2% the execution-plan work must hold."""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

TOLERANCE = 0.02


def _figures(doc: dict) -> dict[str, float]:
    """``label -> tok/s`` of one bench JSON: each decode row and the headline prefill."""
    out = {}
    for r in doc.get("decode", []):
        cache = f" {r['cache']}" if r.get("cache") not in (None, "fp16") else ""
        out[f"decode b={r['batch']} ctx={r['ctx']}{cache}"] = r["tok_s"]
    p = doc.get("prefill")
    if p and "tok_s" in p:
        out[f"prefill {p.get('tokens', '')}".rstrip()] = p["tok_s"]
    return out


def summary(folder: Path, only: str | None = None) -> list[str]:
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for f in sorted(folder.glob("ab_*_*.json")):
        m = re.fullmatch(r"ab_(\w+?)_(base|head)\d+\.json", f.name)
        if m:
            runs.setdefault((m[1], m[2]), []).append(_figures(json.loads(f.read_text())))
    lines = []
    for shape in sorted({s for s, _ in runs if only is None or s == only}):
        base, head = runs.get((shape, "base"), []), runs.get((shape, "head"), [])
        lines.append(f"{shape}: {len(base)} baseline and {len(head)} HEAD runs (medians, tok/s)")
        for label in (base or head or [{}])[0]:
            b = [r[label] for r in base if label in r]
            h = [r[label] for r in head if label in r]
            if not b or not h:
                continue
            mb, mh = statistics.median(b), statistics.median(h)
            ok = "ok" if mh >= (1 - TOLERANCE) * mb else "SLOWER"
            lines.append(f"  {label:<28} base {mb:10.1f}  head {mh:10.1f}  {mh / mb:6.3f}x  {ok}")
    return lines


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[1] != "summary":
        sys.exit("usage: python bench/wave2_gpu.py summary DIR [SHAPE]")
    print("\n".join(summary(Path(sys.argv[2]), sys.argv[3] if len(sys.argv) == 4 else None)))
