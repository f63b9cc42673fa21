#!/usr/bin/env bash
# Device script: build bench/recon_tune.cu (seconds) and time the W rebuild of the prefill path, the fp32
# and the half2 kernel side by side: us per launch against the memory floor, and the error against a
# double-precision reference, for 4096x14336, 14336x4096, 4096x4096 (K = 4, MUL1 and 3INST). With ncu
# present, a short profile of each kernel's 14336x4096 MUL1 launch. Run from the repo root:
#   bash bench/recon_tune.sh
# Output to stdout and $OUT/recon_tune.txt (ncu: $OUT/ncu_recon_*.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bin=/tmp/recon_tune
nvcc -std=c++17 -O3 -arch=sm_90 --use_fast_math --expt-relaxed-constexpr -Icsrc bench/recon_tune.cu -o $bin || exit 1
timeout 300 $bin 2>&1 | tee "$OUT/recon_tune.txt"
if command -v ncu > /dev/null; then
  P='gpu__time_duration.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__sass_inst_executed_op_local_ld.sum'
  for kern in recon_full_kernel recon_full_half_kernel; do
    # the 4th launch of that kernel: past the accuracy launch and a warm-up
    timeout 120 ncu --clock-control none -k regex:"$kern" --launch-skip 3 --launch-count 1 --metrics "$P" \
      $bin 14336 4096 > "$OUT/ncu_$kern.txt" 2>&1
    echo "== ncu $kern (14336x4096 MUL1)"
    grep -E "^\s+(smsp|sm__|gpu__|dram|launch|l1tex)" "$OUT/ncu_$kern.txt" | awk '{print $1, $(NF)}'
  done
fi
