#!/usr/bin/env bash
# One device call that checks and times everything GPU-side: build the extension (device_env.sh) and the
# bench extension (with its check), run tests/gpu, the attention contract and the plugin tests on CUDA, then
# the kernel, encoder and engine benchmarks. Run from the repo root on the device with `.whl` carried
# (../shared/device/wheels.sh). Logs go to $OUT. Usage: bash bench/gpu_all.sh
set -uo pipefail
source bench/device_env.sh
env ${cc:+CC=$cc} ${cxx:+CXX=$cxx} TORCH_CUDA_ARCH_LIST=9.0 python3 bench/ext/build.py --check 2>&1 | tee "$OUT/bench_ext.log" | tail -5
t=$(date +%s)
timeout 400 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu tests/contract/test_attention.py \
  plugins/attn_backends/tests 2>&1 | tee "$OUT/tests.log" | grep -v "^SKIPPED" | tail -30
echo "tests $(( $(date +%s) - t )) s"
timeout 120 python3 bench/exl3_kernels.py --quick --skip reconstruct --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | tail -30
timeout 60 python3 bench/viterbi_cuda.py 2>&1 | tee "$OUT/viterbi.log" | tail -12
for shape in 8b 1b; do
  echo "== bench $shape"
  timeout 150 python3 -m exl3_core bench --shape "$shape" --codebook mul1 --json "$OUT/bench_$shape.json" 2>&1 \
    | grep -v 'USDT\|FutureWarning\|forward_call' | tee "$OUT/bench_$shape.log" | tail -14
done
