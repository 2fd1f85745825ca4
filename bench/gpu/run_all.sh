#!/usr/bin/env bash
# Every GPU scenario in one device call (2x H200). Per-step results go to $WORK (default
# /tmp/rc_gpu_work); at the end they are concatenated ("=== <file>" headers) into one file,
# $OUT/all.txt, because the device tool brings back only a few files per call.
# Built here, carried in .carry/ (see tests/gpu/README.md):
#   .carry/nccl_gpu_driver, .carry/nccl_runner_driver, .carry/lib (shared libraries the GPU image
#   lacks: libcurl and its dependencies; searched after the system's).
# Usage (device tool, kind nvidia-h200-x2, carry [".carry"]): bench/gpu/run_all.sh [step...]
# Steps run in the order given (default: all), each bounded by `timeout`.
set -u
OUT=${OUT:-/tmp/rc_gpu_out}
WORK=${WORK:-/tmp/rc_gpu_work}
mkdir -p "$OUT" "$WORK"
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia;print(list(nvidia.__path__)[0])')/nccl/lib:/usr/local/cuda/lib64
export RC_DRIVER_LIBS=$PWD/.carry/lib
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
D=.carry/nccl_gpu_driver
R=.carry/nccl_runner_driver
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
for f in "$WORK"/*; do echo "=== $f"; cat "$f"; done > "$OUT/all.txt"
