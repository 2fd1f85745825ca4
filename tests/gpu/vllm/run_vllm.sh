#!/usr/bin/env bash
# The real-vLLM experiments on the 2x H200 host (tests/gpu/vllm/README.md). vLLM on GPU 1, the
# RolloutCore driver (rank 0, sender) on GPU 0. Expects the wheels reassembled in /tmp/wheels
# (w.tar.* = whl/ with vLLM 0.25.1 + the missing deps + vc.tar.xz with the driver) and writes
# everything into ONE log: $OUT/vllm.log.   Usage: tests/gpu/vllm/run_vllm.sh [budget_s]
set -u
BUDGET=${1:-520}
LOG=${OUT:-/tmp}/vllm.log
exec >>"$LOG" 2>&1
T0=$(date +%s.%N)
el() { python3 -c "import time;print(round(time.time()-$T0,1))"; }
say() { echo "=== [t=$(el)s] $*"; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_SERVER_DEV_MODE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# run 3: the engine core imports flashinfer for the top-k/top-p sampler unless this is 0 (not carried)
export VLLM_USE_FLASHINFER_SAMPLER=0
HERE=tests/gpu/vllm; U=http://127.0.0.1:8000; VPID=
cleanup() { [ -n "$VPID" ] && kill -9 -- -"$VPID" 2>/dev/null; sleep 1; }
trap cleanup EXIT
say install; [ -d /tmp/site/vllm ] || { cat /tmp/wheels/w.tar.* > /tmp/w.tar && md5sum /tmp/w.tar && tar xf /tmp/w.tar -C /tmp; } || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/whl/*.whl; python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .vw2/*.whl 2>&1 | tail -5
export PYTHONPATH=/tmp/site
mkdir -p .vc && tar xJf /tmp/whl/vc.tar.xz -C . || exit 3
NCCL_LIB=$(python3 -c 'import nvidia;print(list(nvidia.__path__)[0])')/nccl/lib
DRV() { LD_LIBRARY_PATH="$NCCL_LIB:/usr/local/cuda/lib64:$PWD/.vc/lib" timeout 200 .vc/vllm_driver "$@"; }
say provenance
python3 -c "import vllm,torch;print('vllm',vllm.__version__,'torch',torch.__version__,torch.version.cuda,'gpus',torch.cuda.device_count())" 2>&1 | tail -3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
git log -1 --format='rolloutcore %H' 2>/dev/null; sha256sum .vc/vllm_driver /tmp/whl/vllm-*.whl
serve() {  # serve DIR LOGNAME EXTRA...
  local d=$1 lg=$2; shift 2
  CUDA_VISIBLE_DEVICES=1 setsid python3 -m vllm.entrypoints.cli.main serve "$d" --served-model-name m \
    --host 127.0.0.1 --port 8000 --enforce-eager --gpu-memory-utilization 0.5 --enable-prefix-caching \
    --weight-transfer-config '{"backend":"nccl"}' --max-model-len 2048 --dtype bfloat16 "$@" >"/tmp/$lg.log" 2>&1 &
  VPID=$!; local t=$(date +%s.%N)
  if python3 $HERE/vexp.py ready $U 200 $VPID; then
    say "restart-to-ready $lg: $(python3 -c "import time;print(round(time.time()-$t,3))") s (process start -> /health 200)"; return 0
  fi
  say "vLLM $lg did not become ready"; tail -60 "/tmp/$lg.log"; kill -9 -- -"$VPID"; VPID=; return 1
}
get() { python3 -c "import requests,sys;print(requests.get(sys.argv[1],timeout=10).text)" "$1"; }
stop() { say "stop vLLM"; kill -9 -- -"$VPID" 2>/dev/null; wait "$VPID" 2>/dev/null; VPID=; sleep 3; }

say "model opt125m"; python3 $HERE/make_model.py --shape opt125m --out /tmp/m125 --seed 1 &&
  python3 $HERE/make_model.py --shape opt125m --out /tmp/m125 --seed 2 --weights-file /tmp/m125_seed2.safetensors && ls -la /tmp/m125
say "E7/E2 reference: vLLM started directly on the real weights (seed 1)"
serve /tmp/m125 ref125 || { say "retry with TRITON_ATTN"; serve /tmp/m125 ref125b --attention-backend TRITON_ATTN || exit 4; ATT="--attention-backend TRITON_ATTN"; }
grep -m3 -i -E 'attention backend|Using .*backend' /tmp/ref125*.log
python3 $HERE/vexp.py greedy $U /tmp/ref125.json; stop
say "dummy engine (rc-0)"; serve /tmp/m125 dummy125 --load-format dummy ${ATT:-} || exit 5
python3 $HERE/vexp.py greedy $U /tmp/dummy125.json
say E1; python3 $HERE/vexp.py e1 $U
say "E4 before update: prefix cache warm"; python3 $HERE/vexp.py prefix $U pre1; python3 $HERE/vexp.py prefix $U pre2
waitf() { for _ in $(seq 1 900); do [ -e "$1" ] && return 0; kill -0 "$2" 2>/dev/null || { say "driver exited before $1"; return 1; }; sleep 0.1; done; say "timeout waiting for $1"; return 1; }
say "E2: dummy -> seed-1 weights through Runner + NcclSender (one sender process, two steps)"
mkdir -p /tmp/g125; DRV --mode update --url $U --gate /tmp/g125 --from rc-0 \
  --steps /tmp/m125/model.safetensors=rc-1,/tmp/m125_seed2.safetensors=rc-2 & DP=$!
waitf /tmp/g125/done.1 $DP; get $U/weight_info
say "E4 after update"; python3 $HERE/vexp.py prefix $U post1; python3 $HERE/vexp.py prefix $U post2
python3 $HERE/vexp.py greedy $U /tmp/after125.json
python3 $HERE/vexp.py same /tmp/ref125.json /tmp/after125.json "E2 125M: after the update == reference run on the real weights"
python3 $HERE/vexp.py same /tmp/dummy125.json /tmp/after125.json "(expected false) dummy output == after"
say "E3: live rollout during update rc-1 -> rc-2 (seed 2)"
python3 $HERE/vexp.py live $U 8 /tmp/live125.json & LP=$!
sleep 3; touch /tmp/g125/go.2; wait $DP; wait $LP
python3 -c "
import json;r=json.load(open('/tmp/live125.json'))
for x in r: print(round(x['t0']%1000,3), round(x['t1']-x['t0'],3), x['ok'], x.get('ids'))" | awk 'NR%4==1'
get $U/metrics | grep -E '^vllm:(prefix_cache|num_requests)' | head -8
grep -i -E 'error|traceback|warn' /tmp/dummy125.log | grep -v -i deprecat | head -30
stop
if [ "$(python3 -c "print(int($(el) < $BUDGET - 250))")" = 1 ]; then
  say "model qwen3-8b (16 GB)"; python3 $HERE/make_model.py --shape qwen3-8b --out /tmp/m8b --seed 1; ls -la /tmp/m8b
  say "E7 8B restart-to-ready on real weights"; serve /tmp/m8b ref8b ${ATT:-} && python3 $HERE/vexp.py greedy $U /tmp/ref8b.json; stop
  if [ "$(python3 -c "print(int($(el) < $BUDGET - 100))")" = 1 ]; then
    say "8B dummy"; serve /tmp/m8b dummy8b --load-format dummy ${ATT:-} && {
      say "E2/E7 8B hot"; mkdir -p /tmp/g8b; DRV --mode kill --url $U --gate /tmp/g8b --from rc-0 --pid -$VPID \
        --steps /tmp/m8b/model.safetensors=rc-1,/tmp/m8b/model.safetensors=rc-2 & DP=$!
      waitf /tmp/g8b/done.1 $DP && python3 $HERE/vexp.py greedy $U /tmp/after8b.json &&
        python3 $HERE/vexp.py same /tmp/ref8b.json /tmp/after8b.json "E2 8B: after the update == reference run"
      say "E6 kill engine mid-transfer (8B)"; touch /tmp/g8b/go.2; wait $DP; VPID=; }
  else say "8B hot/E6 skipped: budget"; fi
else say "8B skipped: budget"; fi
say done
