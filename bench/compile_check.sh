#!/usr/bin/env bash
# Compile-only check of the bench/ CUDA sources on a machine with nvcc but no GPU: the standalone harnesses
# gemv_tune.cu and recon_tune.cu (built and linked, as their device scripts do) and the bench extension's op
# (bench/ext/decode_only_op.cu, with torch's include paths). Run from anywhere: bash bench/compile_check.sh
# Flags follow setup.py's; NVCC picks the compiler (default nvcc).
set -euo pipefail
cd "$(dirname "$0")/.."
source csrc/compile_env.sh  # $OUT, $NVCC, $FLAGS, $INC
"$NVCC" "${FLAGS[@]}" -Ibench/ext bench/gemv_tune.cu -o "$OUT/gemv_tune"
echo "ok bench/gemv_tune.cu"
"$NVCC" "${FLAGS[@]}" bench/recon_tune.cu -o "$OUT/recon_tune"
echo "ok bench/recon_tune.cu"
"$NVCC" "${FLAGS[@]}" -Xcompiler -fPIC $INC -Ibench/ext -DTORCH_EXTENSION_NAME=exl3_bench \
  -c bench/ext/decode_only_op.cu -o "$OUT/decode_only_op.o" > "$OUT/ext.log" 2>&1 || { cat "$OUT/ext.log"; exit 1; }
echo "ok bench/ext/decode_only_op.cu"
