#!/usr/bin/env bash
# Shorter device call than gpu_all.sh: build, the fused-linear and graph tests, GEMM timings
# (MUL1/3INST K=4), the engine bench for both shapes, and a timed GPU conversion of the 8b shape
# (first N blocks; the script extrapolates to full depth). Usage: bash bench/gpu_quick.sh [N]
set -uo pipefail
source bench/device_env.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_exl3_fused.py tests/gpu/test_graph_decode.py \
  tests/gpu/test_exl3_kernels.py 2>&1 | tail -15
timeout 100 python3 bench/exl3_kernels.py --quick --skip decode,reconstruct --json "$OUT/kernels.json" 2>&1 \
  | grep -v "kt_per_warp\|cuBLAS" | tail -14
for shape in 8b 1b; do
  echo "== bench $shape"
  timeout 100 python3 -m exl3_core bench --shape "$shape" --codebook mul1 --json "$OUT/bench_$shape.json" 2>&1 \
    | grep -v 'USDT\|FutureWarning\|forward_call' | tail -8
done
echo "== convert"
timeout 280 python3 bench/convert_gpu.py --shape 8b --layers "${1:-6}" --json "$OUT/convert.json" 2>&1 | grep -v broken | tail -14
