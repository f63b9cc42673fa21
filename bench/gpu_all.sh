#!/usr/bin/env bash
# One device call that checks and times everything GPU-side: build the extension, run tests/gpu
# and the attention conformance suite on CUDA, then the kernel/encoder/engine benchmarks.
# Run from the repo root on the device with `.whl` carried (../shared/device/wheels.sh).
# Logs go to $OUT. Usage: bash bench/gpu_all.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# in-repo plugins from the source tree, visible as entry points without pip/hatchling
for p in arch_llama:llama arch_qwen:qwen attn_backends:attn_backends; do
  dir=${p%%:*}; ep=${p##*:}; pkg=exl3_$dir
  di=/tmp/site/${pkg}-0.1.0.dist-info; mkdir -p $di
  printf 'Metadata-Version: 2.1\nName: %s\nVersion: 0.1.0\n' "${pkg//_/-}" > $di/METADATA
  printf '[exl3]\n%s = %s.plugin\n' "$ep" "$pkg" > $di/entry_points.txt
done
export PYTHONPATH=$PWD:$PWD/plugins/attn_backends/src:$PWD/plugins/arch_llama/src:$PWD/plugins/arch_qwen/src:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
t=$(date +%s)
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build $(( $(date +%s) - t )) s"
t=$(date +%s)
timeout 260 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu tests/contract/test_attention.py \
  plugins/attn_backends/tests 2>&1 | tee "$OUT/tests.log" | grep -v "^SKIPPED" | tail -30
echo "tests $(( $(date +%s) - t )) s"
timeout 120 python3 bench/exl3_kernels.py --quick --skip reconstruct --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | tail -30
[ -f bench/viterbi_cuda.py ] && timeout 60 python3 bench/viterbi_cuda.py 2>&1 | tee "$OUT/viterbi.log" | tail -12
[ -f bench/fused_decode_gpu.py ] && timeout 60 python3 bench/fused_decode_gpu.py 2>&1 | tee "$OUT/fused.log" | tail -20
for shape in 8b 1b; do
  echo "== bench $shape"
  timeout 100 python3 -m exl3_core bench --shape "$shape" --codebook mul1 --json "$OUT/bench_$shape.json" 2>&1 \
    | grep -v 'USDT\|FutureWarning\|forward_call' | tee "$OUT/bench_$shape.log" | tail -14
done
