"""Golden-model quality over several seeds: exl3's conversion of a golden HF model scored with the
128-token KL of ``stats.json`` (tests/e2e/test_convert_golden.py's metric and calibration).

    python bench/golden_seeds.py model_a 4.0 0,1,2,3 '{"sequential": true}'

The last argument is a JSON object of extra ``convert()`` keywords (e.g. refit_scales,
refit_propagate, propagate, sequential). Prints one line per seed, then the mean and
ExLlamaV3's figure for the same model and bitrate.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from test_convert_golden import CAL, GOLDEN, REFERENCE, STATS, golden_kl  # noqa: E402

from exl3_core.convert.pipeline import convert  # noqa: E402


def main() -> None:
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    model, bpw, seeds = sys.argv[1], float(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")]
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    kls = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            out = Path(tmp) / f"{model}_{bpw}_{seed}"
            # extra keywords may override the test's calibration (e.g. cal_random)
            convert(GOLDEN / "hf" / model, out, bpw, progress=False, report=lambda s: None,
                    **{**CAL, "seed": seed, **extra})
            kl, top1 = golden_kl(out, model)
            kls.append(kl)
            print(f"{model} {bpw} bpw seed {seed} {extra}: KL {kl:.5f} (top-1 {top1:.3f})", flush=True)
    ref = STATS.get(REFERENCE.get((model, bpw), ""))
    theirs = f"{ref['mean_kl_hf_to_exl3']:.5f}" if ref else "no figure"
    print(f"mean {statistics.mean(kls):.5f} over {len(kls)} seeds | ExLlamaV3 {theirs}")


if __name__ == "__main__":
    main()
