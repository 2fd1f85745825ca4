#!/usr/bin/env python3
"""Proof of content on ONE GPU: `rolloutcore serve --transfer reload` beside a real vLLM that
reloads checkpoints from its own disk (tests/gpu/vllm/run_vllm.sh proof125m | proof8b).

This script owns both processes: it makes the checkpoints, starts vLLM on GPU 0 (real weights,
the worker extension, prefix caching, enforce-eager) and `rolloutcore serve` beside it, and
drives them with the Python client. Steps:
  P0  provenance (versions, GPU)
  P1  checkpoints: seed-1 and seed-2 directories (one manifest) and a corrupt directory whose
      reload fails on vLLM after its first shard was loaded (make_model.py --corrupt-from)
  P2  rc_weight_digest over /collective_rpc, 5 times: wall time, the extension's own time, bytes
  P3  serve bootstraps rc-1 on seed-1 with require_weight_digest; update rc-2 -> seed-2:
      committed; one manifest, two engine digests, both journaled; greedy ids under rc-2 kept
  P4  >= 100 proxied rollouts (greedy and temperature 1.0, 16 at once) under rc-2, then
      `rolloutcore audit --engine` re-scores them at batch 1, twice: |logprob diff| figures
  P5  update rc-3 -> the corrupt directory: the reload fails midway: tainted (500), TAINTED,
      a proxied request 503
  P6  restore rc-2 from the seed-1 directory (the wrong weights): stays TAINTED, names tensors
  P7  restore rc-2 from the seed-2 directory: committed at a new generation, the journaled
      digest is rc-2's, greedy ids equal those of rc-2 before the incident
  P8  (optional: RC_PROOF_ADOPT=1) SIGKILL vLLM, start it on the seed-2 directory: the monitor
      taints (engine_replaced); restore(adopt=True) -> committed
  P9  `rolloutcore audit JOURNAL --engine` (live digest) and, after SIGTERM, `rolloutcore replay`
One JSON object per line: {"step": ..., "pass": bool, ...}; the last line is the summary.
Every wait is bounded; the whole run stops at RC_PROOF_BUDGET_S (default 540) seconds.

  Usage: proof.py RC_BINARY SIZE WORKDIR        SIZE: 125m | 8b | tiny
  Env:   RC_PROOF_LOCAL=1 runs against the test double (GPU-free dry run; RC_PROOF_DOUBLE = its
         binary, default build/fixtures/vllm-double); RC_PROOF_MODEL_PY = the Python that runs
         make_model.py (needs torch, safetensors, tokenizers; default this one);
         RC_PROOF_ROLLOUTS (default 128), RC_PROOF_ADOPT (default 1, 0 for 8b),
         RC_VLLM_PORT (default 8000; local: a free port).
On the double, P5 cannot fail the way vLLM does (it does not know a model's parameter names):
the double's reload fault {"reload": "fail_mid"} (half the tensors replaced, then vLLM's 500)
stands in for it, and the JSON line says so.
"""
import concurrent.futures
import hashlib
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))
import rolloutcore  # noqa: E402

LOCAL = os.environ.get("RC_PROOF_LOCAL") == "1"
TOKEN = "proof-token"
MODEL = "m"  # vLLM: --served-model-name m; the double: --model-name m
EXT = "rolloutcore.vllm_ext.RolloutCoreWorkerExtension"
PROMPTS = ["policy weight update drain cache token", "alpha beta gamma delta rollout engine",
           "trainer version label prefix resume pause 17"]
WORDS = ["alpha", "beta", "gamma", "delta", "policy", "weight", "update", "drain", "cache", "token",
         "reward", "rollout", "engine", "trainer", "version", "label", "prefix", "resume", "pause"]
SHAPES = {"125m": "opt125m", "8b": "qwen3-8b", "tiny": "tiny"}
T0 = time.time()
RESULTS = {}


class BudgetExceeded(Exception):
    pass


def out(d):
    d["t_s"] = round(time.time() - T0, 1)
    if "step" in d and "pass" in d and d["step"] != "summary":
        RESULTS[d["step"]] = bool(d["pass"])
    print(json.dumps(d), flush=True)


def left_s():
    return BUDGET_S - (time.time() - T0)


TEXT_BYTES_MAX = 4 << 20  # a non-JSON answer kept for the caller (/metrics, error pages)


def http(method, url, body=None, headers=None, timeout=30.0):
    """(status, headers, parsed JSON or text); status 0 with the error when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, hdrs, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, hdrs, raw = e.code, dict(e.headers), e.read()
    except (OSError, ValueError) as e:
        return 0, {}, repr(e)[:300]
    try:
        return status, hdrs, json.loads(raw)
    except ValueError:
        # Whole up to a bound: vLLM's /metrics runs past 2000 characters before its prefix-cache
        # counters, and a shorter cut read as an engine that exports none.
        return status, hdrs, raw.decode(errors="replace")[:TEXT_BYTES_MAX]


def wait_until(pred, timeout_s, every_s=0.1):
    """pred() until truthy or timeout; returns its last value."""
    end = time.time() + min(timeout_s, max(1.0, left_s()))
    v = pred()
    while not v and time.time() < end:
        time.sleep(every_s)
        v = pred()
    return v


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- the engine (vLLM or the double)
class Engine:
    def __init__(self, work, port):
        self.work, self.port = work, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc = None
        self.log_path = os.path.join(work, "engine.log")

    def command(self, model_dir):
        if LOCAL:
            double = os.environ.get("RC_PROOF_DOUBLE", os.path.join(ROOT, "build", "fixtures", "vllm-double"))
            return [double, "--port", str(self.port), "--model-name", MODEL, "--worker-extension-cls", EXT,
                    "--load-format", "auto", "--token-delay-ms", "1"]
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model_dir, "--served-model-name", MODEL,
                "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
                "--gpu-memory-utilization", os.environ.get("RC_PROOF_GPU_UTIL", "0.5"),
                "--enable-prefix-caching", "--max-model-len", "2048", "--dtype", "bfloat16",
                "--worker-extension-cls", EXT]

    def start(self, model_dir, timeout_s):
        """Starts the engine on model_dir's weights; (ready, seconds to /health 200)."""
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_USE_FLASHINFER_SAMPLER="0", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", CUDA_VISIBLE_DEVICES="0",
                   PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        t = time.time()
        log = open(self.log_path, "a")
        log.write(f"\n===== engine start on {model_dir} at {time.strftime('%H:%M:%S')}\n")
        log.flush()
        self.proc = subprocess.Popen(self.command(model_dir), stdout=log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        log.close()
        with open(os.path.join(self.work, "engine.pgid"), "w") as f:  # for the caller's backstop kill
            f.write(str(self.proc.pid))

        def up():
            return self.proc.poll() is not None or http("GET", self.url + "/health", timeout=2)[0] == 200

        ready = wait_until(up, timeout_s, 0.2)
        if not ready or self.proc.poll() is not None:
            return False, round(time.time() - t, 3)
        if LOCAL:  # the double starts on its own tensors: load model_dir as vLLM would at start
            st, _, body = self.rpc("reload_weights", kwargs={"weights_path": model_dir}, timeout=60)
            if st != 200:
                out({"note": "double: initial reload failed", "status": st, "body": str(body)[:300]})
                return False, round(time.time() - t, 3)
        return True, round(time.time() - t, 3)

    def rpc(self, method, args=None, kwargs=None, timeout=60):
        body = {"method": method}
        if args is not None:
            body["args"] = args
        if kwargs is not None:
            body["kwargs"] = kwargs
        return http("POST", self.url + "/collective_rpc", body, timeout=timeout)

    def kill(self):
        """SIGKILL to the engine's whole process group (vLLM's API server, engine core, workers)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None


# ---------------------------------------------------------------- rolloutcore serve
class Serve:
    def __init__(self, rc_bin, work):
        self.rc_bin, self.work = rc_bin, work
        self.journal = os.path.join(work, "journal")
        self.traj = os.path.join(work, "trajectories.jsonl")
        self.log_path = os.path.join(work, "serve.log")
        self.proc, self.url = None, None

    def start(self, engine_url, src1, seed1_dir, timeout_s):
        cmd = [self.rc_bin, "serve", "--engine-url", engine_url, "--journal", self.journal,
               "--trajectories", self.traj, "--port", "0", "--auth-token", TOKEN, "--transfer", "reload",
               "--initial-source", src1, "--initial-label", "rc-1", "--initial-checkpoint", seed1_dir,
               "--initial-run", "proof", "--initial-step", "1", "--require-weight-digest", "true",
               "--engine-monitor-interval-ms", "200", "--weight-digest-check-interval-ms", "10000",
               "--transfer-timeout-ms", "240000", "--call-timeout-ms", "30000", "--admit-wait-ms", "2000",
               "--request-timeout-ms", "120000"]
        out({"serve_command": " ".join(cmd)})
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = queue.Queue()

        def pump():  # every line to the log; the first ones also to the start-up wait below
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                lines.put(line)
            log.close()

        threading.Thread(target=pump, daemon=True).start()
        end = time.time() + timeout_s
        while time.time() < end:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    return False
                continue
            if line.startswith("listening on "):
                self.url = "http://" + line.split()[-1].strip()
                return True
        return False

    def stop(self, timeout_s=60):
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = -9
        self.proc = None
        return code

    def kill(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc = None

    def run(self, args, timeout_s):
        """A rolloutcore subcommand: (exit code, stdout, stderr); 124 on timeout."""
        try:
            p = subprocess.run([self.rc_bin] + args, capture_output=True, text=True,
                               timeout=min(timeout_s, max(5.0, left_s())))
            return p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            so = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            return 124, so, "timeout"


# ---------------------------------------------------------------- helpers over serve
def complete(base, prompt, n, temperature=0.0, rollout_id=None, timeout=120):
    headers = {"X-RolloutCore-Rollout-Id": rollout_id} if rollout_id else {}
    return http("POST", base + "/v1/completions",
                {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": temperature,
                 "ignore_eos": True, "return_token_ids": True}, headers, timeout)


def greedy_ids(base, tag):
    ids, versions = [], []
    for i, p in enumerate(PROMPTS):
        st, h, body = complete(base, p, 32, rollout_id=f"{tag}-{i}")
        ok = st == 200 and isinstance(body, dict)
        ids.append(body["choices"][0].get("token_ids") if ok else None)
        versions.append(h.get("X-RolloutCore-Version") if ok else f"HTTP {st}")
    return ids, versions


def events(c, types):
    """Every journal record of the given types, in order (paged)."""
    got, since = [], 0
    for _ in range(1000):
        page = c.events(since=since, limit=1000)
        for r in page.get("records", []):
            ev = r.get("event", r)
            if ev.get("type") in types:
                got.append(dict(ev, seq=r.get("seq"), wall_time_ms=r.get("wall_time_ms")))
        if page.get("next_since", since) <= since or page.get("next_since") >= page.get("head_seq", 0):
            break
        since = page["next_since"]
    return got


def published(c, label):
    return [e for e in events(c, {"VersionPublished"}) if e.get("version", {}).get("label") == label]


# The double's fake model answers from a counter of weight loads, not from the tensors' values: the
# same weights loaded again give other tokens and scores there. So "the same ids/scores as before
# the incident" is checked on vLLM only; the digests (which the double computes over the tensors'
# values) are checked everywhere.
SAME_WEIGHTS_SAME_TOKENS = not LOCAL
NOT_ON_DOUBLE = "not checked on the double: its fake model's output follows a load counter, not the tensors"


def call(fn, *args, **kwargs):
    """(HTTP status, body) of a client call, whether it answered 2xx or raised."""
    try:
        return 200, fn(*args, **kwargs)
    except rolloutcore.RolloutCoreError as e:
        return e.status, dict(e.body, message=e.message)
    except OSError as e:
        return 0, {"error": repr(e)[:300]}


MANIFEST_ROUTE = {}  # how each source's manifest was obtained (reported in P3/P5)


def manifest_digest(c, eng, src):
    """The source's manifest digest from serve's GET /v1/manifest; where serve refuses it (a
    checkpoint directory is validated as a file on serve's host there), from the engine's
    rc_checkpoint_manifest, which is what serve's reload preflight asks."""
    code, body = call(c.manifest_digest, src)
    if code == 200:
        MANIFEST_ROUTE[src] = "GET /v1/manifest"
        return body
    st, _, doc = eng.rpc("rc_checkpoint_manifest", args=[src.split(":", 1)[1]], timeout=60)
    r = (doc.get("results") or [{}])[0] if st == 200 and isinstance(doc, dict) else {}
    MANIFEST_ROUTE[src] = (f"GET /v1/manifest answered {code} ({str(body.get('message'))[:120]}); "
                           f"engine rc_checkpoint_manifest: {r.get('error') or 'ok'}")
    return r.get("manifest_digest") or ""


def digest_of(d):
    return (d or {}).get("combined") if isinstance(d, dict) else None


def host_provenance(packages):
    """(package versions, GPU line from nvidia-smi, the checkout's commit) for a step's F0/P0/C0."""
    from importlib import metadata
    vers = {}
    for pkg in packages:
        try:
            vers[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            vers[pkg] = None
    gpu = None
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    rev = subprocess.run(["git", "-C", ROOT, "log", "-1", "--format=%H"], capture_output=True, text=True,
                         timeout=10).stdout.strip()
    return vers, gpu, rev


# ---------------------------------------------------------------- steps
def p0_provenance(rc_bin, size):
    vers, gpu, rev = host_provenance(("vllm", "torch", "safetensors", "tokenizers"))
    with open(rc_bin, "rb") as f:  # run_vllm.sh passes a wrapper script and prints the binary's own
        sha = hashlib.sha256(f.read()).hexdigest()
    out({"step": "P0", "what": "provenance", "pass": True, "mode": "local (vllm-double)" if LOCAL else "vLLM on GPU 0",
         "size": size, "versions": vers, "python": sys.version.split()[0], "gpu": gpu, "rolloutcore_commit": rev,
         "rc_binary_sha256": sha[:16], "budget_s": BUDGET_S})


def p1_models(size, work):
    py = os.environ.get("RC_PROOF_MODEL_PY", sys.executable)
    shape = SHAPES[size]
    d1, d2, bad = (os.path.join(work, n) for n in ("seed1", "seed2", "corrupt"))
    # 8b: shard 1 is a symlink to seed 2's file, so its 16 GB are not written a third time.
    corrupt_mode = os.environ.get("RC_PROOF_CORRUPT_MODE", "link" if size == "8b" else "half")
    mm = [py, os.path.join(HERE, "make_model.py"), "--shape", shape]
    steps = [("seed1", mm + ["--out", d1, "--seed", "1"], os.path.join(d1, "model.safetensors")),
             ("seed2", mm + ["--out", d2, "--seed", "2", "--tokenizer-from", d1],
              os.path.join(d2, "model.safetensors")),
             ("corrupt", mm + ["--out", bad, "--corrupt-from", d2, "--corrupt-mode", corrupt_mode],
              os.path.join(bad, "model-00002-of-00002.safetensors"))]
    took, ok = {}, True
    for name, cmd, done in steps:
        t = time.time()
        marker = os.path.join(work, name + ".done")  # outside the checkpoint: vLLM globs it
        if os.path.exists(done) and os.path.exists(marker):
            took[name] = "kept"
            continue
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10.0, left_s() - 60))
        took[name] = round(time.time() - t, 1)
        if p.returncode != 0:
            ok = False
            out({"note": f"make_model {name} failed", "stderr": p.stderr[-1500:]})
            break
        open(marker, "w").close()
        if name == "corrupt":
            took["corrupt_detail"] = json.loads(p.stdout.strip().splitlines()[-1])
    files = {}
    for d in (d1, d2, bad):
        if os.path.isdir(d):
            files[os.path.basename(d)] = sorted((f, os.path.getsize(os.path.join(d, f)),
                                                 os.path.islink(os.path.join(d, f)))
                                                for f in os.listdir(d) if f.endswith(".safetensors"))
    out({"step": "P1", "what": "checkpoints", "pass": ok, "shape": shape, "seconds": took, "safetensors": files})
    return ok, d1, d2, bad


def p2_digest(eng):
    runs = []
    for _ in range(5):
        t = time.time()
        st, _, body = eng.rpc("rc_weight_digest", timeout=120)
        wall = round(time.time() - t, 4)
        r = (body.get("results") or [{}])[0] if st == 200 and isinstance(body, dict) else {}
        runs.append({"status": st, "wall_s": wall, "extension_ms": r.get("elapsed_ms"), "bytes": r.get("bytes"),
                     "tensors": len(r.get("tensors") or {}), "combined": (r.get("combined") or "")[:16],
                     "error": None if st == 200 else str(body)[:200]})
    combined = {r["combined"] for r in runs}
    ok = all(r["status"] == 200 for r in runs) and len(combined) == 1 and "" not in combined
    out({"step": "P2", "what": "rc_weight_digest x5 over /collective_rpc", "pass": ok, "runs": runs})
    return runs[0]["combined"] if ok else None


def p3_bootstrap_update(c, eng, svc, src1, src2, d2, p2_combined):
    st = c.state()
    ok_boot = st.get("lifecycle") == "READY" and st.get("committed", {}).get("label") == "rc-1"
    probes = [e for e in events(c, {"EngineProbed"}) if digest_of(e.get("digest"))]
    boot_digest = digest_of(probes[0]["digest"]) if probes else None
    m1, m2 = manifest_digest(c, eng, src1), manifest_digest(c, eng, src2)
    ids_rc1, v_rc1 = greedy_ids(svc, "p3-rc1")
    t = time.time()
    code, r2 = call(c.update, "rc-2", rolloutcore.Identity(m2, checkpoint=d2, run="proof", step=2), src2,
                    update_id="proof-u-rc2")
    wall = round(time.time() - t, 3)
    pubs = published(c, "rc-2")
    rc2_digest = pubs[-1].get("engine_digest") if pubs else None
    ids_rc2, v_rc2 = greedy_ids(svc, "p3-rc2")
    st2 = c.state()
    ok = (ok_boot and code == 200 and r2.get("outcome") == "committed" and m1 == m2 and bool(boot_digest)
          and bool(rc2_digest) and boot_digest != rc2_digest and st2.get("committed", {}).get("label") == "rc-2"
          and v_rc1 == ["rc-1"] * 3 and v_rc2 == ["rc-2"] * 3 and ids_rc1 != ids_rc2)
    out({"step": "P3",
         "what": "bootstrap rc-1 (seed 1), update rc-2 (seed 2): one manifest, two journaled engine digests",
         "pass": ok, "bootstrap_lifecycle": st.get("lifecycle"), "update_http": code,
         "outcome": r2.get("outcome"), "reason": r2.get("reason"), "update_wall_s": wall, "timings": r2.get("timings"),
         "manifest_rc1": m1[:16], "manifest_rc2": m2[:16], "manifest_identical": m1 == m2,
         "manifest_route": MANIFEST_ROUTE.get(src2),
         "engine_digest_rc1_bootstrap": (boot_digest or "")[:16],
         "engine_digest_rc2_published": (rc2_digest or "")[:16],
         "digests_differ": boot_digest != rc2_digest, "bootstrap_digest_equals_p2": boot_digest is not None and
         p2_combined is not None and boot_digest.startswith(p2_combined),
         "rc2_generation": st2.get("committed", {}).get("generation"),
         "greedy_ids_rc1_head": [x[:6] if x else x for x in ids_rc1],
         "greedy_ids_rc2_head": [x[:6] if x else x for x in ids_rc2]})
    return ok, rc2_digest, ids_rc2, st2.get("committed", {}).get("generation")


def p4_rollouts(svc, n, conc):
    rng = random.Random(1234)
    jobs = []
    for i in range(n):
        greedy = i % 2 == 0
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 40)))
        jobs.append((f"p4-{'g' if greedy else 's'}-{i:03d}", prompt, rng.randint(32, 64), 0.0 if greedy else 1.0))

    def one(job):
        rid, prompt, n_tok, temp = job
        st, h, body = complete(svc, prompt, n_tok, temp, rid)
        ok = st == 200 and isinstance(body, dict)
        return {"id": rid, "status": st, "version": h.get("X-RolloutCore-Version"),
                "tokens": len(body["choices"][0].get("token_ids") or []) if ok else 0,
                "logprobs_stripped": ok and body["choices"][0].get("logprobs") is None}

    t = time.time()
    with concurrent.futures.ThreadPoolExecutor(conc) as ex:
        res = list(ex.map(one, jobs, timeout=max(30.0, left_s() - 120)))
    wall = round(time.time() - t, 3)
    ok = all(r["status"] == 200 and r["version"] == "rc-2" for r in res)
    out({"step": "P4a", "what": "proxied rollouts under rc-2", "pass": ok, "rollouts": len(res), "concurrency": conc,
         "greedy": sum(r["id"].startswith("p4-g") for r in res),
         "sampled_t1": sum(r["id"].startswith("p4-s") for r in res),
         "failed": [r for r in res if r["status"] != 200][:5], "output_tokens": sum(r["tokens"] for r in res),
         "logprobs_stripped_from_answers": all(r["logprobs_stripped"] for r in res), "wall_s": wall})
    return ok


def split_figures(rollouts, prefix):
    rs = [r for r in rollouts if r.get("rollout_id", "").startswith(prefix) and r.get("checked")]
    comp = sum(r.get("compared", 0) for r in rs)
    return {"rollouts": len(rs), "tokens": sum(r.get("tokens", 0) for r in rs), "compared": comp,
            "top1": sum(r.get("top1", 0) for r in rs),
            "max_abs_diff": max((r.get("max_abs_diff", 0) for r in rs), default=None),
            "mean_abs_diff": sum(r.get("mean_abs_diff", 0) * r.get("compared", 0) for r in rs) / comp if comp else None,
            "unscored": sum(r.get("unscored", 0) for r in rs), "unrecorded": sum(r.get("unrecorded", 0) for r in rs)}


def p4_audit(serve, engine_url, run):
    t = time.time()
    code, so, se = serve.run(["audit", serve.journal, "--trajectories", serve.traj, "--engine", engine_url, "--json"],
                             300)
    wall = round(time.time() - t, 2)
    try:
        doc = json.loads(so)
    except ValueError:
        out({"step": f"P4b{run}", "what": "audit re-score", "pass": False, "exit": code, "stdout": so[-800:],
             "stderr": se[-1500:]})
        return None
    rv = doc.get("reverification") or {}
    rolls = [r for r in rv.get("rollouts", []) if r.get("rollout_id", "").startswith("p4-")]
    checked = [r for r in rolls if r.get("checked")]
    g, s, allp4 = split_figures(rolls, "p4-g"), split_figures(rolls, "p4-s"), split_figures(rolls, "p4-")
    clean = allp4["unscored"] == 0 and allp4["unrecorded"] == 0
    smallest = allp4["max_abs_diff"] if clean else None
    summary_line = [ln for ln in se.splitlines() if ln.startswith("re-verification against")]
    ok = len(checked) >= 100 and len(checked) == len(rolls) and clean
    out({"step": f"P4b{run}", "what": f"audit --engine re-scores every rollout at batch 1 (run {run})", "pass": ok,
         "exit": code,
         "wall_s": wall, "p4_rollouts_checked": len(checked), "p4_rollouts_offered": len(rolls),
         "tokens": allp4["tokens"], "compared": allp4["compared"], "greedy": g, "sampled_t1": s,
         "max_abs_diff": allp4["max_abs_diff"], "mean_abs_diff": allp4["mean_abs_diff"],
         "greedy_top1_matches": f"{g['top1']} of {g['tokens']}",
         "smallest_passing_tolerance": smallest, "default_tolerance": rv.get("tolerance"),
         "failed_at_default_tolerance": rv.get("failed"), "summary_line": summary_line[-1:] or se[-300:],
         "skipped_detail": [r.get("detail") for r in rolls if not r.get("checked")][:3]})
    return {r["rollout_id"]: r for r in checked}


def p4_spread(a, b):
    if not a or not b:
        out({"step": "P4c", "what": "run-to-run spread of the engine's scores", "pass": False,
             "reason": "an audit run failed"})
        return
    common = sorted(set(a) & set(b))
    dmax = [abs(a[k]["max_abs_diff"] - b[k]["max_abs_diff"]) for k in common]
    dmean = [abs(a[k]["mean_abs_diff"] - b[k]["mean_abs_diff"]) for k in common]
    same = sum(1 for k in common if a[k]["max_abs_diff"] == b[k]["max_abs_diff"] and a[k]["top1"] == b[k]["top1"])
    out({"step": "P4c", "what": "run-to-run spread of the engine's scores (audit run 1 vs run 2, per rollout)",
         "pass": len(common) >= 100, "rollouts": len(common), "identical_figures": same,
         "max_delta_of_max_abs_diff": max(dmax, default=None), "max_delta_of_mean_abs_diff": max(dmean, default=None)})


def p5_ambiguous(c, svc, eng, src_bad, bad_dir):
    fault = None
    if LOCAL:
        fault = http("POST", eng.url + "/_double/faults", {"reload": "fail_mid"}, timeout=10)[0]
    m3 = manifest_digest(c, eng, src_bad)
    t = time.time()
    code, r = call(c.update, "rc-3", rolloutcore.Identity(m3, checkpoint=bad_dir, run="proof", step=3), src_bad,
                   update_id="proof-u-rc3")
    wall = round(time.time() - t, 3)
    st = c.state()
    pst, _, pbody = complete(svc, PROMPTS[0], 8, rollout_id="p5-refused", timeout=30)
    # What the failed reload left in the engine, asked directly (diagnostic: on vLLM the layers
    # it did not reach stay on the meta device, so the digest is expected to fail there).
    dst, _, dbody = eng.rpc("rc_weight_digest", timeout=60)
    if LOCAL:
        http("POST", eng.url + "/_double/faults", {"reload": "none"}, timeout=10)
    ok = code == 500 and r.get("outcome") == "tainted" and st.get("lifecycle") == "TAINTED" and pst == 503
    out({"step": "P5", "what": "update rc-3 from a checkpoint whose reload fails midway: tainted, TAINTED, proxy 503",
         "pass": ok, "how": ("the double's reload fault {\"reload\": \"fail_mid\"} (half the tensors replaced, then "
                             "vLLM's 500); the double does not know parameter names" if LOCAL else
                             "vLLM's AutoWeightsLoader on the corrupt directory's second shard (unknown tensor name)"),
         "fault_set_http": fault, "manifest_rc3": m3[:16], "update_http": code, "outcome": r.get("outcome"),
         "reason": (r.get("reason") or r.get("message") or "")[:600],
         "update_wall_s": wall, "lifecycle": st.get("lifecycle"), "taint": st.get("taint"),
         "proxied_http": pst, "proxied_body": str(pbody)[:200], "engine_digest_after_failure_http": dst,
         "engine_digest_after_failure": (digest_of((dbody.get("results") or [{}])[0]) or "")[:16]
         if dst == 200 and isinstance(dbody, dict) else str(dbody)[:300]})
    return ok


def p6_wrong_restore(c, src1):
    t = time.time()
    code, r = call(c.restore, "rc-2", source=src1, restore_id="proof-r-wrong")
    wall = round(time.time() - t, 3)
    st = c.state()
    reason = r.get("reason") or r.get("message") or ""
    ok = code != 200 and r.get("outcome") != "committed" and st.get("lifecycle") == "TAINTED" and "tensor" in reason
    out({"step": "P6",
         "what": "restore rc-2 from the seed-1 directory (wrong weights): stays TAINTED, reason names tensors",
         "pass": ok, "restore_http": code, "outcome": r.get("outcome"), "reason": reason[:900], "wall_s": wall,
         "lifecycle": st.get("lifecycle"), "taint_cause": (st.get("taint") or {}).get("cause")})
    return ok


def p7_restore(c, svc, src2, rc2_digest, ids_rc2, rc2_gen, eng):
    t = time.time()
    code, r = call(c.restore, "rc-2", source=src2, restore_id="proof-r-seed2")
    wall = round(time.time() - t, 3)
    st = c.state()
    pubs = published(c, "rc-2")
    restored_digest = pubs[-1].get("engine_digest") if pubs else None
    ids, versions = greedy_ids(svc, "p7")
    dst, _, dbody = eng.rpc("rc_weight_digest", timeout=60)
    live = digest_of((dbody.get("results") or [{}])[0]) if dst == 200 and isinstance(dbody, dict) else None
    gen = st.get("committed", {}).get("generation")
    ok = (code == 200 and r.get("outcome") == "committed" and st.get("lifecycle") == "READY"
          and st.get("committed", {}).get("label") == "rc-2" and gen is not None and rc2_gen is not None
          and gen > rc2_gen and restored_digest == rc2_digest and versions == ["rc-2"] * 3
          and (ids == ids_rc2 or not SAME_WEIGHTS_SAME_TOKENS))
    out({"step": "P7",
         "what": "restore rc-2 from the seed-2 directory: committed, new generation, rc-2's digest, same greedy ids",
         "pass": ok, "restore_http": code, "outcome": r.get("outcome"), "reason": r.get("reason"), "wall_s": wall,
         "timings": r.get("timings"), "lifecycle": st.get("lifecycle"), "committed": st.get("committed"),
         "generation_before_incident": rc2_gen, "published_rc2_count": len(pubs),
         "journaled_digest_equals_rc2": restored_digest == rc2_digest, "digest": (restored_digest or "")[:16],
         "live_engine_digest_matches": live is not None and rc2_digest is not None and rc2_digest.startswith(live[:16]),
         "greedy_ids_equal_rc2_before_incident": ids == ids_rc2 if SAME_WEIGHTS_SAME_TOKENS else NOT_ON_DOUBLE,
         "versions": versions})
    return ok


def p8_adopt(c, svc, eng, d2, rc2_digest, ids_rc2, start_timeout_s):
    # Let the monitor (200 ms) see the engine once more after the last rollout: a rollout that
    # finished after its last sight is suspect by the audit's rule, rightly, and P9b would say so.
    time.sleep(1.0)
    eng.kill()
    t_kill = time.time()
    ready, start_s = eng.start(d2, start_timeout_s)
    t_back = time.time()
    if not ready:
        out({"step": "P8", "what": "engine killed and restarted on seed 2; monitor taints; adopt restores",
             "pass": False,
             "reason": "the engine did not come back", "start_s": start_s})
        return False
    tainted = wait_until(lambda: c.state().get("lifecycle") == "TAINTED", 60, 0.05)
    t_seen = time.time()
    st = c.state()
    taints = [e for e in events(c, {"StateChanged"})
              if e.get("to") == "TAINTED" and e.get("wall_time_ms", 0) >= t_kill * 1000]
    journal_after_back_s = round(taints[-1]["wall_time_ms"] / 1000.0 - t_back, 3) if taints else None
    with urllib.request.urlopen(svc + "/metrics", timeout=10) as m:  # the monitor's own counters
        monitor = [ln for ln in m.read().decode().splitlines()
                   if ln.startswith("rolloutcore_") and ("monitor" in ln or "probe" in ln) and not ln.startswith("#")]
    code, r = call(c.restore, "rc-2", adopt=True, restore_id="proof-r-adopt")
    st2 = c.state()
    pubs = published(c, "rc-2")
    ids, versions = greedy_ids(svc, "p8")
    ok = (bool(tainted) and (st.get("taint") or {}).get("cause") == "engine_replaced" and code == 200
          and r.get("outcome") == "committed" and st2.get("lifecycle") == "READY"
          and (pubs[-1].get("engine_digest") if pubs else None) == rc2_digest
          and (ids == ids_rc2 or not SAME_WEIGHTS_SAME_TOKENS))
    out({"step": "P8",
         "what": "engine killed and restarted on seed 2: monitor taints (engine_replaced); restore(adopt) commits",
         "pass": ok, "restart_s": start_s, "kill_to_back_s": round(t_back - t_kill, 3),
         "taint_seen_after_back_s": round(t_seen - t_back, 3), "taint_journaled_after_back_s": journal_after_back_s,
         "taint": st.get("taint"), "monitor_metrics": monitor[:8], "adopt_http": code, "outcome": r.get("outcome"),
         "reason": r.get("reason"),
         "timings": r.get("timings"), "lifecycle": st2.get("lifecycle"), "committed": st2.get("committed"),
         "greedy_ids_equal_rc2": ids == ids_rc2 if SAME_WEIGHTS_SAME_TOKENS else NOT_ON_DOUBLE,
         "versions": versions})
    return ok


def p9_verdicts(serve, engine_url, tolerance):
    """P9a the live digest, P9b the audit's verdict, P9c replay (after SIGTERM)."""
    code, so, se = serve.run(["audit", serve.journal, "--engine", engine_url, "--logprob-tolerance", repr(tolerance)],
                             240)
    lines = (so + se).splitlines()
    keep = [ln for ln in lines if ln.startswith(("weight digest", "weight drift", "re-verification", "journal:",
                                                 "engine:", "audit:", "audit FAILURE", "state:", "taint:"))]
    findings = [ln for ln in lines if ln.startswith("audit ENGINE")]
    digest = [ln for ln in lines if ln.startswith(("weight digest", "weight drift"))]
    intact = any(ln.strip() == "journal: INTACT" for ln in lines)
    out({"step": "P9a", "what": "audit JOURNAL --engine: the live engine's digest is the one journaled for its label",
         "pass": intact and any("as journaled" in ln for ln in digest), "digest_line": digest[:2],
         "journal_intact": intact})
    # On the double the re-verification of rollouts from before the incident fails by construction
    # (NOT_ON_DOUBLE): there only the other findings count.
    other = [f for f in findings if SAME_WEIGHTS_SAME_TOKENS or "re-verification of rollout" not in f]
    out({"step": "P9b", "what": "audit verdict after the restores: no engine finding", "pass": intact and not other
         and (code == 0 or not SAME_WEIGHTS_SAME_TOKENS), "audit_exit": code, "audit_tolerance": tolerance,
         "audit_lines": keep[-12:], "engine_findings": len(findings), "findings_counted": other[:6],
         "reverification_findings_ignored_on_double": len(findings) - len(other)})
    serve_exit = serve.stop()
    rcode, rso, rse = serve.run(["replay", serve.journal], 120)
    rlines = rso.splitlines()
    rkeep = [ln for ln in rlines if ln.startswith(("TAINTED at", "RESTORED at", "verification", "  proof",
                                                   "  it ends", "  reading"))]
    ok = (serve_exit == 0 and rcode == 0 and any(ln.startswith("verification: OK") for ln in rlines)
          and any(ln.startswith("RESTORED") for ln in rlines) and any(ln.startswith("TAINTED") for ln in rlines))
    out({"step": "P9c", "what": "SIGTERM serve; replay verifies the journal and explains the incidents and restores",
         "pass": ok, "serve_exit": serve_exit, "replay_exit": rcode, "replay_lines": rkeep[:30],
         "replay_state": [ln for ln in rlines if ln.startswith(("state:", "rollouts:", "records:"))]})
    return ok


# ---------------------------------------------------------------- main
def main():
    rc_bin, size, work = sys.argv[1], sys.argv[2], os.path.abspath(sys.argv[3])
    if size not in SHAPES:
        print("size: 125m, 8b or tiny", file=sys.stderr)
        return 2
    os.makedirs(work, exist_ok=True)
    n_roll = int(os.environ.get("RC_PROOF_ROLLOUTS", "128"))
    adopt = os.environ.get("RC_PROOF_ADOPT", "0" if size == "8b" else "1") == "1"
    start_timeout_s = 60 if LOCAL else 300
    port = free_port() if LOCAL else int(os.environ.get("RC_VLLM_PORT", "8000"))
    eng, serve = Engine(work, port), Serve(rc_bin, work)
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(BudgetExceeded()))
    signal.alarm(int(max(10, BUDGET_S)))
    try:
        p0_provenance(rc_bin, size)
        ok, d1, d2, bad = p1_models(size, work)
        if not ok:
            return 1
        src1, src2, src_bad = ("safetensors:" + d for d in (d1, d2, bad))
        ready, start_s = eng.start(d1, start_timeout_s)
        out({"step": "engine", "what": "engine start on seed 1", "pass": ready, "start_s": start_s, "url": eng.url,
             "command": " ".join(eng.command(d1))})
        if not ready:
            os.system(f"tail -c 3000 {eng.log_path}")
            return 1
        p2 = p2_digest(eng)
        t = time.time()
        up = serve.start(eng.url, src1, d1, 120)
        out({"step": "serve", "what": "serve start (bootstrap rc-1)", "pass": up, "start_s": round(time.time() - t, 3),
             "url": serve.url})
        if not up:
            print(open(serve.log_path).read()[-3000:])
            return 1
        c = rolloutcore.Client(serve.url, TOKEN, timeout_s=60, update_timeout_s=300)
        ok3, rc2_digest, ids_rc2, rc2_gen = p3_bootstrap_update(c, eng, serve.url, src1, src2, d2, p2)
        if not ok3:
            return 1
        tol = 1e-3
        if p4_rollouts(serve.url, n_roll, 16):
            a = p4_audit(serve, eng.url, 1)
            b = p4_audit(serve, eng.url, 2)
            p4_spread(a, b)
            worst = max([r["max_abs_diff"] for r in list((a or {}).values()) + list((b or {}).values())], default=0)
            tol = max(1e-3, 2 * worst)
        if p5_ambiguous(c, serve.url, eng, src_bad, bad):
            p6_wrong_restore(c, src1)
            p7_restore(c, serve.url, src2, rc2_digest, ids_rc2, rc2_gen, eng)
        if adopt and RESULTS.get("P7"):
            if left_s() > (30 if LOCAL else 150):
                p8_adopt(c, serve.url, eng, d2, rc2_digest, ids_rc2, min(start_timeout_s, left_s() - 60))
            else:
                out({"step": "P8", "what": "adopt", "pass": False, "skipped": f"budget: {round(left_s())} s left"})
        p9_verdicts(serve, eng.url, tol)
        return 0 if all(RESULTS.values()) else 1
    except BudgetExceeded:
        out({"step": "budget", "pass": False, "reason": f"RC_PROOF_BUDGET_S={BUDGET_S} spent"})
        return 1
    except Exception as e:  # report, then still stop both processes
        out({"step": "exception", "pass": False, "error": repr(e)[:800]})
        return 1
    finally:
        signal.alarm(0)
        serve.kill()
        eng.kill()
        out({"step": "summary", "pass": bool(RESULTS) and all(RESULTS.values()), "steps": RESULTS,
             "wall_s": round(time.time() - T0, 1), "work": work})


BUDGET_S = float(os.environ.get("RC_PROOF_BUDGET_S", "540"))

if __name__ == "__main__":
    sys.exit(main())
