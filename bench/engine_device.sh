#!/usr/bin/env bash
# One device call for the engine work: build the extension, run the GPU engine tests, then
# `exl3 bench` for the named shapes. Logs and JSON go to $OUT. Run from the repo root with `.whl`
# carried (see /work/shared/device/wheels.sh). Usage: bash bench/engine_device.sh [shapes...]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# the attention-backend plugin from the source tree, visible as an entry point without pip/hatchling
di=/tmp/site/exl3_attn_backends-0.1.0.dist-info; mkdir -p $di
printf 'Metadata-Version: 2.1\nName: exl3-attn-backends\nVersion: 0.1.0\n' > $di/METADATA
printf '[exl3]\nattn_backends = exl3_attn_backends.plugin\n' > $di/entry_points.txt
export PYTHONPATH=$PWD:$PWD/plugins/attn_backends/src:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
t=$(date +%s)
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
if ! python3 -c "from exl3_core import ext; assert ext.has_op('exl3_gemm') and ext.has_op('decode_bench')"; then
  # another engineer's in-progress sources may not compile yet: build the EXL3 kernels alone (device copy only)
  echo "full build lacks the EXL3 ops; rebuilding without csrc/quant"; tail -5 "$OUT/build.log"
  rm -rf csrc/quant build; TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 setup.py build_ext --inplace > "$OUT/build2.log" 2>&1
fi
echo "build $(( $(date +%s) - t )) s"
timeout 240 python3 -m pytest -q -x tests/gpu/test_graph_decode.py tests/core/test_memory.py tests/core/test_bench.py 2>&1 | tee "$OUT/tests.log" | tail -25
[ "${1:-}" = "--no-bench" ] && exit 0
for s in "${@:-1b 8b}"; do
  for shape in $s; do
    echo "== bench $shape"
    timeout 200 python3 -m exl3_core bench --shape "$shape" --profile --vs-transformers --json "$OUT/bench_$shape.json" 2>&1 \
      | grep -v 'USDT\|FutureWarning\|forward_call' | tee "$OUT/bench_$shape.log"
  done
done
