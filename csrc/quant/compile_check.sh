#!/usr/bin/env bash
# Compile-only check of the csrc/quant CUDA sources on a machine with nvcc but no GPU (or a CPU-only
# torch, whose setup.py build skips *.cu). Run from anywhere: bash csrc/quant/compile_check.sh
#  1. viterbi_cuda.cuh alone (kernel + launcher, no torch) for sm_90, with ptxas register/spill report
#  2. the torch bindings viterbi_cuda.cu and hessian_cuda.cu with torch's include paths
#  3. csrc/cpu/hessian.cpp (syntax) and the host emulator viterbi_emu.cc (g++)
# Flags follow setup.py (--use_fast_math included: the kernel must be exact under it).
set -euo pipefail
cd "$(dirname "$0")/../.."
source csrc/compile_env.sh  # $OUT, $NVCC, $FLAGS, $INC (torch include paths, stubs where needed)

echo "== 1. viterbi_cuda.cuh standalone"
"$NVCC" "${FLAGS[@]}" -Xptxas -v -x cu -c csrc/quant/viterbi_cuda.cuh -o "$OUT/vk.o" 2>&1 \
  | grep -E "error|Used|spill|Compiling entry" | sed -E 's/ptxas info *: //' \
  | paste - - - | sed -E 's/Compiling entry function .(_ZN7exl3vit14viterbi_kernelILi([0-9])EEEvNS_4ArgsE)./K=\2/; s/Function properties for \S+//'
echo "== 2. torch bindings"
for f in csrc/quant/viterbi_cuda.cu csrc/quant/hessian_cuda.cu; do
  "$NVCC" "${FLAGS[@]}" $INC -DTORCH_EXTENSION_NAME=_C -c "$f" -o "$OUT/$(basename "$f").o"
  echo "ok $f"
done
echo "== 3. host sources"
g++ -std=c++17 -w -fsyntax-only $INC csrc/cpu/hessian.cpp && echo "ok csrc/cpu/hessian.cpp"
g++ -std=c++17 -O2 -ffp-contract=off -shared -fPIC -Icsrc/quant csrc/quant/viterbi_emu.cc -o "$OUT/emu.so" \
  && echo "ok csrc/quant/viterbi_emu.cc"
echo "all compiled"
