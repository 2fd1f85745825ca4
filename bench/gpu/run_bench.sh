#!/usr/bin/env bash
# RolloutCore NCCL sender vs raw ncclBroadcast of the same bytes, same run, same communicator.
# Run on a 2-GPU host from the repo root, with the driver built here and carried in .carry/
# (and .carry/lib: the shared libraries the GPU image may lack; see tests/gpu/README.md):
#   ninja -C build-gpu2 nccl_gpu_driver && cp build-gpu2/tests/gpu/nccl_gpu_driver .carry/ && strip .carry/nccl_gpu_driver
# then on the GPU host (device tool, kind nvidia-h200-x2, carry [".carry"]):
#   bench/gpu/run_bench.sh [reps]
set -u
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia;print(list(nvidia.__path__)[0])')/nccl/lib:/usr/local/cuda/lib64
export RC_DRIVER_LIBS=$PWD/.carry/lib
exec tests/gpu/run_gpu.sh .carry/nccl_gpu_driver bench --reps "${1:-5}"
