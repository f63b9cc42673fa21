#!/usr/bin/env bash
# Device script: build bench/gemv_tune.cu (seconds) from the product's kernels and csrc/exl3/tuning.cuh,
# time it, then profile the m = 1 fused linear and the decode-only kernel with ncu (stall reasons, pipe
# utilisation, occupancy) when ncu is present. Run from the repo root:
#   bash bench/gemv_tune.sh [kt ...]            # k tiles per chunk to time besides the launcher's pick (0)
# TUNE_K / TUNE_CB (default 4 / 2 = MUL1) pick the bits and codebook at build time; the harness's run-time
# variables (TUNE_SHAPES, TUNE_CHAIN, TUNE_M, TUNE_XH, TUNE_PREDECODE, TUNE_PD_MAX_KT) pass through.
# Tables go to stdout and $OUT/gemv_tune.txt, ncu to $OUT/ncu_*.txt, the SASS to $OUT/gemv_tune.sass.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bin=/tmp/gemv_tune_${TUNE_K:-4}_${TUNE_CB:-2}
nvcc -std=c++17 -O3 -arch=sm_90 --use_fast_math --expt-relaxed-constexpr -Icsrc -Ibench/ext \
  -DTUNE_K="${TUNE_K:-4}" -DTUNE_CB="${TUNE_CB:-2}" bench/gemv_tune.cu -o "$bin" || exit 1
timeout 120 "$bin" "${@:-0}" 2>&1 | tee "$OUT/gemv_tune.txt"
command -v cuobjdump > /dev/null && cuobjdump -sass "$bin" > "$OUT/gemv_tune.sass" 2>&1
if command -v ncu > /dev/null; then
  M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
  P='smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__occupancy_limit_registers,sm__maximum_warps_per_active_cycle_pct'
  for kern in fused_linear decode_only; do
    timeout 120 ncu --clock-control none -k regex:$kern --launch-skip 3 --launch-count 1 --metrics "$M,$P" \
      "$bin" 0 > "$OUT/ncu_$kern.txt" 2>&1
    echo "== ncu $kern (the first shape, m = 1)"
    grep -E "^\s+(smsp|sm__|gpu__|dram|launch)" "$OUT/ncu_$kern.txt" | awk '{print $1, $(NF)}' | grep -v " 0$\| 0,00$" | head -40
  done
fi
