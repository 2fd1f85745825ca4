#!/usr/bin/env bash
# The real-vLLM experiments on the 2x H200 host (tests/gpu/vllm/README.md). vLLM on GPU 1, the
# RolloutCore driver (rank 0, sender) on GPU 0. Expects the chunks reassembled from /tmp/wheels
# (w.tar.* = whl/ with vLLM 0.25.1 + the missing deps + vc.tar.xz with the driver) and appends
# everything to ONE log: $OUT/vllm.log.
#   Usage: [RESIDENT=1] tests/gpu/vllm/run_vllm.sh PART [budget_s]   PART: 125m | 8b | serve | install
#   RESIDENT=1: the driver sends from GPU 0 memory (as a trainer would), not from the file.
# vLLM 0.25.1 has no /weight_info: it is started with RolloutCore's worker extension
# (python/rolloutcore/vllm_ext.py), which keeps the label RolloutCore reads over /collective_rpc.
set -u
PART=${1:?part: 125m, 8b, serve or install}; BUDGET=${2:-560}
LOG=${OUT:-/tmp}/vllm.log
exec >>"$LOG" 2>&1
T0=$(date +%s.%N)
el() { python3 -c "import time;print(round(time.time()-$T0,1))"; }
say() { echo "=== [$PART t=$(el)s] $*"; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_SERVER_DEV_MODE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# run 3 (first session): the engine core imports flashinfer for the top-k/top-p sampler unless
# this is 0; flashinfer is not carried (its cubin wheel alone is 437 MiB).
export VLLM_USE_FLASHINFER_SAMPLER=0
HERE=tests/gpu/vllm; U=http://127.0.0.1:8000; VPID=
cleanup() { [ -n "$VPID" ] && kill -9 -- -"$VPID" 2>/dev/null; sleep 1; }
trap cleanup EXIT
if [ ! -e /tmp/site/.installed ]; then
  say install
  cat /tmp/wheels/w.tar.* > /tmp/w.tar && md5sum /tmp/w.tar && tar xf /tmp/w.tar -C /tmp && rm /tmp/w.tar || exit 3
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/whl/*.whl || exit 3
  touch /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site:$PWD/python
mkdir -p .vc && rm -f .vc/vllm_driver && tar xJf /tmp/whl/vc.tar.xz -C . || exit 3
NCCL_LIB=$(python3 -c 'import nvidia;print(list(nvidia.__path__)[0])')/nccl/lib
DRV() { LD_LIBRARY_PATH="$NCCL_LIB:/usr/local/cuda/lib64:$PWD/.vc/lib" timeout 300 .vc/vllm_driver "$@"; }
say provenance
python3 -c "import vllm,torch;print('vllm',vllm.__version__,'torch',torch.__version__,torch.version.cuda,'gpus',torch.cuda.device_count())" 2>&1 | tail -3
python3 -c "import rolloutcore.vllm_ext as e;print('worker extension', e.__file__)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
git log -1 --format='rolloutcore %H' 2>/dev/null; sha256sum .vc/vllm_driver
[ "$PART" = install ] && { say "installed"; exit 0; }
serve() {  # serve DIR LOGNAME EXTRA...
  local d=$1 lg=$2; shift 2
  CUDA_VISIBLE_DEVICES=1 setsid python3 -m vllm.entrypoints.cli.main serve "$d" --served-model-name m \
    --host 127.0.0.1 --port 8000 --enforce-eager --gpu-memory-utilization 0.5 --enable-prefix-caching \
    --weight-transfer-config '{"backend":"nccl"}' --max-model-len 2048 --dtype bfloat16 \
    --worker-extension-cls rolloutcore.vllm_ext.RolloutCoreWorkerExtension "$@" >"/tmp/$lg.log" 2>&1 &
  VPID=$!; local t=$(date +%s.%N)
  if python3 $HERE/vexp.py ready $U 240 $VPID; then
    local total=$(python3 -c "import time;print(round(time.time()-$t,3))")
    say "restart-to-ready $lg: $total s (process start -> /health 200)"
    grep -m4 -E 'Model loading took|Using .* backend|KV cache|init engine' "/tmp/$lg.log"
    python3 $HERE/vexp.py phases "/tmp/$lg.log" "$total"; return 0
  fi
  say "vLLM $lg did not become ready"; tail -80 "/tmp/$lg.log"; kill -9 -- -"$VPID"; VPID=; return 1
}
get() { python3 -c "import requests,sys;r=requests.get(sys.argv[1],timeout=10);print(r.status_code,r.text[:300])" "$1"; }
stop() { say "stop vLLM"; kill -9 -- -"$VPID" 2>/dev/null; wait "$VPID" 2>/dev/null; VPID=; sleep 3; }
waitf() { for _ in $(seq 1 1800); do [ -e "$1" ] && return 0; kill -0 "$2" 2>/dev/null || { say "driver exited before $1"; return 1; }; sleep 0.1; done; say "timeout waiting for $1"; return 1; }
left() { python3 -c "print(int($(el) < $BUDGET - $1))"; }

if [ "$PART" = 125m ]; then
  say "model opt125m (seeds 1 and 2: one manifest, two checkpoints)"
  python3 $HERE/make_model.py --shape opt125m --out /tmp/m125 --seed 1 &&
    python3 $HERE/make_model.py --shape opt125m --out /tmp/m125 --seed 2 --weights-file /tmp/m125_seed2.safetensors &&
    ls -la /tmp/m125 /tmp/m125_seed2.safetensors || exit 4
  say "E7 restart-to-ready / E2 reference: vLLM started directly on the real weights (seed 1)"
  serve /tmp/m125 ref125 || exit 4
  python3 $HERE/vexp.py greedy $U /tmp/ref125.json; python3 $HERE/vexp.py label $U
  python3 $HERE/vexp.py prefix $U ref1 /tmp/ref_p1.json; python3 $HERE/vexp.py prefix $U ref2; stop
  say "E7 restart-to-ready again (the first start of a fresh host also byte-compiles vLLM's modules)"
  serve /tmp/m125 ref125w && stop
  say "dummy engine (rc-0: --load-format dummy)"; serve /tmp/m125 dummy125 --load-format dummy || exit 5
  python3 $HERE/vexp.py greedy $U /tmp/dummy125.json
  say E1; python3 $HERE/vexp.py e1 $U
  say "E4 before update: prefix cache warm under rc-0"; python3 $HERE/vexp.py prefix $U pre1; python3 $HERE/vexp.py prefix $U pre2
  say "E2/E3/E4/E5: one sender; steps rc-1 (seed 1), rc-2 (seed 2) through the Runner, then raw-3 (seed 1) outside it"
  mkdir -p /tmp/g125; DRV --mode update --url $U --gate /tmp/g125 --from rc-0 --resident ${RESIDENT:-0} \
    --steps /tmp/m125/model.safetensors=rc-1,/tmp/m125_seed2.safetensors=rc-2,/tmp/m125/model.safetensors=raw:raw-3 & DP=$!
  if waitf /tmp/g125/done.1 $DP; then
    python3 $HERE/vexp.py label $U
    say "E4 after the RolloutCore update: first request must show 0 hits, the second hits"
    python3 $HERE/vexp.py prefix $U post1 /tmp/post1.json; python3 $HERE/vexp.py prefix $U post2
    python3 $HERE/vexp.py greedy $U /tmp/after125.json
    python3 $HERE/vexp.py same /tmp/ref125.json /tmp/after125.json "E2 125M: after the update == reference run on the real weights"
    python3 $HERE/vexp.py same /tmp/dummy125.json /tmp/after125.json "(expected false) dummy output == after"
    say "E3: live requests during update rc-1 -> rc-2 (seed 2)"
    python3 $HERE/vexp.py live $U 8 /tmp/live125.json & LP=$!
    sleep 3; touch /tmp/g125/go.2; waitf /tmp/g125/done.2 $DP; wait $LP
    python3 -c "
import json;r=json.load(open('/tmp/live125.json'))
for x in r: print(round(x['t0']%1000,3), round(x['t1']-x['t0'],3), x['ok'], x.get('ids'))" | awk 'NR%3==1'
    python3 $HERE/vexp.py greedy $U /tmp/rc2.json
    say "E4 negative control: warm under rc-2, then a raw update (seed 1) with caches left"
    python3 $HERE/vexp.py prefix $U neg_warm1; python3 $HERE/vexp.py prefix $U neg_warm2
    touch /tmp/g125/go.3; waitf /tmp/g125/done.3 $DP
    python3 $HERE/vexp.py label $U
    python3 $HERE/vexp.py prefix $U neg_stale /tmp/neg_stale.json
    python3 $HERE/vexp.py reset $U
    python3 $HERE/vexp.py prefix $U neg_fresh /tmp/neg_fresh.json
    python3 $HERE/vexp.py differ /tmp/neg_stale.json /tmp/neg_fresh.json "E4 negative: stale-KV output vs fresh (same seed-1 weights)"
    python3 $HERE/vexp.py differ /tmp/post1.json /tmp/neg_fresh.json "(expected false) seed-1 fresh after RolloutCore vs seed-1 fresh after raw+reset"
    python3 $HERE/vexp.py differ /tmp/ref_p1.json /tmp/neg_fresh.json "(expected false) reference engine vs seed-1 fresh"
  fi
  wait $DP; say "driver exit $?"
  get $U/metrics | head -1; python3 -c "import requests;[print(l) for l in requests.get('$U/metrics',timeout=10).text.splitlines() if l.startswith(('vllm:prefix_cache','vllm:num_requests'))]"
  grep -i -E 'error|traceback' /tmp/dummy125.log | grep -v -i deprecat | head -20
  stop
fi

if [ "$PART" = 8b ]; then
  say "model qwen3-8b shape (16 GB, seed 1)"; python3 $HERE/make_model.py --shape qwen3-8b --out /tmp/m8b --seed 1 && ls -la /tmp/m8b || exit 4
  say "E7 8B restart-to-ready on the real weights"; serve /tmp/m8b ref8b && python3 $HERE/vexp.py greedy $U /tmp/ref8b.json; stop
  [ "$(left 250)" = 1 ] && { say "E7 8B restart-to-ready again"; serve /tmp/m8b ref8bw && stop; }
  [ "$(left 150)" = 1 ] || { say "8B hot/E6 skipped: budget"; exit 0; }
  say "8B dummy (rc-0)"; serve /tmp/m8b dummy8b --load-format dummy || exit 5
  say "E2/E7 8B hot, then E6 kill mid-transfer"; mkdir -p /tmp/g8b
  DRV --mode kill --url $U --gate /tmp/g8b --from rc-0 --pid -$VPID --resident ${RESIDENT:-0} \
    --steps /tmp/m8b/model.safetensors=rc-1,/tmp/m8b/model.safetensors=rc-2 & DP=$!
  if waitf /tmp/g8b/done.1 $DP; then
    python3 $HERE/vexp.py greedy $U /tmp/after8b.json &&
      python3 $HERE/vexp.py same /tmp/ref8b.json /tmp/after8b.json "E2 8B: after the update == reference run"
    say "E6 kill the engine mid-transfer (8B)"; touch /tmp/g8b/go.2
  fi
  wait $DP; say "driver exit $?"; kill -9 -- -"$VPID" 2>/dev/null; VPID=
fi
if [ "$PART" = serve ]; then
  # rolloutcore serve --transfer nccl (GPU 0) beside vLLM (GPU 1), driven by the Python client.
  [ -e /tmp/m125_seed2.safetensors ] || { python3 $HERE/make_model.py --shape opt125m --out /tmp/m125 --seed 1 &&
    python3 $HERE/make_model.py --shape opt125m --out /tmp/m125 --seed 2 --weights-file /tmp/m125_seed2.safetensors; } || exit 4
  printf '#!/bin/sh\nLD_LIBRARY_PATH="%s:/usr/local/cuda/lib64:%s/.vc/lib" exec %s/.vc/rolloutcore "$@"\n' "$NCCL_LIB" "$PWD" "$PWD" > .vc/rc.sh
  chmod +x .vc/rc.sh
  say "serve: vLLM dummy 125M (rc-0)"; serve /tmp/m125 dummy125s --load-format dummy || exit 5
  rm -rf /tmp/e2e; python3 $HERE/serve_e2e.py "$PWD/.vc/rc.sh" $U /tmp/m125 /tmp/m125_seed2.safetensors /tmp/e2e
  say "serve_e2e exit $?"; tail -c 3000 /tmp/e2e/serve.log; cp /tmp/e2e/serve.log "${OUT:-/tmp}/serve.log" 2>/dev/null
  stop
fi
say done
