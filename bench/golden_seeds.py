"""Golden-model quality over several seeds, on both metrics of tests/e2e/golden_quality.py: the
128-position KL of ``stats.json`` and the 4096-position held-out KL, beside ExLlamaV3's figures.

    python bench/golden_seeds.py model_a 4.0 0,1,2 '{"cal_cols": 128}'

The last argument is a JSON object of extra ``convert()`` keywords (none: the converter's defaults,
i.e. plain ``exl3 convert -b B``). Prints one line per seed (KL on both metrics and the wall time of
the conversion with the load average), then the means and ExLlamaV3's figures.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from golden_quality import GOLDEN, golden_kl, heldout_kl, reference_engine_kl  # noqa: E402

from exl3_core.convert.pipeline import convert  # noqa: E402


def main() -> None:
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    model, bpw, seeds = sys.argv[1], float(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")]
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    gs, hs = [], []
    ref_g, ref_h = reference_engine_kl(model, bpw)
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            out = Path(tmp) / f"{model}_{bpw}_{seed}"
            t0 = time.monotonic()
            convert(GOLDEN / "hf" / model, out, bpw, progress=False, report=lambda s: None, **{"seed": seed, **extra})
            secs = time.monotonic() - t0
            g, _ = golden_kl(out, model)
            h = heldout_kl(out, model)
            gs.append(g)
            hs.append(h)
            print(f"{model} {bpw} seed {seed} {extra}: golden {g:.4g} heldout {h:.4g} "
                  f"({secs:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
    theirs = f"{ref_g:.4g} / {ref_h:.4g}" if ref_g is not None else "no figure"
    print(f"MEAN {model} {bpw} {extra}: golden {statistics.mean(gs):.4g} heldout {statistics.mean(hs):.4g} over "
          f"{len(seeds)} seeds | ExLlamaV3 {theirs}", flush=True)


if __name__ == "__main__":
    main()
