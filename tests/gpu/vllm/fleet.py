#!/usr/bin/env python3
"""A fleet of two real vLLM engines on ONE GPU, updated by `rolloutcore serve --transfer reload`
(tests/gpu/vllm/run_vllm.sh fleet125m).

Both engines (`a` on port 8000, `b` on 8001) run on GPU 0 with `--gpu-memory-utilization 0.3`,
started one after the other, each on its own copy of the seed-1 checkpoint's weights. serve
drives them as a fleet (`--fleet-engine a=URL --fleet-engine b=URL`, staleness bound 0,
min_serving 1, require_weight_digest): every update has each engine reload a checkpoint
directory from its own disk (POST /collective_rpc reload_weights). Steps, one JSON line each:
  F0  provenance (versions, GPU, commit)
  F1  checkpoints: seed-1..4 directories with one manifest (make_model.py)
  F2  `all` update rc-2 (seed 2): both commit with equal journaled digests; per engine, the first
      request of a long prompt cached under rc-1 hits 0 cached tokens; greedy ids equal on a and
      b and differ from rc-1's
  F3  (E3) proxied rollouts in flight when an `all` update rc-3 is asked: every answer is one
      generation (headers, tokens = that label's greedy reference); no admission after a
      publish lands on an older generation
  F4  `rolling` update rc-4 (batch 1, min_serving 1, staleness 0) under live proxied traffic:
      no non-2xx, staleness bound never exceeded
  F6a `all` update rc-5 (seed 1) of both engines, nothing in flight: its wall time
  F5  (E6 analogue) SIGKILL of b's process group while an `all` update rc-6 has b in UPDATING:
      b TAINTED within 2 s, a commits, the update answers 207 partial, 20 proxied requests go to a
  F6  `all` update rc-7 (seed 3) with a alone: wall time against F6a's (two engines)
  F7  SIGTERM serve; `rolloutcore replay` explains b's taint; `rolloutcore audit`
One JSON object per line: {"step": ..., "pass": bool, ...}; the last line is the summary. Every
wait is bounded; the whole run stops at RC_FLEET_BUDGET_S (default 540) seconds.

  Usage: fleet.py RC_BINARY SIZE WORKDIR        SIZE: 125m | tiny
  Env:   RC_FLEET_LOCAL=1: a GPU-free dry run against two vllm-double processes (RC_FLEET_DOUBLE =
         its binary, default build/fixtures/vllm-double); RC_FLEET_MODEL_PY = the Python that runs
         make_model.py (torch, safetensors, tokenizers; default this one); RC_FLEET_GPU_UTIL
         (default 0.3); RC_VLLM_PORT (default 8000: a on it, b on the next; local: free ports).
On the double, prefix-cache counters and greedy ids are the double's own model (ids follow a
count of weight loads, equal on both engines while both loaded the same number of times); the
lines say where a check means less there.
"""
import concurrent.futures
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
LOCAL = os.environ.get("RC_FLEET_LOCAL") == "1"
# F5 waits this long after seeing b in UPDATING before the kill, so it lands in the reload.
KILL_DELAY_MS = int(os.environ.get("RC_FLEET_KILL_DELAY_MS", "40"))
KILL_CASE = {"case": None}  # F5's finding, for F7: "before_mutation" when the kill beat the reload
# proof.py reads these at import (its engine command and its dry-run switch); this script shares them.
os.environ["RC_PROOF_LOCAL"] = "1" if LOCAL else "0"
os.environ["RC_PROOF_GPU_UTIL"] = os.environ.get("RC_FLEET_GPU_UTIL", "0.3")
if os.environ.get("RC_FLEET_DOUBLE"):
    os.environ["RC_PROOF_DOUBLE"] = os.environ["RC_FLEET_DOUBLE"]
sys.path.insert(0, HERE)
import proof  # noqa: E402  (its Engine, HTTP, wait and output helpers)
from proof import http, out  # noqa: E402

rolloutcore = proof.rolloutcore
TOKEN = "fleet-token"
SHAPES = {"125m": "opt125m", "tiny": "tiny"}
T0 = time.time()
BUDGET_S = float(os.environ.get("RC_FLEET_BUDGET_S", "540"))
proof.T0, proof.BUDGET_S = T0, BUDGET_S  # proof.wait_until/left_s bound waits by this run's budget
RESULTS = proof.RESULTS
LONG = " ".join(proof.WORDS * 12)  # ~230 words: many full KV blocks to cache and hit


def left_s():
    return BUDGET_S - (time.time() - T0)


# ---------------------------------------------------------------- serve in front of the fleet
class FleetServe(proof.Serve):
    def start(self, engines, src1, seed1_dir, timeout_s):
        """Starts serve in front of `engines` (name -> URL); True once it listens."""
        cmd = [self.rc_bin, "serve", "--journal", self.journal, "--trajectories", self.traj, "--port", "0",
               "--auth-token", TOKEN, "--transfer", "reload", "--initial-source", src1, "--initial-label", "rc-1",
               "--initial-checkpoint", seed1_dir, "--initial-run", "fleet", "--initial-step", "1",
               "--require-weight-digest", "true", "--fleet-staleness-max", "0", "--fleet-min-serving", "1",
               "--fleet-blocked-timeout-ms", "30000", "--fleet-update-timeout-ms", "300000",
               "--engine-monitor-interval-ms", "200", "--weight-digest-check-interval-ms", "10000",
               "--transfer-timeout-ms", "240000", "--call-timeout-ms", "30000", "--admit-wait-ms", "20000",
               "--request-timeout-ms", "120000"]
        for name, url in engines.items():
            cmd += ["--fleet-engine", f"{name}={url}"]
        out({"serve_command": " ".join(cmd)})
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return self._wait_listening(timeout_s)

    def _wait_listening(self, timeout_s):
        found = threading.Event()

        def pump():  # every line to the log; the "listening on" line gives the URL
            with open(self.log_path, "w") as log:
                for line in self.proc.stdout:
                    log.write(line)
                    log.flush()
                    if line.startswith("listening on ") and not found.is_set():
                        self.url = "http://" + line.split()[-1].strip()
                        found.set()

        threading.Thread(target=pump, daemon=True).start()
        end = time.time() + timeout_s
        while time.time() < end and not found.is_set() and self.proc.poll() is None:
            found.wait(0.5)
        return found.is_set()


# ---------------------------------------------------------------- helpers
def fleet_update(svc, label, seed_dir, step, mode="all", batch_max=1, uid=None):
    """POST /v1/fleet/updates: (HTTP status, body, wall seconds)."""
    man = manifest(svc, "safetensors:" + seed_dir)
    body = {"update_id": uid or f"fleet-{label}", "target_label": label, "mode": mode, "batch_max": batch_max,
            "min_healthy": 1, "source": "safetensors:" + seed_dir,
            "identity": {"manifest_digest": man, "checkpoint": seed_dir, "run": "fleet", "step": step}}
    t = time.time()
    st, _, doc = http("POST", svc + "/v1/fleet/updates", body, {"Authorization": "Bearer " + TOKEN},
                      timeout=max(10.0, min(300.0, left_s())))
    return st, doc if isinstance(doc, dict) else {"text": str(doc)[:500]}, round(time.time() - t, 3)


MANIFESTS = {}


def manifest(svc, src):
    if src not in MANIFESTS:
        q = urllib.parse.urlencode({"source": src})
        st, _, doc = http("GET", svc + "/v1/manifest?" + q, None, {"Authorization": "Bearer " + TOKEN})
        MANIFESTS[src] = doc.get("manifest_digest", "") if st == 200 and isinstance(doc, dict) else ""
    return MANIFESTS[src]


def state(svc, full=False):
    st, _, doc = http("GET", svc + "/v1/state" + ("?full=1" if full else ""), timeout=10)
    return doc if st == 200 and isinstance(doc, dict) else {}


def eng_field(svc, name, key):
    return (state(svc).get("engines", {}).get(name) or {}).get(key)


def complete_direct(url, prompt, n):
    """A greedy completion straight to one engine (no proxy, no salt): (ids, HTTP status)."""
    st, _, doc = http("POST", url + "/v1/completions",
                      {"model": proof.MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0.0,
                       "ignore_eos": True, "return_token_ids": True}, timeout=60)
    ok = st == 200 and isinstance(doc, dict)
    return (doc["choices"][0].get("token_ids") if ok else None), st


def proxied(svc, prompt, n, rid, timeout=120):
    """One proxied greedy rollout: status, engine, label, fleet generation, admission seq, ids."""
    t0 = time.time()
    st, h, doc = proof.complete(svc, prompt, n, 0.0, rid, timeout)
    ok = st == 200 and isinstance(doc, dict)
    return {"rid": rid, "prompt": prompt, "status": st, "t0": t0, "t1": time.time(),
            "engine": h.get("X-RolloutCore-Engine"), "label": h.get("X-RolloutCore-Version"),
            "fleet_gen": h.get("X-RolloutCore-Fleet-Generation"), "seq": int(h.get("X-RolloutCore-Admission-Seq") or 0),
            "ids": doc["choices"][0].get("token_ids") if ok else None, "error": None if ok else str(doc)[:200]}


def prefix_hits(url):
    """vLLM's prefix-cache counters on one engine's /metrics (summed over label sets)."""
    st, _, text = http("GET", url + "/metrics", timeout=10)
    m = {}
    for line in (text if isinstance(text, str) else "").splitlines():
        if line.startswith(("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")):
            k, v = line.rsplit(" ", 1)
            m[k.split("{")[0]] = m.get(k.split("{")[0], 0.0) + float(v)
    return m.get("vllm:prefix_cache_hits_total"), m.get("vllm:prefix_cache_queries_total")


def long_prompt_hits(url):
    """Hits (tokens) the long prompt takes on this engine's prefix cache, and its greedy ids."""
    h0, _ = prefix_hits(url)
    ids, _ = complete_direct(url, LONG, 8)
    h1, _ = prefix_hits(url)
    return (None if h0 is None or h1 is None else h1 - h0), ids


def journal_records(serve):
    """Every journal record (replay --json --events reads it while serve runs)."""
    code, so, _ = serve.run(["replay", "--json", "--events", serve.journal], 120)
    recs = []
    for line in so.splitlines():
        if line.startswith("{") and '"event"' in line[:200]:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if "seq" in r and isinstance(r.get("event"), dict):
                recs.append(r)
    return recs


def update_phases(recs, uid):
    """Per engine: ms spent in each lifecycle state during fleet update `uid` (journal wall times)."""
    start = next((r for r in recs if r["event"].get("type") == "FleetUpdateRequested"
                  and r["event"].get("update_id") == uid), None)
    if start is None:
        return {}
    end = next((r for r in recs if r["seq"] > start["seq"] and r["event"].get("type") == "FleetUpdateEnded"), None)
    last, phases = {}, {}
    for r in recs:
        ev = r["event"]
        if r["seq"] <= start["seq"] or (end and r["seq"] > end["seq"]) or ev.get("type") != "StateChanged":
            continue
        e = r.get("engine", "")
        t_prev = last.get(e, start["wall_time_ms"])
        p = phases.setdefault(e, {})
        p[ev["from"]] = p.get(ev["from"], 0) + (r["wall_time_ms"] - t_prev)
        last[e] = r["wall_time_ms"]
    wall = (end["wall_time_ms"] - start["wall_time_ms"]) if end else None
    return {"journal_request_to_end_ms": wall, "ms_in_state_per_engine": phases}


def staleness_violations(recs, generations):
    """Admissions whose label's fleet generation is below the newest one published before them
    (bound 0: none may start on an older generation once a newer one was published anywhere)."""
    newest, bad, admitted = 0, [], 0
    for r in recs:
        ev = r["event"]
        if ev.get("type") == "VersionPublished":
            newest = max(newest, generations.get((ev.get("version") or {}).get("label"), 0))
        elif ev.get("type") == "RolloutAdmitted":
            admitted += 1
            g = generations.get((ev.get("version") or {}).get("label"), -1)
            if g < newest:
                bad.append({"seq": r["seq"], "engine": r.get("engine"), "label": ev["version"].get("label"),
                            "newest_published_generation": newest})
    return admitted, bad


def first_publish_seq(recs, label):
    seqs = [r["seq"] for r in recs if r["event"].get("type") == "VersionPublished"
            and (r["event"].get("version") or {}).get("label") == label]
    return min(seqs) if seqs else None


def label_digests(svc, label):
    full = state(svc, True)
    return {n: (e.get("state") or {}).get("label_digests", {}).get(label)
            for n, e in (full.get("engines") or {}).items()}


def double_fault(eng, body):
    """Local only: a fault switch of the double (POST /_double/faults)."""
    return http("POST", eng.url + "/_double/faults", body, timeout=10)[0] if LOCAL else None


# ---------------------------------------------------------------- steps
def f0_provenance(rc_bin, size):
    """F0: records what ran (versions, GPU, commit); catches a result tied to the wrong build or host."""
    vers, gpu, rev = proof.host_provenance(("vllm", "torch", "safetensors", "tokenizers"))
    out({"step": "F0", "what": "provenance", "pass": True,
         "mode": "local (two vllm-doubles)" if LOCAL else "two vLLM engines on GPU 0", "size": size,
         "versions": vers, "python": sys.version.split()[0], "gpu": gpu, "rolloutcore_commit": rev,
         "rc_binary": rc_bin, "budget_s": BUDGET_S})


def f1_models(size, work):
    """F1: four checkpoints of one manifest (seeds 1-4); catches a make_model.py failure early."""
    py = os.environ.get("RC_FLEET_MODEL_PY", sys.executable)
    mm = [py, os.path.join(HERE, "make_model.py"), "--shape", SHAPES[size]]
    dirs = [os.path.join(work, f"seed{s}") for s in (1, 2, 3, 4)]
    took, ok = {}, True
    for s, d in enumerate(dirs, 1):
        marker = os.path.join(work, f"seed{s}.done")  # outside the checkpoint: vLLM globs its directory
        if os.path.exists(marker):
            took[f"seed{s}"] = "kept"
            continue
        cmd = mm + ["--out", d, "--seed", str(s)] + (["--tokenizer-from", dirs[0]] if s > 1 else [])
        t = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10.0, left_s() - 60))
        took[f"seed{s}"] = round(time.time() - t, 1)
        if p.returncode != 0:
            ok = False
            out({"note": f"make_model seed {s} failed", "stderr": p.stderr[-1500:]})
            break
        open(marker, "w").close()
    sizes = {os.path.basename(d): os.path.getsize(os.path.join(d, "model.safetensors"))
             for d in dirs if os.path.exists(os.path.join(d, "model.safetensors"))}
    out({"step": "F1", "what": "checkpoints seed 1-4 (one manifest)", "pass": ok, "shape": SHAPES[size],
         "seconds": took, "bytes": sizes})
    return ok, dirs


def start_engines(work, ports, d1, timeout_s):
    """Engines a then b start on seed 1, one after the other (vLLM profiles free GPU memory at start, so two
    starting at once would race); catches an engine that cannot fit beside the other."""
    engines = {}
    for name, port in zip(("a", "b"), ports):
        sub = os.path.join(work, name)
        os.makedirs(sub, exist_ok=True)
        eng = proof.Engine(sub, port)
        ready, start_s = eng.start(d1, timeout_s)
        engines[name] = eng
        out({"step": f"engine_{name}", "what": f"engine {name} starts on seed 1", "pass": ready,
             "start_s": start_s, "url": eng.url, "command": " ".join(eng.command(d1))})
        if not ready:
            os.system(f"tail -c 3000 {eng.log_path}")
            return engines, False
    return engines, True


def f2_update_all(svc, engines, dirs, serve):
    """F2: an `all` update commits on both engines with one journaled digest, and each engine
    resets its prefix cache (E4) -- catches a member left on old weights or serving stale KV."""
    warm = {n: [long_prompt_hits(e.url) for _ in range(2)] for n, e in engines.items()}
    ids1 = {n: [complete_direct(e.url, p, 24)[0] for p in proof.PROMPTS] for n, e in engines.items()}
    st, doc, wall = fleet_update(svc, "rc-2", dirs[1], 2)
    after = {n: [long_prompt_hits(e.url) for _ in range(2)] for n, e in engines.items()}
    ids2 = {n: [complete_direct(e.url, p, 24)[0] for p in proof.PROMPTS] for n, e in engines.items()}
    dig = label_digests(svc, "rc-2")
    e4 = {n: {"rc1_warm_second_hits": warm[n][1][0], "first_after_update_hits": after[n][0][0],
              "second_after_update_hits": after[n][1][0]} for n in engines}
    counted = all(None not in (v["rc1_warm_second_hits"], v["first_after_update_hits"]) for v in e4.values())
    resets = caches_reset(journal_records(serve), "fleet-rc-2")
    if counted:
        e4_ok = all(v["rc1_warm_second_hits"] and v["first_after_update_hits"] == 0 and v["second_after_update_hits"]
                    for v in e4.values())
    else:  # no vllm:prefix_cache_* lines on this engine's /metrics (seen once on vLLM 0.25.1, docs/vllm-protocol.md)
        e4_ok = sorted(resets) == ["a", "b"] and all(after[n][0][1] == after[n][1][1] for n in engines)
    ids_ok = ids2["a"] == ids2["b"] and None not in ids2["a"] and ids2["a"] != ids1["a"]
    ok = (st == 200 and doc.get("outcome") == "committed" and doc.get("committed") == 2 and e4_ok and ids_ok
          and dig.get("a") and dig.get("a") == dig.get("b"))
    out({"step": "F2", "what": "`all` update rc-2: both commit, one journaled digest, per-engine E4, same ids",
         "pass": bool(ok), "update_http": st, "outcome": doc.get("outcome"), "counts": counts(doc),
         "update_wall_s": wall, "journaled_digest": {n: (d or "")[:16] for n, d in dig.items()},
         "e4_prefix_hits_tokens": e4, "e4_how": "the long prompt sent straight to each engine (unsalted), its "
         "vllm:prefix_cache_hits_total delta on that engine's /metrics" if counted else
         "NO prefix-cache counters on /metrics: judged by the journaled cache reset of each engine and the long "
         "prompt's ids (first after the update == second)", "journaled_cache_resets": resets,
         "greedy_ids_equal_a_b": ids2["a"] == ids2["b"], "greedy_ids_differ_from_rc1": ids2["a"] != ids1["a"],
         "rc1_ids_equal_a_b": ids1["a"] == ids1["b"], "ids_rc2_head": [x[:6] if x else x for x in ids2["a"]],
         "engines": doc.get("engines")})
    return ok, st == 200 and doc.get("outcome") == "committed"


def caches_reset(recs, uid):
    """Engines whose caches were reset (INVALIDATING -> VALIDATING, caches_reset) in update `uid`."""
    start = next((r["seq"] for r in recs if r["event"].get("type") == "FleetUpdateRequested"
                  and r["event"].get("update_id") == uid), None)
    if start is None:
        return []
    end = next((r["seq"] for r in recs if r["seq"] > start and r["event"].get("type") == "FleetUpdateEnded"), 1 << 62)
    return sorted({r.get("engine") for r in recs if start < r["seq"] <= end and r["event"].get("type") == "StateChanged"
                   and r["event"].get("cause") == "caches_reset"})


def counts(doc):
    return {k: doc.get(k) for k in ("committed", "refused", "tainted", "skipped", "stalled")}


def batch(svc, prompts, n, tag, conc):
    """The prompts as proxied greedy rollouts, `conc` at once."""
    with concurrent.futures.ThreadPoolExecutor(conc) as ex:
        futs = [ex.submit(proxied, svc, p, n, f"{tag}-{i:03d}") for i, p in enumerate(prompts)]
        return [f.result(timeout=max(30.0, left_s())) for f in futs]


def references(svc, prompts, n, tag, label):
    """Greedy reference ids per prompt under `label`, from both engines where they answered."""
    res = batch(svc, prompts, n, tag, len(prompts))
    ref = {}
    for r in res:
        if r["status"] == 200 and r["label"] == label:
            ref.setdefault(r["prompt"], r["ids"])
    return ref, res


def f3_in_flight(svc, engines, dirs, serve):
    """F3 (E3): rollouts in flight when an `all` update is asked each finish on one generation, and
    none admitted after the publish runs on the old one -- catches a drain that lets weights change
    under a running rollout or an admission past the staleness bound."""
    rng = random.Random(7)
    n_roll, n_tok = (24, 256) if LOCAL else (24, 384)
    prompts = [" ".join(rng.choice(proof.WORDS) for _ in range(rng.randint(8, 24))) + f" {i}" for i in range(n_roll)]
    for e in engines.values():
        double_fault(e, {"token_delay_ms": 5})  # local: 256 tokens take ~1.3 s, as vLLM's 384 do
    ref2, res_ref2 = references(svc, prompts, n_tok, "f3-ref2", "rc-2")
    live, second = [], []
    stop = threading.Event()
    ex = concurrent.futures.ThreadPoolExecutor(n_roll + 4)
    futs = [ex.submit(proxied, svc, p, n_tok, f"f3-live-{i:03d}") for i, p in enumerate(prompts)]
    proof.wait_until(lambda: sum((e.get("active_rollouts") or 0) for e in state(svc).get("engines", {}).values())
                     >= n_roll // 2, 15, 0.02)
    t_ask = time.time()
    wave = [ex.submit(second_wave, svc, prompts, n_tok, stop, k, second) for k in range(4)]
    st, doc, wall = fleet_update(svc, "rc-3", dirs[2], 3)
    stop.set()
    live = [f.result(timeout=max(30.0, left_s())) for f in futs]
    for f in wave:
        f.result(timeout=max(30.0, left_s()))
    ex.shutdown(wait=False)
    ref3, res_ref3 = references(svc, prompts, n_tok, "f3-ref3", "rc-3")
    for e in engines.values():
        double_fault(e, {"token_delay_ms": 1})
    return f3_report(svc, serve, st, doc, wall, t_ask, live, second, {"rc-2": ref2, "rc-3": ref3},
                     res_ref2 + res_ref3)


def second_wave(svc, prompts, n_tok, stop, k, sink):
    """Rollouts sent while the update runs (one at a time per worker), so some meet its publish."""
    i = 0
    while not stop.is_set() and i < 50:
        sink.append(proxied(svc, prompts[(k * 7 + i) % len(prompts)], 64, f"f3-wave-{k}-{i:02d}"))
        i += 1
    return i


def one_generation(recs, answers, uid, old, new):
    """Rollouts that the journal does not show whole on one generation of their engine: an `old`
    one must finish before its engine's transfer starts (UPDATING), a `new` one be admitted after
    its engine published `new`. Also the headers must name the engine and label journaled."""
    start = next((r["seq"] for r in recs if r["event"].get("type") == "FleetUpdateRequested"
                  and r["event"].get("update_id") == uid), 0)
    upd, pub, adm, fin = {}, {}, {}, {}
    for r in recs:
        ev, e = r["event"], r.get("engine")
        t = ev.get("type")
        if t == "StateChanged" and ev.get("to") == "UPDATING" and r["seq"] > start:
            upd.setdefault(e, r["seq"])
        elif t == "VersionPublished" and (ev.get("version") or {}).get("label") == new:
            pub.setdefault(e, r["seq"])
        elif t == "RolloutAdmitted":
            adm[ev.get("rollout_id")] = (e, (ev.get("version") or {}).get("label"), r["seq"])
        elif t == "RolloutFinished":
            fin[ev.get("rollout_id")] = r["seq"]
    bad = []
    for a in answers:
        e, lab, seq = adm.get(a["rid"], (None, None, None))
        f = fin.get(a["rid"])
        whole = ((lab == old and f is not None and f < upd.get(e, 1 << 62))
                 or (lab == new and f is not None and seq > pub.get(e, 1 << 62)))
        if not whole or (e, lab) != (a["engine"], a["label"]):
            bad.append({"rid": a["rid"], "journal": [e, lab, seq, f], "headers": [a["engine"], a["label"]],
                        "engine_updating_seq": upd.get(e), "engine_published_seq": pub.get(e)})
    return bad


def f3_report(svc, serve, st, doc, wall, t_ask, live, second, refs, ref_runs):
    recs = journal_records(serve)
    gens = state(svc, True).get("generations", {})
    pub3 = first_publish_seq(recs, "rc-3")
    in_flight = [r for r in live if r["t0"] < t_ask < r["t1"]]
    answers = live + second
    not_whole = one_generation(recs, answers, "fleet-rc-3", "rc-2", "rc-3")
    mism = [mismatch(r, refs, 64 if r["rid"].startswith("f3-wave") else None) for r in answers]
    mism = [m for m in mism if m]
    # vLLM's batched bf16 decoding is not batch-invariant (a greedy answer can differ from the
    # same prompt's in another batch), so on vLLM an answer's tokens need only be nearer its own
    # label's reference than any other label's; on the double they must equal it.
    misattributed = [m for m in mism if LOCAL or not m.get("nearer_own_reference")]
    late_old = [r["rid"] for r in answers if pub3 and r["seq"] > pub3 and r["label"] != "rc-3"]
    bad_hdr = [r["rid"] for r in answers if r["status"] != 200 or r["engine"] not in ("a", "b")
               or r["label"] not in ("rc-2", "rc-3") or str(gens.get(r["label"])) != str(r["fleet_gen"])]
    admitted, stale = staleness_violations(recs, gens)
    ref_ok = all(r["status"] == 200 for r in ref_runs) and len(refs["rc-2"]) == len(refs["rc-3"]) == len(live)
    ok = (st == 200 and doc.get("outcome") == "committed" and len(in_flight) >= len(live) // 2
          and not misattributed and not not_whole and not late_old and not bad_hdr and not stale and ref_ok)
    by = {}
    for r in answers:
        by[f"{r['engine']}/{r['label']}"] = by.get(f"{r['engine']}/{r['label']}", 0) + 1
    out({"step": "F3", "what": "E3: rollouts in flight at an `all` update rc-3 are each one generation; "
         "no admission after the publish on the old one", "pass": bool(ok), "update_http": st,
         "outcome": doc.get("outcome"), "update_wall_s": wall, "rollouts_in_flight_at_ask": len(in_flight),
         "live_rollouts": len(live), "second_wave_rollouts": len(second), "answers_by_engine_label": by,
         "journal_not_whole_on_one_generation": not_whole[:5],
         "tokens_equal_reference": len(answers) - len(mism), "token_mismatch_count": len(mism),
         "token_mismatches": mism[:5], "token_rule": "equal to the label's reference" if LOCAL else
         "nearer the label's reference than any other label's (vLLM is not batch-invariant); equality counted",
         "misattributed": len(misattributed), "admitted_after_publish_on_old": late_old,
         "bad_headers": bad_hdr[:5], "first_rc3_publish_seq": pub3, "journal_admissions": admitted,
         "staleness_violations": stale[:5], "references_complete": ref_ok,
         "reference_how": "the same prompts as one concurrent batch through the proxy, before (rc-2) and after "
         "(rc-3) the update; second-wave answers (64 tokens) compared with the reference's first 64",
         "phases": update_phases(recs, "fleet-rc-3")})
    return ok


def mismatch(r, refs, cut):
    """None when the answer's ids equal its own label's reference (first `cut` ids for short ones)."""
    ref = (refs.get(r["label"]) or {}).get(r["prompt"])
    got = r["ids"]
    if ref is None or got is None:
        return {"rid": r["rid"], "label": r["label"], "why": "no reference or no answer"}
    if cut:
        ref = ref[:cut]
    if got == ref:
        return None
    first = common_prefix(got, ref)
    others = {lab: common_prefix(got, (rr.get(r["prompt"]) or [])[:len(ref)]) for lab, rr in refs.items()
              if lab != r["label"]}
    return {"rid": r["rid"], "engine": r["engine"], "label": r["label"], "first_divergence": first,
            "len": len(got), "common_prefix_with_other_labels": others,
            "nearer_own_reference": first > 0 and all(first > v for v in others.values())}


def common_prefix(x, y):
    return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))


def traffic(svc, stop, k, sink):
    """Proxied rollouts back to back until `stop`; every answer kept."""
    i = 0
    while not stop.is_set() and i < 400:
        sink.append(proxied(svc, proof.PROMPTS[(k + i) % 3] + f" {k} {i}", 32, f"f4-{k}-{i:03d}", timeout=60))
        i += 1


def f4_rolling(svc, dirs, serve):
    """F4: a `rolling` update (batch 1, min_serving 1) under live traffic keeps the proxy answering
    and never admits past the staleness bound -- catches both engines drained at once or a stale
    engine admitting after the newer label was published."""
    stop, answers = threading.Event(), []
    threads = [threading.Thread(target=traffic, args=(svc, stop, k, answers), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    st, doc, wall = fleet_update(svc, "rc-4", dirs[3], 4, mode="rolling", batch_max=1)
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(timeout=max(5.0, min(60.0, left_s())))
    recs = journal_records(serve)
    gens = state(svc, True).get("generations", {})
    _, stale = staleness_violations(recs, gens)
    pub4 = first_publish_seq(recs, "rc-4")
    non2xx = [r for r in answers if not 200 <= r["status"] < 300]
    bad_hdr = [r["rid"] for r in answers if r["status"] == 200 and (r["engine"] not in ("a", "b")
                                                                     or r["label"] not in ("rc-3", "rc-4"))]
    late_old = [r["rid"] for r in answers if pub4 and r["seq"] > pub4 and r["label"] != "rc-4"]
    by = {}
    for r in answers:
        by[f"{r['engine']}/{r['label']}"] = by.get(f"{r['engine']}/{r['label']}", 0) + 1
    ok = (st == 200 and doc.get("outcome") == "committed" and answers and not non2xx and not bad_hdr
          and not stale and not late_old)
    out({"step": "F4", "what": "`rolling` update rc-4 (batch 1, min_serving 1, staleness 0) under live traffic",
         "pass": bool(ok), "update_http": st, "outcome": doc.get("outcome"), "counts": counts(doc),
         "update_wall_s": wall, "answers": len(answers), "non_2xx": len(non2xx),
         "non_2xx_detail": [(r["status"], r["error"]) for r in non2xx[:3]], "answers_by_engine_label": by,
         "bad_headers": bad_hdr[:5], "admitted_after_rc4_publish_on_old": late_old[:5],
         "staleness_violations": stale[:5], "max_latency_s": round(max((r["t1"] - r["t0"] for r in answers),
                                                                       default=0), 3),
         "phases": update_phases(recs, "fleet-rc-4")})
    return ok


def f6a_two(svc, dirs, serve):
    """F6a: a clean `all` update of both engines commits twice, and its wall time is F6's baseline;
    catches a two-member update that does not end committed with nothing in flight."""
    st, doc, wall = fleet_update(svc, "rc-5", dirs[0], 5)
    ok = st == 200 and doc.get("outcome") == "committed" and doc.get("committed") == 2
    out({"step": "F6a", "what": "`all` update rc-5 (seed 1) of two engines, nothing in flight", "pass": bool(ok),
         "update_http": st, "outcome": doc.get("outcome"), "counts": counts(doc), "update_wall_s": wall,
         "phases": update_phases(journal_records(serve), "fleet-rc-5")})
    return wall if ok else None


def before_mutation_ok(res, sb, recs):
    """A kill inside b's preflight (read-only calls, before any byte of the reload): b must not be
    TAINTED (its weights are the committed ones), must admit nothing, and its plan must be judged
    'no mutation' in the journal, while a commits and the update answers 207 partial."""
    doc = res.get("doc") or {}
    aborted = any(r.get("engine") == "b" and "no mutation" in json.dumps(r["event"]) for r in recs)
    return (res.get("st") == 207 and doc.get("outcome") == "partial" and doc.get("committed") == 1
            and sb.get("lifecycle") != "TAINTED" and not sb.get("admitting") and aborted)


def f5_kill(svc, engines, dirs, serve):
    """F5 (E6 analogue): b's process group SIGKILLed while the update has it in UPDATING (its reload)
    goes TAINTED within 2 s while a commits (207 partial), and the proxy then sends everything to a
    -- catches a dead member published on a guess or still routed to."""
    b = engines["b"]
    fault = double_fault(b, {"reload": "hang"})  # local: b's reload blocks, as a long one would
    res = {}
    th = threading.Thread(target=lambda: res.update(zip(("st", "doc", "wall"),
                                                        fleet_update(svc, "rc-6", dirs[1], 6))), daemon=True)
    th.start()
    seen = proof.wait_until(lambda: eng_field(svc, "b", "lifecycle") == "UPDATING" or not th.is_alive(), 60, 0.005)
    phase = eng_field(svc, "b", "lifecycle")
    if phase == "UPDATING" and not LOCAL:
        # UPDATING opens with the preflight's read-only calls (~5 ms); the reload follows (~100 ms
        # at 125M). A kill inside the preflight leaves the weights as they were: no taint is due.
        time.sleep(KILL_DELAY_MS / 1000.0)
    t_kill = time.time()
    if phase == "UPDATING":
        b.kill()
    tainted = proof.wait_until(lambda: eng_field(svc, "b", "lifecycle") == "TAINTED", 10, 0.01)
    t_seen = round(time.time() - t_kill, 3)
    th.join(timeout=max(5.0, min(120.0, left_s())))
    after = [proxied(svc, proof.PROMPTS[i % 3], 8, f"f5-after-{i:02d}", timeout=60) for i in range(20)]
    recs = journal_records(serve)
    tj = [r for r in recs if r.get("engine") == "b" and r["event"].get("type") == "StateChanged"
          and r["event"].get("to") == "TAINTED"]
    journal_s = round(tj[-1]["wall_time_ms"] / 1000.0 - t_kill, 3) if tj else None
    sb = state(svc)["engines"]["b"]
    ok = (phase == "UPDATING" and tainted and t_seen <= 2.0 and res.get("st") == 207
          and (res.get("doc") or {}).get("outcome") == "partial" and (res.get("doc") or {}).get("committed") == 1
          and (eng_field(svc, "a", "committed") or {}).get("label") == "rc-6")
    if not ok and not tainted and phase == "UPDATING":
        ok = before_mutation_ok(res, sb, recs)  # the kill landed in the preflight: judged as such
        KILL_CASE["case"] = "before_mutation" if ok else None
    ok = ok and all(r["status"] == 200 and r["engine"] == "a" and r["label"] == "rc-6" for r in after)
    out({"step": "F5", "what": "SIGKILL b's process group while the `all` update rc-6 has b in UPDATING: b TAINTED "
         "<= 2 s, a commits, 207 partial, 20 proxied requests all on a", "pass": bool(ok),
         "kill_case": KILL_CASE["case"] or ("mutation_possible" if tainted else "unexplained"),
         "kill_delay_after_updating_ms": 0 if LOCAL else KILL_DELAY_MS,
         "killed_in_phase": phase if seen else f"never saw UPDATING (last {phase})",
         "how": ("the double's reload fault {\"reload\": \"hang\"} held b in UPDATING; then SIGKILL" if LOCAL else
                 "b's lifecycle polled every 5 ms on GET /v1/state; SIGKILL to its process group once UPDATING"),
         "fault_set_http": fault, "taint_seen_after_kill_s": t_seen if tainted else None,
         "taint_journaled_after_kill_s": journal_s, "b_state": {k: sb.get(k) for k in ("lifecycle", "admitting",
                                                                                       "taint", "committed")},
         "update_http": res.get("st"), "outcome": (res.get("doc") or {}).get("outcome"),
         "counts": counts(res.get("doc") or {}), "update_wall_s": res.get("wall"),
         "a_committed": eng_field(svc, "a", "committed"),
         "after_by_engine": sorted({f"{r['status']}/{r['engine']}/{r['label']}" for r in after}),
         "phases": update_phases(recs, "fleet-rc-6")})
    return ok


def f6_one(svc, dirs, serve, two_wall):
    """F6: an `all` update of a alone, timed against F6a's two-engine update (same checkpoint size),
    gives the cost of a second member on one GPU; catches a tainted member still counted as one."""
    st, doc, wall = fleet_update(svc, "rc-7", dirs[2], 7)
    ok = st == 200 and doc.get("outcome") == "committed" and doc.get("committed") == 1 and two_wall is not None
    out({"step": "F6", "what": "hot transition: `all` update wall time, two engines (F6a) vs one (rc-7, a alone)",
         "pass": bool(ok), "update_http": st, "outcome": doc.get("outcome"), "counts": counts(doc),
         "two_engines_wall_s": two_wall, "one_engine_wall_s": wall,
         "ratio_two_over_one": round(two_wall / wall, 3) if ok and wall else None,
         "updated": sorted(n for n, e in (doc.get("engines") or {}).items()
                           if (e.get("committed") or {}).get("label") == "rc-7"),
         "phases": update_phases(journal_records(serve), "fleet-rc-7")})
    return ok


def f7_verdicts(serve):
    """F7: after SIGTERM, replay re-derives every decision and explains b's taint; audit checks the
    fleet history -- catches a journal whose incident cannot be read back."""
    serve_exit = serve.stop()
    rcode, rso, rse = serve.run(["replay", serve.journal], 120)
    rl = rso.splitlines()
    b_taint = [ln for ln in rl if "engine 'b'" in ln and "TAINTED" in ln]
    verified = any(ln.startswith("verification: OK") for ln in rl)
    acode, aso, ase = serve.run(["audit", serve.journal], 120)
    al = (aso + ase).splitlines()
    intact = any(ln.strip() == "journal: INTACT" for ln in al)
    findings = [ln for ln in al if ln.startswith("audit ENGINE")]
    # docs/audit.md: exit 1 = journal intact, an engine TAINTED; b's taint must be the only finding.
    only_b = len(findings) == 1 and "engine 'b' is TAINTED" in findings[0]
    if KILL_CASE["case"] == "before_mutation":  # b was never tainted: nothing to explain or find
        b_taint, only_b, want_audit = ["(b not tainted: killed before the mutation)"], not findings, 0
    else:
        want_audit = 1
    ok = serve_exit == 0 and rcode == 0 and verified and bool(b_taint) and intact and acode == want_audit and only_b
    out({"step": "F7", "what": "SIGTERM serve; replay explains b's taint; audit", "pass": bool(ok),
         "serve_exit": serve_exit, "replay_exit": rcode, "replay_verification_ok": verified,
         "replay_b_taint_lines": b_taint[:6],
         "replay_head": [ln for ln in rl if ln.startswith(("fleet", "state:"))][:6],
         "audit_exit": acode, "audit_exit_expected": want_audit, "audit_journal_intact": intact,
         "audit_findings": [f[:300] for f in findings[:4]],
         "audit_lines": [ln for ln in al if ln.startswith(("audit", "journal:", "engine", "taint", "state:"))][:12],
         "replay_stderr": rse[-300:] if rcode else ""})
    return ok


# ---------------------------------------------------------------- main
def run(rc_bin, size, work):
    f0_provenance(rc_bin, size)
    ok, dirs = f1_models(size, work)
    if not ok:
        return
    base = int(os.environ.get("RC_VLLM_PORT", "8000"))
    ports = (proof.free_port(), proof.free_port()) if LOCAL else (base, base + 1)
    engines, up = start_engines(work, ports, dirs[0], 60 if LOCAL else 300)
    ENGINES.update(engines)
    if not up:
        return
    # serve bootstraps rc-1 on both; catches a join refused (digest, label) or a fleet that never listens.
    serve = FleetServe(rc_bin, work)
    SERVE.append(serve)
    t = time.time()
    up = serve.start({n: e.url for n, e in engines.items()}, "safetensors:" + dirs[0], dirs[0], 120)
    st = state(serve.url) if up else {}
    boot = {n: (e.get("lifecycle"), (e.get("committed") or {}).get("label")) for n, e in st.get("engines", {}).items()}
    out({"step": "serve", "what": "serve in front of a and b (bootstrap rc-1 on seed 1)",
         "pass": up and boot == {"a": ("READY", "rc-1"), "b": ("READY", "rc-1")}, "start_s": round(time.time() - t, 3),
         "url": serve.url, "engines": boot, "policy": st.get("policy")})
    if not RESULTS.get("serve"):
        print(open(serve.log_path).read()[-3000:])
        return
    svc = serve.url
    if not f2_update_all(svc, engines, dirs, serve)[1]:  # the later steps need rc-2 on both engines
        f7_verdicts(serve)
        return
    f3_in_flight(svc, engines, dirs, serve)
    f4_rolling(svc, dirs, serve)
    two = f6a_two(svc, dirs, serve)
    if f5_kill(svc, engines, dirs, serve) or eng_field(svc, "b", "lifecycle") in ("TAINTED", None):
        f6_one(svc, dirs, serve, two)
    f7_verdicts(serve)


ENGINES, SERVE = {}, []


def main():
    rc_bin, size, work = sys.argv[1], sys.argv[2], os.path.abspath(sys.argv[3])
    if size not in SHAPES:
        print("size: 125m or tiny", file=sys.stderr)
        return 2
    os.makedirs(work, exist_ok=True)
    proof.signal.signal(proof.signal.SIGALRM, lambda *_: (_ for _ in ()).throw(proof.BudgetExceeded()))
    proof.signal.alarm(int(max(10, BUDGET_S)))
    try:
        run(rc_bin, size, work)
    except proof.BudgetExceeded:
        out({"step": "budget", "pass": False, "reason": f"RC_FLEET_BUDGET_S={BUDGET_S} spent"})
    except Exception as e:  # report, then still stop every process
        out({"step": "exception", "pass": False, "error": repr(e)[:800]})
    finally:
        proof.signal.alarm(0)
        for s in SERVE:
            s.kill()
        for e in ENGINES.values():
            e.kill()
        out({"step": "summary", "pass": bool(RESULTS) and all(RESULTS.values()), "steps": RESULTS,
             "wall_s": round(time.time() - T0, 1), "work": work})
    return 0 if RESULTS and all(RESULTS.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
