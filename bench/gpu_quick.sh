#!/usr/bin/env bash
# Shorter device call than gpu_all.sh: build, the fused-linear and graph tests, GEMM timings
# (MUL1/3INST K=4), the engine bench for both shapes, and a timed GPU conversion of the 8b shape
# (first N blocks; the script extrapolates to full depth). Usage: bash bench/gpu_quick.sh [N]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
for p in arch_llama:llama arch_qwen:qwen attn_backends:attn_backends; do
  dir=${p%%:*}; ep=${p##*:}; pkg=exl3_$dir
  di=/tmp/site/${pkg}-0.1.0.dist-info; mkdir -p $di
  printf 'Metadata-Version: 2.1\nName: %s\nVersion: 0.1.0\n' "${pkg//_/-}" > $di/METADATA
  printf '[exl3]\n%s = %s.plugin\n' "$ep" "$pkg" > $di/entry_points.txt
done
export PYTHONPATH=$PWD:$PWD/plugins/attn_backends/src:$PWD/plugins/arch_llama/src:$PWD/plugins/arch_qwen/src:/tmp/site
t=$(date +%s)
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build $(( $(date +%s) - t )) s"
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
