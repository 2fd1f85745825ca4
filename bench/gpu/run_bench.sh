#!/usr/bin/env bash
# RolloutCore NCCL sender vs raw ncclBroadcast of the same bytes, same run, same communicator.
# On a host with two GPUs, from the repository root, after building the driver there
# (bench/gpu/README.md, "Running"):
#   cmake --build build-gpu --target nccl_gpu_driver
#   bench/gpu/run_bench.sh [reps]          (RC_BUILD_DIR: the build directory, default build-gpu)
set -u
BUILD=${RC_BUILD_DIR:-build-gpu}
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia;print(list(nvidia.__path__)[0])')/nccl/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
exec tests/gpu/run_gpu.sh "$BUILD/tests/gpu/nccl_gpu_driver" bench --reps "${1:-5}"
