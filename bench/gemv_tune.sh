#!/usr/bin/env bash
# Device script: compile and time variants of the one-launch EXL3 linear (bench/gemv_tune.cu; each
# build takes seconds), then ncu of the baseline fused kernel and of the decode-only kernel
# (stall reasons, pipe utilisation, occupancy). Usage: bash bench/gemv_tune.sh [S[:B[:T[:W]]] ...]
# (S: EXL3_RING_STAGES = k tiles in flight per warp, 0 = the per-K default ring_stages(K), B = EXL3_FUSED_MINB (m16 kernel, 0 = ptxas
# decides), T = EXL3_FUSED_TR_MINB (transposed m <= 8 kernel, default 15), W = EXL3_GEMM_WARPS (4 or 8;
# n tiles per warp = 8 / W); default variants: 4 5 6). Tables go to stdout and $OUT/gemv_tune.txt, ncu
# to $OUT/ncu_*.txt, the fused kernel's SASS to $OUT/sass_<variant>.txt. NCU_VARIANT=S:B:T:W picks the
# binary ncu looks at.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
FLAGS=(-std=c++17 -O3 -arch=sm_90 --use_fast_math --expt-relaxed-constexpr -Icsrc)
variants=("$@")
[ ${#variants[@]} -eq 0 ] && variants=(4 5 6)
binof() {  # variant S[:B[:T[:W]]] -> "S B T W binary"
  IFS=: read -r S B T W <<< "$1"; B=${B:-0}; T=${T:-15}; W=${W:-4}
  echo "$S $B $T $W /tmp/gemv_tune_${S}_${B}_${T}_${W}"
}
for v in "${variants[@]}"; do
  read -r S B T W bin <<< "$(binof "$v")"
  nvcc "${FLAGS[@]}" -DEXL3_RING_STAGES=$S -DEXL3_FUSED_MINB=$B -DEXL3_FUSED_TR_MINB=$T -DEXL3_GEMM_WARPS=$W bench/gemv_tune.cu \
    -o $bin 2> /tmp/nvcc_err.txt || { cat /tmp/nvcc_err.txt | tee -a "$OUT/gemv_tune.txt"; continue; }
  echo "== EXL3_RING_STAGES=$S EXL3_FUSED_MINB=$B EXL3_FUSED_TR_MINB=$T EXL3_GEMM_WARPS=$W" | tee -a "$OUT/gemv_tune.txt"
  timeout 60 $bin 0 8 16 24 32 2>&1 | tee -a "$OUT/gemv_tune.txt"
  command -v cuobjdump > /dev/null && cuobjdump -sass $bin > "$OUT/sass_${S}_${B}_${T}_${W}.txt" 2>&1
done
read -r _ _ _ _ NCU_BIN <<< "$(binof "${NCU_VARIANT:-6}")"
if command -v ncu > /dev/null && [ -x $NCU_BIN ]; then
  M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
  P='smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fmaheavy_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__occupancy_limit_registers,sm__maximum_warps_per_active_cycle_pct'
  for kern in fused_linear gemm_kernel; do
    timeout 120 ncu --clock-control none -k regex:$kern --launch-skip 3 --launch-count 1 --metrics "$M,$P" \
      $NCU_BIN 0 > "$OUT/ncu_$kern.txt" 2>&1
    echo "== ncu $kern (4096x14336 MUL1 K=4 m=1)"
    grep -E "^\s+(smsp|sm__|gpu__|dram|launch)" "$OUT/ncu_$kern.txt" | awk '{print $1, $(NF)}' | grep -v " 0$\| 0,00$" | head -40
  done
fi
