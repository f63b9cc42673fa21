# Sourced by the device scripts (bench/gpu_all.sh, or a call of your own), from the repo root on the device
# with `.whl` carried (../shared/device/wheels.sh): the wheels the device image lacks, the in-repo plugins as
# entry points without pip/hatchling, PYTHONPATH, $OUT, and the extension build (skipped when
# SKIP_BUILD=1 and a build is already there).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
for p in arch_llama:llama arch_qwen:qwen attn_backends:attn_backends; do
  dir=${p%%:*}; ep=${p##*:}; pkg=exl3_$dir
  di=/tmp/site/${pkg}-0.1.0.dist-info; mkdir -p $di
  printf 'Metadata-Version: 2.1\nName: %s\nVersion: 0.1.0\n' "${pkg//_/-}" > $di/METADATA
  printf '[exl3]\n%s = %s.plugin\n' "$ep" "$pkg" > $di/entry_points.txt
done
export PYTHONPATH=$PWD:$PWD/plugins/attn_backends/src:$PWD/plugins/arch_llama/src:$PWD/plugins/arch_qwen/src:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
# The device image sets CC/CXX to a wrapper under /opt/gcc; an extension built with it segfaults on any c10
# error or warning it raises (a TORCH_CHECK on bad input kills the process instead of raising), even a
# 10-line inline one, while the same GCC 13.3 as /usr/bin/g++ raises normally. $cc and $cxx are the compilers
# to build extensions with (bench/gpu_all.sh builds bench/ext with them too).
cc=${CC:-}; cxx=${CXX:-}
case "$cxx" in /opt/gcc/*) [ -x /usr/bin/g++ ] && { cc=/usr/bin/gcc; cxx=/usr/bin/g++; } ;; esac
if [ "${SKIP_BUILD:-0}" != 1 ] || [ ! -f exl3_core/_C.so ]; then
  t=$(date +%s)
  # setuptools tracks no header dependencies: a changed csrc header (a warm machine keeps the last call's
  # objects) forces every source to rebuild
  force=""
  [ -f exl3_core/_C.so ] && [ -n "$(find csrc \( -name '*.cuh' -o -name '*.h' \) -newer exl3_core/_C.so)" ] && force=--force
  CC=$cc CXX=$cxx TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 setup.py build_ext --inplace $force > "$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
  # setup.py's optional build only warns on a compile error: say so here, loudly
  [ -f exl3_core/_C.so ] || { grep -m5 -E "error" "$OUT/build.log"; echo "BUILD FAILED: no exl3_core/_C.so"; }
  echo "build $(( $(date +%s) - t )) s${force:+ (forced: a header changed)} (CXX=${cxx:-default})"
fi
