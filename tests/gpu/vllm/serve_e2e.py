#!/usr/bin/env python3
"""`rolloutcore serve --transfer nccl` beside a REAL vLLM (tests/gpu/vllm/run_vllm.sh serve).

Expects vLLM on URL (started with --load-format dummy, the worker extension, GPU 1) and the model
files of make_model.py. Starts `rolloutcore serve` (NCCL sender on GPU 0), drives it with the
Python client (python/rolloutcore) and sends rollouts through its proxy:
  S1  serve bootstraps rc-0 against the engine and initialises NCCL
  S2  update rc-1 (seed-1 file) through POST /v1/updates: committed; proxied greedy ids equal
      vLLM's own answer for the same request; binding headers name rc-1
  S3  a 256-token proxied rollout in flight when update rc-2 (seed 2) is requested: the update
      waits for it; it is bound to rc-1 and its ids equal the same request run earlier under rc-1;
      the next one is bound to rc-2 and differs
  S4  vLLM's own prefix-cache counters: the first proxied request after the update hits nothing
  S5  SIGTERM: clean exit; `rolloutcore replay` verifies the journal, `rolloutcore audit` the
      provenance of every proxied rollout (trajectories file)
One JSON object per line. Usage: serve_e2e.py RC_BINARY URL MODEL_DIR SEED2_FILE WORKDIR
GPU-free dry run of this script (against vllm-double, `--transfer http`, synthetic sources):
RC_E2E_LOCAL=1 RC_E2E_MODEL=rc-double-model serve_e2e.py build/cli/rolloutcore URL - - WORKDIR
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "python"))
import rolloutcore  # noqa: E402

TOKEN = "gpu-e2e"
PROMPT = "policy weight update drain cache token"
LONG = " ".join(["reward rollout engine trainer version label prefix cache"] * 40)


def out(d):
    print(json.dumps(d), flush=True)


def post(url, body, timeout=120):
    req = urllib.request.Request(url, method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return dict(r.headers), json.loads(r.read())


LOCAL = os.environ.get("RC_E2E_LOCAL") == "1"
MODEL = os.environ.get("RC_E2E_MODEL", "m")


def complete(base, prompt, n):
    return post(base + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": n,
                                           "temperature": 0, "ignore_eos": True,
                                           "return_token_ids": True})


def metrics(url):
    m = {}
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:prefix_cache_hits_total") or line.startswith("vllm:prefix_cache_queries_total"):
                k, v = line.rsplit(" ", 1)
                m[k.split("{")[0]] = float(v)
    return m


def main():
    rc_bin, url, model_dir, seed2, work = sys.argv[1:6]
    seed1 = os.path.join(model_dir, "model.safetensors")
    src1, src2 = "safetensors:" + seed1, "safetensors:" + seed2
    if LOCAL:
        src1, src2 = "synthetic:4x64:1", "synthetic:4x64:2"
    os.makedirs(work, exist_ok=True)
    journal = os.path.join(work, "journal")
    traj = os.path.join(work, "trajectories.jsonl")
    cmd = [rc_bin, "serve", "--engine-url", url, "--journal", journal, "--trajectories", traj,
           "--port", "0", "--auth-token", TOKEN, "--initial-source", src1, "--initial-label", "rc-0",
           "--initial-checkpoint", "dummy:", "--initial-run", "gpu-e2e", "--initial-step", "0"]
    if not LOCAL:
        cmd += ["--transfer", "nccl", "--rendezvous", "127.0.0.1:0", "--cuda-device", "0"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(os.path.join(work, "serve.log"), "w"),
                            text=True)
    addr = None
    while time.time() - t0 < 180:
        line = proc.stdout.readline()
        if line.startswith("listening on "):
            addr = line.split()[-1].strip()
            break
        if proc.poll() is not None:
            break
    ok = addr is not None
    out({"check": "S1 serve --transfer nccl bootstraps against real vLLM and initialises NCCL",
         "pass": ok, "start_s": round(time.time() - t0, 3), "addr": addr})
    if not ok:
        print(open(os.path.join(work, "serve.log")).read()[-4000:])
        return 1
    svc = "http://" + addr
    c = rolloutcore.Client(svc, TOKEN)
    fails = 0
    try:
        st = c.state()
        digest = c.manifest_digest(src1)
        ident1 = rolloutcore.Identity(digest, checkpoint=seed1, run="gpu-e2e", step=1)
        t = time.time()
        r1 = c.update("rc-1", ident1, src1, update_id="gpu-u1")
        wall1 = time.time() - t
        h, proxied = complete(svc, PROMPT, 32)
        _, direct = complete(url, PROMPT, 32)
        same = proxied["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
        ok = (st["lifecycle"] == "READY" and r1["outcome"] == "committed" and same and
              h.get("X-RolloutCore-Version") == "rc-1")
        fails += not ok
        out({"check": "S2 update rc-1 via the trainer API; proxied greedy == vLLM direct; bound to rc-1",
             "pass": ok, "before": st["committed"], "outcome": r1["outcome"], "update_wall_s": round(wall1, 3),
             "timings": r1.get("timings"), "binding": {k: v for k, v in h.items() if k.startswith("X-RolloutCore")},
             "ids_head": proxied["choices"][0]["token_ids"][:8]})

        # S3: the expected long rollout under rc-1, then the same one racing update rc-2.
        _, expect_long = complete(svc, "policy drain", 256)
        res = {}

        def long_rollout():
            ts = time.time()
            res["h"], res["body"] = complete(svc, "policy drain", 256)
            res["t0"], res["t1"] = ts, time.time()

        th = threading.Thread(target=long_rollout)
        th.start()
        time.sleep(0.3)
        ident2 = rolloutcore.Identity(digest, checkpoint=seed2, run="gpu-e2e", step=2)
        t_req = time.time()
        r2 = c.update("rc-2", ident2, src2, update_id="gpu-u2")
        t_done = time.time()
        th.join(120)
        h_after, after_long = complete(svc, "policy drain", 256)
        bound_old = res.get("h", {}).get("X-RolloutCore-Version") == "rc-1"
        same_old = res.get("body", {}).get("choices", [{}])[0].get("token_ids") == expect_long["choices"][0]["token_ids"]
        waited = res.get("t1", 1e18) <= t_done
        differs = after_long["choices"][0]["token_ids"] != expect_long["choices"][0]["token_ids"]
        ok = (r2["outcome"] == "committed" and bound_old and same_old and waited and differs and
              h_after.get("X-RolloutCore-Version") == "rc-2")
        fails += not ok
        out({"check": "S3 live 256-token rollout during update rc-2: stays on rc-1 (ids as before), update waits, next on rc-2",
             "pass": ok, "outcome": r2["outcome"], "rollout_version": res.get("h", {}).get("X-RolloutCore-Version"),
             "rollout_ids_equal_rc1_run": same_old, "rollout_finished_before_update_returned": waited,
             "rollout_s": round(res.get("t1", 0) - res.get("t0", 0), 3), "update_wall_s": round(t_done - t_req, 3),
             "timings": r2.get("timings"), "next_version": h_after.get("X-RolloutCore-Version"), "next_differs": differs})

        m0 = metrics(url)
        complete(svc, LONG, 8)
        m1 = metrics(url)
        complete(svc, LONG, 8)
        m2 = metrics(url)
        first = m1["vllm:prefix_cache_hits_total"] - m0["vllm:prefix_cache_hits_total"]
        second = m2["vllm:prefix_cache_hits_total"] - m1["vllm:prefix_cache_hits_total"]
        ok = first == 0 and second > 0
        fails += not ok
        out({"check": "S4 after the update, the first proxied request hits no cached block; the second does",
             "pass": ok, "first_hits": first, "second_hits": second,
             "queries": m1["vllm:prefix_cache_queries_total"] - m0["vllm:prefix_cache_queries_total"]})
        with urllib.request.urlopen(svc + "/metrics", timeout=10) as r:
            rc_metrics = [l for l in r.read().decode().splitlines() if l.startswith("rolloutcore_updates_total")
                          or l.startswith("rolloutcore_rollouts_")]
        out({"rolloutcore_metrics": rc_metrics})
    except Exception as e:  # report, then still stop serve and check the journal
        fails += 1
        out({"check": "exception", "pass": False, "error": repr(e)[:500]})
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = -9
    rep = subprocess.run([rc_bin, "replay", journal], capture_output=True, text=True, timeout=120)
    aud = subprocess.run([rc_bin, "audit", journal, "--trajectories", traj], capture_output=True, text=True,
                         timeout=120)
    ok = code == 0 and rep.returncode == 0 and aud.returncode == 0
    fails += not ok
    out({"check": "S5 SIGTERM exit 0; replay verifies the journal; audit verifies every proxied rollout",
         "pass": ok, "serve_exit": code, "replay_exit": rep.returncode, "audit_exit": aud.returncode,
         "replay_tail": rep.stdout[-1200:] + rep.stderr[-400:], "audit_tail": aud.stdout[-1200:] + aud.stderr[-400:]})
    return 0 if fails == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
