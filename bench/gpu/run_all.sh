#!/usr/bin/env bash
# Every GPU scenario of the NCCL sender and the runner, one after the other, on a host with two
# GPUs (tests/gpu/README.md, "Running them"). From the repository root, after building the drivers:
#   cmake --build build-gpu --target nccl_gpu_driver nccl_runner_driver
#   bench/gpu/run_all.sh [step...]      steps: deadline runner_cycle runner_kill e2e ipc bench kill
# RC_BUILD_DIR: the build directory (default build-gpu). Each step's output goes to a private
# directory (WORK, default a fresh mktemp -d); at the end everything is concatenated ("=== <file>"
# headers) into $OUT/all.txt (OUT defaults to WORK). Steps run in the order given (default: all),
# each bounded by `timeout`.
set -u
BUILD=${RC_BUILD_DIR:-build-gpu}
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/rc_gpu_XXXXXX")}
OUT=${OUT:-$WORK}
mkdir -p "$OUT" "$WORK"
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia;print(list(nvidia.__path__)[0])')/nccl/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
D=$BUILD/tests/gpu/nccl_gpu_driver
R=$BUILD/tests/gpu/nccl_runner_driver
STEPS=${*:-"deadline runner_cycle runner_kill e2e ipc bench kill"}
for step in $STEPS; do
  t0=$(date +%s%N)
  case $step in
    deadline)     timeout 60  tests/gpu/run_gpu.sh $D deadline --deadline-ms 3000 ;;
    kill)         timeout 60  tests/gpu/run_gpu.sh $D kill ;;
    e2e)          timeout 120 tests/gpu/run_gpu.sh $D e2e ;;
    ipc)          timeout 60  tests/gpu/run_gpu.sh $D ipc ;;
    bench)        timeout 150 tests/gpu/run_gpu.sh $D bench --reps 3 ;;
    runner_cycle) timeout 120 tests/gpu/run_gpu.sh $R cycle --reps 5 ;;
    runner_kill)  timeout 75  tests/gpu/run_gpu.sh $R kill ;;
    *) echo "unknown step $step"; continue ;;
  esac > "$WORK/$step.jsonl" 2> "$WORK/$step.stderr"
  rc=$?
  echo "{\"step\":\"$step\",\"rc\":$rc,\"wall_ms\":$(( ($(date +%s%N) - t0) / 1000000 ))}" | tee -a "$WORK/steps.jsonl"
  grep -h '"pass":false\|"failures"' "$WORK/$step.jsonl" | cut -c1-600
done
for f in "$WORK"/*; do case $f in "$OUT"/all.txt|"$OUT"/all.txt.tmp) continue ;; esac; echo "=== $(basename "$f")"; cat "$f"; done > "$OUT/all.txt.tmp"
mv "$OUT/all.txt.tmp" "$OUT/all.txt"
echo "run_all.sh: results in $OUT/all.txt"
