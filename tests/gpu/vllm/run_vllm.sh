#!/usr/bin/env bash
# The real-vLLM experiments (docs/experiments.md). Parts 125m, 8b and serve need one host with two
# GPUs: vLLM on GPU 1, the RolloutCore driver (rank 0, the sender) on GPU 0. Parts proof125m and
# proof8b need ONE GPU: vLLM on GPU 0 reloads checkpoints from its own disk (proof.py). Parts
# colocated125m and colocated8b need ONE GPU too: vLLM (sleep mode, ipc weight transfer) and a
# torch trainer share GPU 0 (colocated.py). Part fleet125m needs ONE GPU too: two vLLM engines share
# GPU 0 and rolloutcore serve updates them as a fleet (fleet.py). What to install and build first:
# tests/gpu/vllm/README.md. Run from the repository root.
#   Usage: [RESIDENT=1] [RC_BUILD_DIR=build-gpu] [RC_WORKDIR=DIR] [RC_VLLM_PORT=8000] \
#          tests/gpu/vllm/run_vllm.sh PART [budget_s]
#   PART: 125m (E1-E5, E7 at 125M) | 8b (E2, E6, E7 at 8B) | serve (rolloutcore serve beside vLLM)
#         | proof125m | proof8b (proof of content, P0-P9 of proof.py, one GPU)
#         | colocated125m | colocated8b (colocated mode, C0-C7 of colocated.py, one GPU)
#         | fleet125m (two engines on one GPU as a fleet, F0-F7 of fleet.py; ports RC_VLLM_PORT and +1)
#   RESIDENT=1: the driver sends from GPU 0 memory (as a trainer would), not from the file.
#   RC_WORKDIR: models, engine logs and gate files (default: a fresh mktemp -d, so two runs never
#   share a path); everything is appended to ONE log, $OUT/vllm.log if OUT is set, else
#   $RC_WORKDIR/vllm.log (proof and colocated parts: PART.log, plus servePART.log and vllmPART.log,
#   the serve and engine logs trimmed to their last 200 KB; fleet125m: vllmfleet125m_a.log and _b.log).
# vLLM 0.25.1 has no /weight_info: it is started with RolloutCore's worker extension
# (python/rolloutcore/vllm_ext.py), which keeps the label RolloutCore reads over /collective_rpc.
set -u
PART=${1:?part: 125m, 8b, serve, proof125m, proof8b, colocated125m, colocated8b or fleet125m}; BUDGET=${2:-560}
BUILD=${RC_BUILD_DIR:-build-gpu}
W=${RC_WORKDIR:-$(mktemp -d "${TMPDIR:-/tmp}/rc_vllm_XXXXXX")}
mkdir -p "$W" || exit 3
case $PART in proof*|colocated*|fleet*) LOG=${OUT:-$W}/$PART.log ;; *) LOG=${OUT:-$W}/vllm.log ;; esac
echo "run_vllm.sh: files in $W, log $LOG"
exec >>"$LOG" 2>&1
T0=$(date +%s.%N)
el() { python3 -c "import time;print(round(time.time()-$T0,1))"; }
say() { echo "=== [$PART t=$(el)s] $*"; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_SERVER_DEV_MODE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# The sampler then needs no flashinfer (the engine core imports it for top-k/top-p otherwise).
export VLLM_USE_FLASHINFER_SAMPLER=0
HERE=tests/gpu/vllm; PORT=${RC_VLLM_PORT:-8000}; U=http://127.0.0.1:$PORT; VPID=
cleanup() { [ -n "$VPID" ] && kill -9 -- -"$VPID" 2>/dev/null; sleep 1; }
trap cleanup EXIT
python3 -c "import vllm" 2>/dev/null || { say "vllm is not importable: pip install vllm==0.25.1"; exit 3; }
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
NCCL_LIB=$(python3 -c 'import nvidia;print(list(nvidia.__path__)[0])')/nccl/lib
LIBS="$NCCL_LIB:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
rcwrap() {  # $W/rc.sh: the rolloutcore binary with the engine's NCCL library (a CUDA build links it)
  printf '#!/bin/sh\nLD_LIBRARY_PATH="%s" exec "%s" "$@"\n' "$LIBS" "$PWD/$BUILD/cli/rolloutcore" > "$W/rc.sh"
  chmod +x "$W/rc.sh"
}
if [ "$PART" = proof125m ] || [ "$PART" = proof8b ]; then
  # One GPU, no NCCL, no driver: proof.py starts vLLM and serve itself and prints its own
  # provenance (P0). Its budget leaves 20 s for killing what is left and trimming the logs.
  SIZE=${PART#proof}; PW=$W/p$SIZE
  [ -x "$BUILD/cli/rolloutcore" ] || { say "build $BUILD/cli/rolloutcore first (tests/gpu/vllm/README.md)"; exit 3; }
  rcwrap; sha256sum "$BUILD/cli/rolloutcore"; git log -1 --format='rolloutcore %H' 2>/dev/null
  say "proof $SIZE: vLLM on GPU 0 (real weights, reload from its disk), rolloutcore serve --transfer reload"
  RC_PROOF_BUDGET_S=$((BUDGET - 20)) timeout -s KILL "$((BUDGET - 5))" python3 $HERE/proof.py "$W/rc.sh" "$SIZE" "$PW"
  say "proof.py exit $?"
  [ -s "$PW/engine.pgid" ] && kill -9 -- -"$(cat "$PW/engine.pgid")" 2>/dev/null
  for f in serve engine; do [ -e "$PW/$f.log" ] && tail -c 200000 "$PW/$f.log" > "${OUT:-$W}/${f/engine/vllm}$SIZE.log"; done
  say done; exit 0
fi
if [ "$PART" = fleet125m ]; then
  # One GPU, two engines: fleet.py starts vLLM engines a and b on GPU 0 (--gpu-memory-utilization
  # 0.3 each, one after the other) and serve --transfer reload in front of both, and prints its own
  # provenance (F0). Its budget leaves 20 s for killing what is left and trimming the logs.
  FW=$W/fleet125m
  [ -x "$BUILD/cli/rolloutcore" ] || { say "build $BUILD/cli/rolloutcore first (tests/gpu/vllm/README.md)"; exit 3; }
  rcwrap; sha256sum "$BUILD/cli/rolloutcore"; git log -1 --format='rolloutcore %H' 2>/dev/null
  say "fleet 125m: vLLM engines a and b on GPU 0 (reload from their disk), rolloutcore serve --transfer reload"
  RC_FLEET_BUDGET_S=$((BUDGET - 20)) timeout -s KILL "$((BUDGET - 5))" python3 $HERE/fleet.py "$W/rc.sh" 125m "$FW"
  say "fleet.py exit $?"
  for e in a b; do
    [ -s "$FW/$e/engine.pgid" ] && kill -9 -- -"$(cat "$FW/$e/engine.pgid")" 2>/dev/null
    [ -e "$FW/$e/engine.log" ] && tail -c 200000 "$FW/$e/engine.log" > "${OUT:-$W}/vllm${PART}_$e.log"
  done
  [ -e "$FW/serve.log" ] && tail -c 200000 "$FW/serve.log" > "${OUT:-$W}/serve$PART.log"
  say done; exit 0
fi
if [ "$PART" = colocated125m ] || [ "$PART" = colocated8b ]; then
  # One GPU shared by vLLM (--enable-sleep-mode, ipc weight transfer) and the trainer, which is
  # colocated.py itself; it starts vLLM and serve --transfer ipc and prints its provenance (C0).
  SIZE=${PART#colocated}; PW=$W/c$SIZE
  [ -x "$BUILD/cli/rolloutcore" ] || { say "build $BUILD/cli/rolloutcore first (tests/gpu/vllm/README.md)"; exit 3; }
  # vLLM's ipc backend module imports these at the top: without them the engine cannot start.
  python3 -c "import ray, pybase64, requests" 2>/dev/null ||
    { say "vLLM's ipc weight transfer needs ray, pybase64 and requests importable: pip install them"; exit 3; }
  rcwrap; sha256sum "$BUILD/cli/rolloutcore"; git log -1 --format='rolloutcore %H' 2>/dev/null
  say "colocated: the trainer side alone first (export, a receiver opening the handles as vLLM does)"
  timeout -s KILL 120 python3 $HERE/colocated.py --ipc-check "$PW/ipc-check"; say "ipc-check exit $?"
  say "colocated $SIZE: vLLM and a torch trainer on GPU 0, rolloutcore serve --transfer ipc"
  REM=$(python3 -c "print(int($BUDGET - $(el)))")
  RC_COLO_BUDGET_S=$((REM - 20)) timeout -s KILL "$((REM - 5))" python3 $HERE/colocated.py "$W/rc.sh" "$SIZE" "$PW"
  say "colocated.py exit $?"
  [ -s "$PW/engine.pgid" ] && kill -9 -- -"$(cat "$PW/engine.pgid")" 2>/dev/null
  for f in serve engine; do [ -e "$PW/$f.log" ] && tail -c 200000 "$PW/$f.log" > "${OUT:-$W}/${f/engine/vllm}$PART.log"; done
  say done; exit 0
fi
[ -x "$BUILD/tests/gpu/vllm_driver" ] || { say "build $BUILD/tests/gpu/vllm_driver first (tests/gpu/vllm/README.md)"; exit 3; }
DRV() { LD_LIBRARY_PATH="$LIBS" timeout 300 "$BUILD/tests/gpu/vllm_driver" "$@"; }
say provenance
python3 -c "import vllm,torch;print('vllm',vllm.__version__,'torch',torch.__version__,torch.version.cuda,'gpus',torch.cuda.device_count())" 2>&1 | tail -3
python3 -c "import rolloutcore.vllm_ext as e;print('worker extension', e.__file__)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
git log -1 --format='rolloutcore %H' 2>/dev/null; sha256sum "$BUILD/tests/gpu/vllm_driver"
serve() {  # serve DIR LOGNAME EXTRA...
  local d=$1 lg=$2; shift 2
  CUDA_VISIBLE_DEVICES=1 setsid python3 -m vllm.entrypoints.cli.main serve "$d" --served-model-name m \
    --host 127.0.0.1 --port "$PORT" --enforce-eager --gpu-memory-utilization 0.5 --enable-prefix-caching \
    --weight-transfer-config '{"backend":"nccl"}' --max-model-len 2048 --dtype bfloat16 \
    --worker-extension-cls rolloutcore.vllm_ext.RolloutCoreWorkerExtension "$@" >"$W/$lg.log" 2>&1 &
  VPID=$!; local t=$(date +%s.%N)
  if python3 $HERE/vexp.py ready $U 240 $VPID; then
    local total=$(python3 -c "import time;print(round(time.time()-$t,3))")
    say "restart-to-ready $lg: $total s (process start -> /health 200)"
    grep -m4 -E 'Model loading took|Using .* backend|KV cache|init engine' "$W/$lg.log"
    python3 $HERE/vexp.py phases "$W/$lg.log" "$total"; return 0
  fi
  say "vLLM $lg did not become ready"; tail -80 "$W/$lg.log"; kill -9 -- -"$VPID"; VPID=; return 1
}
get() { python3 -c "import requests,sys;r=requests.get(sys.argv[1],timeout=10);print(r.status_code,r.text[:300])" "$1"; }
stop() { say "stop vLLM"; kill -9 -- -"$VPID" 2>/dev/null; wait "$VPID" 2>/dev/null; VPID=; sleep 3; }
waitf() { for _ in $(seq 1 1800); do [ -e "$1" ] && return 0; kill -0 "$2" 2>/dev/null || { say "driver exited before $1"; return 1; }; sleep 0.1; done; say "timeout waiting for $1"; return 1; }
left() { python3 -c "print(int($(el) < $BUDGET - $1))"; }

if [ "$PART" = 125m ]; then
  say "model opt125m (seeds 1 and 2: one manifest, two checkpoints)"
  python3 $HERE/make_model.py --shape opt125m --out $W/m125 --seed 1 &&
    python3 $HERE/make_model.py --shape opt125m --out $W/m125 --seed 2 --weights-file $W/m125_seed2.safetensors &&
    ls -la $W/m125 $W/m125_seed2.safetensors || exit 4
  say "E7 restart-to-ready / E2 reference: vLLM started directly on the real weights (seed 1)"
  serve $W/m125 ref125 || exit 4
  python3 $HERE/vexp.py greedy $U $W/ref125.json; python3 $HERE/vexp.py label $U
  python3 $HERE/vexp.py prefix $U ref1 $W/ref_p1.json; python3 $HERE/vexp.py prefix $U ref2; stop
  say "E7 restart-to-ready again (the first start of a fresh host also byte-compiles vLLM's modules)"
  serve $W/m125 ref125w && stop
  say "dummy engine (rc-0: --load-format dummy)"; serve $W/m125 dummy125 --load-format dummy || exit 5
  python3 $HERE/vexp.py greedy $U $W/dummy125.json
  say E1; python3 $HERE/vexp.py e1 $U
  say "E4 before update: prefix cache warm under rc-0"; python3 $HERE/vexp.py prefix $U pre1; python3 $HERE/vexp.py prefix $U pre2
  say "E2/E3/E4/E5: one sender; steps rc-1 (seed 1), rc-2 (seed 2) through the Runner, then raw-3 (seed 1) outside it"
  mkdir -p $W/g125; DRV --mode update --url $U --gate $W/g125 --from rc-0 --resident ${RESIDENT:-0} \
    --steps $W/m125/model.safetensors=rc-1,$W/m125_seed2.safetensors=rc-2,$W/m125/model.safetensors=raw:raw-3 & DP=$!
  if waitf $W/g125/done.1 $DP; then
    python3 $HERE/vexp.py label $U
    say "E4 after the RolloutCore update: first request must show 0 hits, the second hits"
    python3 $HERE/vexp.py prefix $U post1 $W/post1.json; python3 $HERE/vexp.py prefix $U post2
    python3 $HERE/vexp.py greedy $U $W/after125.json
    python3 $HERE/vexp.py same $W/ref125.json $W/after125.json "E2 125M: after the update == reference run on the real weights"
    python3 $HERE/vexp.py same $W/dummy125.json $W/after125.json "(expected false) dummy output == after"
    say "E3: live requests during update rc-1 -> rc-2 (seed 2)"
    python3 $HERE/vexp.py live $U 8 $W/live125.json & LP=$!
    sleep 3; touch $W/g125/go.2; waitf $W/g125/done.2 $DP; wait $LP
    python3 -c "
import json;r=json.load(open('$W/live125.json'))
for x in r: print(round(x['t0']%1000,3), round(x['t1']-x['t0'],3), x['ok'], x.get('ids'))" | awk 'NR%3==1'
    python3 $HERE/vexp.py greedy $U $W/rc2.json
    say "E4 negative control: warm under rc-2, then a raw update (seed 1) with caches left"
    python3 $HERE/vexp.py prefix $U neg_warm1; python3 $HERE/vexp.py prefix $U neg_warm2
    touch $W/g125/go.3; waitf $W/g125/done.3 $DP
    python3 $HERE/vexp.py label $U
    python3 $HERE/vexp.py prefix $U neg_stale $W/neg_stale.json
    python3 $HERE/vexp.py reset $U
    python3 $HERE/vexp.py prefix $U neg_fresh $W/neg_fresh.json
    python3 $HERE/vexp.py differ $W/neg_stale.json $W/neg_fresh.json "E4 negative: stale-KV output vs fresh (same seed-1 weights)"
    python3 $HERE/vexp.py differ $W/post1.json $W/neg_fresh.json "(expected false) seed-1 fresh after RolloutCore vs seed-1 fresh after raw+reset"
    python3 $HERE/vexp.py differ $W/ref_p1.json $W/neg_fresh.json "(expected false) reference engine vs seed-1 fresh"
  fi
  wait $DP; say "driver exit $?"
  get $U/metrics | head -1; python3 -c "import requests;[print(l) for l in requests.get('$U/metrics',timeout=10).text.splitlines() if l.startswith(('vllm:prefix_cache','vllm:num_requests'))]"
  grep -i -E 'error|traceback' $W/dummy125.log | grep -v -i deprecat | head -20
  stop
fi

if [ "$PART" = 8b ]; then
  say "model qwen3-8b shape (16 GB, seed 1)"; python3 $HERE/make_model.py --shape qwen3-8b --out $W/m8b --seed 1 && ls -la $W/m8b || exit 4
  say "E7 8B restart-to-ready on the real weights"; serve $W/m8b ref8b && python3 $HERE/vexp.py greedy $U $W/ref8b.json; stop
  [ "$(left 250)" = 1 ] && { say "E7 8B restart-to-ready again"; serve $W/m8b ref8bw && stop; }
  [ "$(left 150)" = 1 ] || { say "8B hot/E6 skipped: budget"; exit 0; }
  say "8B dummy (rc-0)"; serve $W/m8b dummy8b --load-format dummy || exit 5
  say "E2/E7 8B hot, then E6 kill mid-transfer"; mkdir -p $W/g8b
  DRV --mode kill --url $U --gate $W/g8b --from rc-0 --pid -$VPID --resident ${RESIDENT:-0} \
    --steps $W/m8b/model.safetensors=rc-1,$W/m8b/model.safetensors=rc-2 & DP=$!
  if waitf $W/g8b/done.1 $DP; then
    python3 $HERE/vexp.py greedy $U $W/after8b.json &&
      python3 $HERE/vexp.py same $W/ref8b.json $W/after8b.json "E2 8B: after the update == reference run"
    say "E6 kill the engine mid-transfer (8B)"; touch $W/g8b/go.2
  fi
  wait $DP; say "driver exit $?"; kill -9 -- -"$VPID" 2>/dev/null; VPID=
fi
if [ "$PART" = serve ]; then
  # rolloutcore serve --transfer nccl (GPU 0) beside vLLM (GPU 1), driven by the Python client.
  [ -e $W/m125_seed2.safetensors ] || { python3 $HERE/make_model.py --shape opt125m --out $W/m125 --seed 1 &&
    python3 $HERE/make_model.py --shape opt125m --out $W/m125 --seed 2 --weights-file $W/m125_seed2.safetensors; } || exit 4
  rcwrap
  say "serve: vLLM dummy 125M (rc-0)"; serve $W/m125 dummy125s --load-format dummy || exit 5
  rm -rf $W/e2e; python3 $HERE/serve_e2e.py "$W/rc.sh" $U $W/m125 $W/m125_seed2.safetensors $W/e2e
  say "serve_e2e exit $?"; tail -c 3000 $W/e2e/serve.log; cp $W/e2e/serve.log "${OUT:-$W}/serve.log" 2>/dev/null
  stop
fi
say done
