#!/usr/bin/env bash
# Compile-only check of the CUDA decode attention kernels on a machine with nvcc but no GPU, with setup.py's flags
# and torch's include paths, plus the ptxas register / spill report of every kernel instantiation:
# csrc/attn/decode_attn.cu (short bounds, fp16/bf16 and quantized caches) and csrc/attn/decode_attn_qsplit.cu (split
# decode over 4/8-bit quantized caches). Run from anywhere: bash csrc/attn/compile_check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
source csrc/compile_env.sh  # $OUT, $NVCC, $FLAGS, $INC (torch include paths, stubs where needed)
for src in decode_attn decode_attn_qsplit; do
  "$NVCC" "${FLAGS[@]}" -Xcompiler -fPIC $INC -DTORCH_EXTENSION_NAME=_C -Xptxas -v -c "csrc/attn/$src.cu" \
    -o "$OUT/$src.o" > "$OUT/log" 2>&1 || { grep -v "^ptxas info" "$OUT/log" | grep -B2 -A3 -i "error" | head -60; exit 1; }
  grep -E "Compiling entry|Used|spill" "$OUT/log" | sed -E 's/ptxas info *: //' | paste - - - \
    | sed -E 's/Compiling entry function .?_ZN9exl3_attn18decode_attn_kernelI(6__half|13__nv_bfloat16)Li([0-9]+)ELi([0-9]+)ELb([01])EEEv\S*/\1 D=\2 KW=\3 quant=\4/; s/Compiling entry function .?_ZN16exl3_attn_qsplit13qsplit_kernelILi([0-9]+)ELi([0-9]+)ELi([0-9]+)EEEvNS_10QSplitArgsEb\S*/qsplit D=\1 KB=\2 VB=\3/; s/Compiling entry function .?_ZN9exl3_attn25decode_attn_recent_kernelI(6__half|13__nv_bfloat16)Li([0-9]+)ELi([0-9]+)EEEv\S*/\1 D=\2 KW=\3 recent/; s/Compiling entry function .?_ZN16exl3_attn_qsplit20qsplit_recent_kernelILi([0-9]+)ELi([0-9]+)ELi([0-9]+)EEEvNS_10QSplitArgsEb\S*/qsplit D=\1 KB=\2 VB=\3 recent/; s/Function properties for \S+//'
  echo "ok csrc/attn/$src.cu"
done
