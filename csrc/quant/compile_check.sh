#!/usr/bin/env bash
# Compile-only check of the csrc/quant CUDA sources on a machine with nvcc but no GPU (or a CPU-only
# torch, whose setup.py build skips *.cu). Run from anywhere: bash csrc/quant/compile_check.sh
#  1. viterbi_cuda.cuh alone (kernel + launcher, no torch) for sm_90, with ptxas register/spill report
#  2. the torch bindings viterbi_cuda.cu and hessian_cuda.cu with torch's include paths
#  3. csrc/cpu/hessian.cpp (syntax) and the host emulator viterbi_emu.cc (g++)
# Flags follow setup.py (--use_fast_math included: the kernel must be exact under it).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
NVCC=${NVCC:-nvcc}
FLAGS=(-std=c++17 -arch=sm_90 -O3 --use_fast_math -lineinfo --expt-relaxed-constexpr -Icsrc)
INC=$(python -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I' + p for p in include_paths()))")

echo "== 1. viterbi_cuda.cuh standalone"
"$NVCC" "${FLAGS[@]}" -Xptxas -v -x cu -c csrc/quant/viterbi_cuda.cuh -o "$OUT/vk.o" 2>&1 \
  | grep -E "error|Used|spill|Compiling entry" | sed -E 's/ptxas info *: //' \
  | paste - - - | sed -E 's/Compiling entry function .(_ZN7exl3vit14viterbi_kernelILi([0-9])EEEvNS_4ArgsE)./K=\2/; s/Function properties for \S+//'
echo "== 2. torch bindings"
# A CPU-only torch wheel lacks the generated c10 CUDA config header: stub it (compile check only).
if ! python -c "import torch, os, sys; sys.exit(not os.path.exists(os.path.join(os.path.dirname(torch.__file__), 'include/c10/cuda/impl/cuda_cmake_macros.h')))"; then
  mkdir -p "$OUT/stub/c10/cuda/impl"
  echo '#define C10_CUDA_BUILD_SHARED_LIBS' > "$OUT/stub/c10/cuda/impl/cuda_cmake_macros.h"
  INC="$INC -I$OUT/stub"
  echo "(stubbed c10/cuda/impl/cuda_cmake_macros.h: CPU-only torch headers)"
fi
for f in csrc/quant/viterbi_cuda.cu csrc/quant/hessian_cuda.cu; do
  "$NVCC" "${FLAGS[@]}" $INC -DTORCH_EXTENSION_NAME=_C -c "$f" -o "$OUT/$(basename "$f").o"
  echo "ok $f"
done
echo "== 3. host sources"
g++ -std=c++17 -w -fsyntax-only $INC csrc/cpu/hessian.cpp && echo "ok csrc/cpu/hessian.cpp"
g++ -std=c++17 -O2 -ffp-contract=off -shared -fPIC -Icsrc/quant csrc/quant/viterbi_emu.cc -o "$OUT/emu.so" \
  && echo "ok csrc/quant/viterbi_emu.cc"
echo "all compiled"
