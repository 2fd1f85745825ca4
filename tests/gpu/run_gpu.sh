#!/usr/bin/env bash
# Runs one GPU scenario: starts the receiver double on GPU 1, then the C++ driver on GPU 0.
#   tests/gpu/run_gpu.sh <nccl_gpu_driver|nccl_runner_driver> <mode> [extra driver args...]
# Needs 2 GPUs, torch with NCCL (the double loads libnccl from the nvidia-nccl wheel; the driver
# must use the same library: LD_LIBRARY_PATH=<nvidia>/nccl/lib:/usr/local/cuda/lib64).
set -u
DRIVER=$1; MODE=$2; shift 2
HERE=$(cd "$(dirname "$0")" && pwd)
PORT=${RC_GPU_PORT:-$((18000 + RANDOM % 1000))}
PIDFILE=$(mktemp)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 "$HERE/receiver_double.py" --port "$PORT" --device 1 --pid-file "$PIDFILE" &
PY=$!
for _ in $(seq 1 300); do
  curl -s "http://127.0.0.1:$PORT/version" >/dev/null 2>&1 && break
  python3 - "$PORT" <<'PYEOF' 2>/dev/null && break
import sys, urllib.request; urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/version", timeout=1)
PYEOF
  sleep 0.2
done
# RC_DRIVER_LIBS: a directory of shared libraries the driver needs when it was built on another
# machine (libcurl & co.), for the driver only, searched last.
LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}${RC_DRIVER_LIBS:+:$RC_DRIVER_LIBS}" \
  "$DRIVER" --mode "$MODE" --port "$PORT" --pid "$PY" "$@"
RC=$?
kill -9 "$PY" 2>/dev/null; wait "$PY" 2>/dev/null
rm -f "$PIDFILE"
exit $RC
