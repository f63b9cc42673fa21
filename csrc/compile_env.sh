# Shared set-up of the compile-only checks (csrc/exl3/compile_check.sh, csrc/quant/compile_check.sh),
# sourced from the repository root: a temporary $OUT, $NVCC, setup.py's nvcc $FLAGS, and torch's
# include paths in $INC, with stubs for what a CPU-only torch wheel or a toolkit without the CUDA
# math libraries lacks (compile checks only; nothing here is linked).
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
NVCC=${NVCC:-nvcc}
FLAGS=(-std=c++17 -arch=sm_90 -O3 --use_fast_math -lineinfo --expt-relaxed-constexpr -Icsrc)
# torch's CUDAExtension adds these (no implicit half/bf16 conversions): a check without them passes code
# the real build refuses
FLAGS+=($(python3 -c "from torch.utils.cpp_extension import COMMON_NVCC_FLAGS as f; print(' '.join(f))"))
INC=$(python3 -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I' + p for p in include_paths()))")
# a CPU-only torch wheel lacks the generated c10 CUDA config header
if ! python3 -c "import torch, os, sys; sys.exit(not os.path.exists(os.path.join(os.path.dirname(torch.__file__), 'include/c10/cuda/impl/cuda_cmake_macros.h')))"; then
  mkdir -p "$OUT/stub/c10/cuda/impl"
  echo '#define C10_CUDA_BUILD_SHARED_LIBS' > "$OUT/stub/c10/cuda/impl/cuda_cmake_macros.h"
  INC="$INC -I$OUT/stub"
  echo "(stubbed c10/cuda/impl/cuda_cmake_macros.h: CPU-only torch headers)"
fi
# ATen/cuda/CUDAContext.h includes the cuBLAS/cuSPARSE/cuSOLVER headers for handle types only
if ! echo '#include <cusparse.h>' | "$NVCC" -x cu -E - -o /dev/null >/dev/null 2>&1; then
  mkdir -p "$OUT/stub"
  echo 'typedef void* cusparseHandle_t;' > "$OUT/stub/cusparse.h"
  echo 'typedef void* cublasHandle_t; typedef int cublasStatus_t;' > "$OUT/stub/cublas_v2.h"
  echo 'typedef void* cublasLtHandle_t;' > "$OUT/stub/cublasLt.h"
  echo 'typedef void* cusolverDnHandle_t; typedef int cusolverStatus_t;' > "$OUT/stub/cusolverDn.h"
  : > "$OUT/stub/cusolver_common.h"
  : > "$OUT/stub/cublas.h"
  INC="$INC -I$OUT/stub"
  echo "(stubbed the cuSPARSE/cuBLAS/cuSOLVER headers: toolkit without those libraries)"
fi
