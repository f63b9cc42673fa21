#!/usr/bin/env bash
# Device script: compile bench/recon_tune.cu for the fp32 recon_full kernel (H=0: EXL3_RF_HALF_MAX_K=0)
# and the half2 kernel (H=1: EXL3_RF_HALF_MAX_K=8; at 5 and at 6 CTAs/SM, 6 spills ~40 B per thread),
# run each: us per launch vs the memory floor, and the error vs a double-precision reference, for
# 4096x14336, 14336x4096, 4096x4096 (K=4, MUL1 and 3INST). Usage: bash bench/recon_tune.sh [H:B ...]
# (H = 0 fp32 / 1 half2, B = EXL3_RF_HALF_MINB; default variants 0:5 1:5 1:6). Output to stdout and
# $OUT/recon_tune.txt; with ncu present, a short profile of each binary's 14336x4096 MUL1 launch.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
FLAGS=(-std=c++17 -O3 -arch=sm_90 --use_fast_math --expt-relaxed-constexpr -Icsrc)
variants=("$@")
[ ${#variants[@]} -eq 0 ] && variants=(0:5 1:5 1:6)
for v in "${variants[@]}"; do
  IFS=: read -r H B <<< "$v"; B=${B:-5}
  bin=/tmp/recon_tune_${H}_${B}
  nvcc "${FLAGS[@]}" -DEXL3_RF_HALF_MAX_K=$((H * 8)) -DEXL3_RF_HALF_MINB=$B bench/recon_tune.cu -o $bin 2> /tmp/nvcc_err.txt \
    || { cat /tmp/nvcc_err.txt | tee -a "$OUT/recon_tune.txt"; continue; }
  echo "== half2=$H EXL3_RF_HALF_MINB=$B" | tee -a "$OUT/recon_tune.txt"
  timeout 300 $bin 2>&1 | tee -a "$OUT/recon_tune.txt"
done
if command -v ncu > /dev/null; then
  P='gpu__time_duration.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__sass_inst_executed_op_local_ld.sum'
  for v in "${variants[@]}"; do
    IFS=: read -r H B <<< "$v"; B=${B:-5}
    bin=/tmp/recon_tune_${H}_${B}; [ -x $bin ] || continue
    # the 4th launch: past the accuracy launch, a warm-up one
    timeout 120 ncu --clock-control none -k regex:recon_full --launch-skip 3 --launch-count 1 --metrics "$P" \
      $bin 14336 4096 > "$OUT/ncu_recon_${H}_${B}.txt" 2>&1
    echo "== ncu half2=$H MINB=$B (14336x4096 MUL1)"
    grep -E "^\s+(smsp|sm__|gpu__|dram|launch|l1tex)" "$OUT/ncu_recon_${H}_${B}.txt" | awk '{print $1, $(NF)}'
  done
fi
