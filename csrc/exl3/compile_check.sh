#!/usr/bin/env bash
# Compile-only check of the csrc/exl3 CUDA sources on a machine with nvcc but no GPU (or a CPU-only
# torch, whose setup.py build skips *.cu). Run from anywhere: bash csrc/exl3/compile_check.sh [--all]
#  1. exl3_recon_full.cuh alone (all 48 K x codebook x output-type kernels, no torch) for sm_90, with the ptxas
#     register / shared memory / spill report per instantiation
#  2. the torch bindings exl3_ops.cu with torch's include paths
#  3. with --all: exl3_cb{0,1,2}.cu and exl3_had.cu too (every kernel; several minutes on 2 cores),
#     then all five objects linked into one shared object (catches symbols defined in two units)
# Flags follow setup.py (--use_fast_math included).
set -euo pipefail
cd "$(dirname "$0")/../.."
source csrc/compile_env.sh  # $OUT, $NVCC, $FLAGS, $INC (torch include paths, stubs where needed)

echo "== 1. exl3_recon_full.cuh standalone"
cat > "$OUT/rf.cu" <<'CU'
#include "exl3/exl3_recon_full.cuh"
namespace exl3 {
#define RF_INST(CB) template cudaError_t dispatch_recon_full<CB>(int, const uint32_t*, const __half*, const __half*, \
                                                                  void*, bool, int, int, long, cudaStream_t);
RF_INST(0) RF_INST(1) RF_INST(2)
}
CU
"$NVCC" "${FLAGS[@]}" -Xptxas -v -c "$OUT/rf.cu" -o "$OUT/rf.o" 2>&1 \
  | grep -E "error|Used|spill|Compiling entry" | sed -E 's/ptxas info *: //' \
  | paste - - - | sed -E "s/Compiling entry function .?_ZN4exl3[0-9]+recon_full_(half_)?kernelILi([0-9])ELi([0-9])ELb([01])EE\S*/\1K=\2 cb=\3 bf16=\4/; s/Function properties for \S+//"
echo "(dynamic shared memory per CTA, set at launch: 67584 bytes fp32 kernel, 35328 bytes half_ kernel)"

echo "== 2. torch bindings"
# torch's headers warn under -std=c++17 (setup.py's flag): show the log only on failure
"$NVCC" "${FLAGS[@]}" -Xcompiler -fPIC $INC -DTORCH_EXTENSION_NAME=_C -c csrc/exl3/exl3_ops.cu -o "$OUT/ops.o" > "$OUT/ops.log" 2>&1 \
  || { cat "$OUT/ops.log"; exit 1; }
echo "ok csrc/exl3/exl3_ops.cu"
if [[ "${1:-}" == "--all" ]]; then
  echo "== 3. kernel instantiation units"
  for f in csrc/exl3/exl3_cb0.cu csrc/exl3/exl3_cb1.cu csrc/exl3/exl3_cb2.cu csrc/exl3/exl3_had.cu; do
    "$NVCC" "${FLAGS[@]}" -Xcompiler -fPIC -c "$f" -o "$OUT/$(basename "$f").o"
    echo "ok $f"
  done
  "$NVCC" -shared -o "$OUT/link_check.so" "$OUT/ops.o" "$OUT"/exl3_cb0.cu.o "$OUT"/exl3_cb1.cu.o "$OUT"/exl3_cb2.cu.o \
    "$OUT"/exl3_had.cu.o
  echo "ok linked"
fi
echo "all compiled"
