#!/usr/bin/env python3
"""Colocated mode on ONE GPU: vLLM 0.25.1 (sleep mode, `ipc` weight transfer) and a torch trainer
share the GPU, and `rolloutcore serve --transfer ipc` decides which of them holds it
(tests/gpu/vllm/run_vllm.sh colocated125m | colocated8b).

This process is the trainer: it makes the seed-1 checkpoint (make_model.py), starts vLLM on it
(`--enable-sleep-mode --weight-transfer-config '{"backend":"ipc"}'`, the worker extension,
`--gpu-memory-utilization RC_COLO_GPU_UTIL`, VLLM_SERVER_DEV_MODE=1,
VLLM_ALLOW_INSECURE_SERIALIZATION=1), then loads the same checkpoint onto the same GPU, starts
`rolloutcore serve --transfer ipc` beside the engine and drives it with the Python client.
A trainer step perturbs every tensor in place by seeded noise (deterministic), and
`rolloutcore.export_vllm_ipc` hands the tensors to the engine without a copy. Steps:
  C0  provenance; the engine's GPU UUID (rc_device_info) is the trainer's
  M1  sleep level 1 with nothing in flight: serve's freed_bytes, rc_device_info free_bytes before
      and after, vLLM's "Sleep mode freed" / CuMemAllocator lines; a proxied request 503; wake
      (no update): READY on the same version, greedy ids as before
  C3  (E3) rollouts in flight when the trainer asks to sleep finish first, whole (ids equal the
      same batch run before), none is admitted while asleep (proxy 503, explicit admission 503);
      then train step 1 -> update rc-2 (the colocated path with a drain)
  C2  (E2) a clean hot transition: sleep -> train step 2 -> export -> update rc-3 -> release, the
      phase split read from the journal (EffectStarted -> observation, lifecycle states) and the
      update's timings, against restart-to-ready (the reference engine's start, same flags)
  C4  (E4) through RolloutCore: the first request after the update hits no cached prefix (vLLM's
      vllm:prefix_cache_hits_total), and its ids equal the reference engine's; negative control
      on the reference engine, outside RolloutCore: /pause?mode=keep&clear_cache=false, an ipc
      update, /resume -> stale prefix hits and ids that differ from the same engine after a reset
  C5  (E5) steps 1 and 2 share one manifest, their journaled weight digests differ; an update
      whose handles do not name the engine's GPU UUID is refused in preflight (no transfer
      started) and the engine stays SLEEPING; wake brings it back on rc-3
  C7  (E7) a handle file that names the right UUID but whose pickle is truncated: tainted,
      TAINTED, /v1/state says why, still TAINTED after serve restarts; restore rc-3 from a
      vllm-ipc: export of the trainer's (unchanged) rc-3 weights: committed with rc-3's digest.
      If that restore fails, the engine is restarted on a checkpoint of those weights and
      restore(adopt=True) brings it back (reported as the fallback).
  M2  sleep level 2 (weights discarded): memory figures; wake is refused (409); train step 3 ->
      update rc-4 covering every tensor -> READY
  C1  (E1) serve and the colocated engine stopped, the trainer's rc-4 weights saved, a reference
      engine started on them (same flags, same GPU, the trainer still holding its memory):
      greedy ids equal rc-4's through RolloutCore
--ipc-check runs the trainer side alone on a GPU: K1 a trainer step exported and read back by
another process exactly as vLLM's worker opens ipc handles (its UUID, element 6, torch's
rebuild_cuda_tensor), K2 an exported tensor nothing else references is read whole, and
release() frees it, K3 a file keyed by another UUID is not found by the receiver, K4 expandable
segments are refused, K5 rc_device_info on a real GPU.
One JSON object per line ({"step", "pass", ...}); the summary last. Every wait is bounded; the run
stops at RC_COLO_BUDGET_S. Optional parts are skipped when the budget runs low, and say so.

  Usage: colocated.py RC_BINARY SIZE WORKDIR        SIZE: 125m | 8b | tiny
         colocated.py --ipc-check WORKDIR           one GPU, no vLLM, no serve: K1-K5 above
  Env:   RC_COLO_BUDGET_S (540), RC_COLO_GPU_UTIL (0.35), RC_COLO_GPU (physical GPU index, 0),
         RC_VLLM_PORT (8000), RC_COLO_MODEL_PY (the Python for make_model.py; default this one)
"""
import base64
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, HERE)
import rolloutcore  # noqa: E402
from proof import call, host_provenance, http  # noqa: E402  (pure helpers: HTTP, client call, provenance)
from rolloutcore.manifest import manifest_digest, read_safetensors_manifest  # noqa: E402

TOKEN = "colocated-token"
MODEL = "m"
EXT = "rolloutcore.vllm_ext.RolloutCoreWorkerExtension"
PROMPTS = ["policy weight update drain cache token", "alpha beta gamma delta rollout engine",
           "trainer version label prefix resume pause 17"]
DRAIN_PROMPT = "reward rollout engine trainer version label"
LONG = " ".join(["reward rollout engine trainer version label prefix cache"] * 40)
SHAPES = {"125m": "opt125m", "8b": "qwen3-8b", "tiny": "tiny"}
TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
NOISE_SCALE = 0.01       # per trainer step; the weights are randn * 0.02 (norms 1 + that)
WRONG_UUID = "GPU-00000000-0000-0000-0000-000000000000"
T0 = time.time()
BUDGET_S = float(os.environ.get("RC_COLO_BUDGET_S", "540"))
GPU_UTIL = float(os.environ.get("RC_COLO_GPU_UTIL", "0.35"))
RESULTS = {}
C2 = {}  # hot-transition measurements, reported together once restart-to-ready is known


class BudgetExceeded(Exception):
    pass


def out(d):
    d["t_s"] = round(time.time() - T0, 1)
    if "step" in d and "pass" in d and d["step"] != "summary":
        RESULTS[d["step"]] = bool(d["pass"])
    print(json.dumps(d), flush=True)


def left_s():
    return BUDGET_S - (time.time() - T0)


def wait_until(pred, timeout_s, every_s=0.1):
    end = time.time() + min(timeout_s, max(1.0, left_s()))
    v = pred()
    while not v and time.time() < end:
        time.sleep(every_s)
        v = pred()
    return v


# ---------------------------------------------------------------- the engine
class Engine:
    """vLLM on the colocated GPU, started with sleep mode and the ipc backend."""

    def __init__(self, work, port, gpu):
        self.work, self.port, self.gpu = work, port, gpu
        self.url = f"http://127.0.0.1:{port}"
        self.proc = None
        self.log_path = os.path.join(work, "engine.log")

    def command(self, model_dir):
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model_dir,
                "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port),
                "--enforce-eager", "--gpu-memory-utilization", str(GPU_UTIL),
                "--enable-prefix-caching", "--max-model-len", "2048", "--dtype", "bfloat16",
                "--enable-sleep-mode", "--weight-transfer-config", '{"backend":"ipc"}',
                "--worker-extension-cls", EXT]

    def start(self, model_dir, timeout_s):
        """(ready, seconds from process start to /health 200)."""
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                   VLLM_USE_FLASHINFER_SAMPLER="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", CUDA_VISIBLE_DEVICES=self.gpu,
                   PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        t = time.time()
        with open(self.log_path, "a") as log:
            log.write(f"\n===== engine start on {model_dir} at {time.strftime('%H:%M:%S')}\n")
            log.flush()
            self.proc = subprocess.Popen(self.command(model_dir), stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        with open(os.path.join(self.work, "engine.pgid"), "w") as f:  # run_vllm.sh's backstop kill
            f.write(str(self.proc.pid))

        def up():
            return self.proc.poll() is not None or http("GET", self.url + "/health", timeout=2)[0] == 200

        ready = wait_until(up, timeout_s, 0.2) and self.proc.poll() is None
        return bool(ready), round(time.time() - t, 3)

    def rpc(self, method, args=None, timeout=60):
        body = {"method": method} if args is None else {"method": method, "args": args}
        return http("POST", self.url + "/collective_rpc", body, timeout=timeout)

    def device_info(self):
        st, _, body = self.rpc("rc_device_info", timeout=30)
        ok = st == 200 and isinstance(body, dict) and body.get("results")
        return body["results"][0] if ok else {"error": f"HTTP {st}: {str(body)[:200]}"}

    def log_size(self):
        return os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0

    def log_lines(self, since, pattern):
        with open(self.log_path, errors="replace") as f:
            f.seek(since)
            return [ln.strip()[-220:] for ln in f.read().splitlines() if re.search(pattern, ln)][:8]

    def kill(self):
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


SLEEP_LOG = r"Sleep mode freed|CuMemAllocator: sleep freed|to fall asleep"
WAKE_LOG = r"seconds to wake up|wake up the engine with tags|Executor is (not )?sleeping"
RESTART_PHASES = {"weights_load_s": r"Loading weights took ([0-9.]+) seconds",
                  "model_load_s": r"Model loading took [0-9.]+ GiB and ([0-9.]+) seconds",
                  "engine_init_s": r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s"}


def restart_phases(engine, since, total_s):
    """vLLM's own start-up phases, from its log (as vexp.py phases)."""
    with open(engine.log_path, errors="replace") as f:
        f.seek(since)
        text = f.read()
    ph = {}
    for key, pat in RESTART_PHASES.items():
        m = re.search(pat, text)
        ph[key] = float(m.group(1)) if m else None
    known = sum(v for k, v in ph.items() if v is not None and k != "weights_load_s")
    ph["process_start_imports_api_s"] = round(total_s - known, 3)
    return ph


# ---------------------------------------------------------------- rolloutcore serve
class Serve:
    """`rolloutcore serve --transfer ipc`; restartable on the same journal."""

    def __init__(self, rc_bin, work):
        self.rc_bin, self.work = rc_bin, work
        self.journal = os.path.join(work, "journal")
        self.traj = os.path.join(work, "trajectories.jsonl")
        self.log_path = os.path.join(work, "serve.log")
        self.proc, self.url, self.cmd = None, None, None

    def start(self, engine_url, manifest, checkpoint, timeout_s):
        self.cmd = [self.rc_bin, "serve", "--engine-url", engine_url, "--journal", self.journal,
                    "--trajectories", self.traj, "--port", "0", "--auth-token", TOKEN, "--transfer", "ipc",
                    "--initial-manifest", manifest, "--initial-label", "rc-1", "--initial-checkpoint", checkpoint,
                    "--initial-run", "colocated", "--initial-step", "0", "--require-weight-digest", "true",
                    "--engine-monitor-interval-ms", "200", "--transfer-timeout-ms", "240000",
                    "--call-timeout-ms", "60000", "--admit-wait-ms", "2000", "--request-timeout-ms", "120000"]
        out({"serve_command": " ".join(self.cmd)})
        return self.restart(timeout_s)

    def restart(self, timeout_s):
        """Starts the process with the command of start(); after the first start on the port it
        got, so a restart (recovery from the journal) keeps the URL the client holds."""
        import queue
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = queue.Queue()

        def pump():  # every line to the log; the first ones also to the wait below
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
                addr = line.split()[-1].strip()
                self.url = "http://" + addr
                self.cmd[self.cmd.index("--port") + 1] = addr.rsplit(":", 1)[1]
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


# ---------------------------------------------------------------- the trainer (this process)
class Trainer:
    """The checkpoint's tensors on the colocated GPU, in the file's (the manifest's) order, under
    vLLM's checkpoint names: exported as they are, they declare the checkpoint's manifest."""

    def __init__(self, torch, path):
        from safetensors import safe_open
        self.torch = torch
        entries = read_safetensors_manifest(path)
        self.order = [name for name, *_ in entries]
        self.manifest = manifest_digest(entries)
        with safe_open(path, "pt", device="cuda:0") as f:
            self.tensors = {name: f.get_tensor(name).contiguous() for name in self.order}
        torch.cuda.synchronize()
        self.uuid = str(torch.cuda.get_device_properties(0).uuid)

    def step(self, seed):
        """One deterministic "training" step: every tensor += seeded noise, in place."""
        torch = self.torch
        gen = torch.Generator(device="cuda").manual_seed(seed)
        with torch.no_grad():
            for name in self.order:
                t = self.tensors[name]
                noise = torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32)
                t.copy_(t.float().add_(noise.mul_(NOISE_SCALE)).to(t.dtype))
                del noise
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the temporaries' blocks back to the driver before the engine wakes

    def export(self, path, **kwargs):
        return rolloutcore.export_vllm_ipc([(n, self.tensors[n]) for n in self.order], path, **kwargs)

    def save(self, out_dir, like_dir):
        """A checkpoint directory of the current weights (config and tokenizer of like_dir)."""
        from safetensors.torch import save_file
        os.makedirs(out_dir, exist_ok=True)
        for f in TOKENIZER_FILES:
            shutil.copyfile(os.path.join(like_dir, f), os.path.join(out_dir, f))
        save_file({n: t.cpu() for n, t in self.tensors.items()}, os.path.join(out_dir, "model.safetensors"),
                  metadata={"format": "pt"})

    def memory(self):
        free, total = self.torch.cuda.mem_get_info(0)
        return {"free_bytes": free, "total_bytes": total,
                "trainer_allocated_bytes": self.torch.cuda.memory_allocated(0),
                "trainer_reserved_bytes": self.torch.cuda.memory_reserved(0)}


# ---------------------------------------------------------------- requests
def complete(base, prompt, n, rollout_id=None, timeout=120):
    headers = {"X-RolloutCore-Rollout-Id": rollout_id} if rollout_id else {}
    return http("POST", base + "/v1/completions",
                {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
                 "return_token_ids": True}, headers, timeout)


def ids_of(status, body):
    ok = status == 200 and isinstance(body, dict) and body.get("choices")
    return body["choices"][0].get("token_ids") if ok else None


def greedy_ids(base, tag):
    """Greedy ids of PROMPTS (through the proxy when base is serve's URL) and the version heads."""
    ids, versions = [], []
    for i, p in enumerate(PROMPTS):
        st, h, body = complete(base, p, 32, rollout_id=f"{tag}-{i}")
        ids.append(ids_of(st, body))
        versions.append(h.get("X-RolloutCore-Version") if st == 200 else f"HTTP {st}")
    return ids, versions


def prefix_hits(engine_url):
    """vLLM's prefix-cache counters (hits, queries) in tokens."""
    st, _, text = http("GET", engine_url + "/metrics", timeout=10)
    got = {"hits": 0.0, "queries": 0.0}
    for line in (text if isinstance(text, str) else "").splitlines():
        for key, name in (("hits", "vllm:prefix_cache_hits_total"), ("queries", "vllm:prefix_cache_queries_total")):
            if line.startswith(name):
                got[key] += float(line.rsplit(" ", 1)[1])
    return got


def prefix_metric_lines(engine_url):
    """The engine's own prefix-cache lines of /metrics, as it printed them (for the record)."""
    st, _, text = http("GET", engine_url + "/metrics", timeout=10)
    lines = (text if isinstance(text, str) else "").splitlines()
    return [x[:200] for x in lines if "prefix_cache" in x and not x.startswith("#")][:12]


def long_request(base, engine_url, tag):
    """The long prompt once: its ids and the prefix-cache hits it caused (vLLM's own counters)."""
    before = prefix_hits(engine_url)
    st, h, body = complete(base, LONG, 8, rollout_id=tag)
    after = prefix_hits(engine_url)
    return {"status": st, "ids": ids_of(st, body), "version": h.get("X-RolloutCore-Version"),
            "hit_tokens": after["hits"] - before["hits"], "query_tokens": after["queries"] - before["queries"]}


# ---------------------------------------------------------------- the journal
def records_since(c, since):
    got = []
    for _ in range(1000):
        page = c.events(since=since, limit=1000)
        got += page.get("records", [])
        nxt = page.get("next_since", since)
        if nxt <= since or nxt >= page.get("head_seq", 0):
            break
        since = nxt
    return got


def effect_phases(records):
    """Each effect as the journal saw it: EffectStarted -> the observation that ends it (wall ms),
    with the HTTP latency or transfer duration the observation carries."""
    got, opened = [], None
    for r in records:
        ev = r.get("event", {})
        kind = ev.get("type", "")
        if kind == "EffectStarted":
            name = ev.get("kind", "?") + ("/" + ev.get("cache", "") if ev.get("kind") == "reset_cache" else "")
            opened = (name, r.get("wall_time_ms", 0))
        elif opened and (kind.endswith("Observed") or kind in ("EngineProbed", "DrainTimedOut")):
            d = {"effect": opened[0], "ms": r.get("wall_time_ms", 0) - opened[1], "observation": kind}
            lat = (ev.get("http") or {}).get("latency_us")
            if lat:
                d["http_ms"] = round(lat / 1000.0, 3)
            if ev.get("duration_us"):
                d["duration_ms"] = round(ev["duration_us"] / 1000.0, 3)
            got.append(d)
            opened = None
    return got


def state_phases(records):
    """The lifecycle states entered, with the ms spent in each before the next change."""
    changes = [(r.get("wall_time_ms", 0), r["event"]) for r in records
               if r.get("event", {}).get("type") == "StateChanged"]
    got = []
    for i, (t, ev) in enumerate(changes):
        nxt = changes[i + 1][0] if i + 1 < len(changes) else None
        got.append({"state": ev.get("to"), "cause": ev.get("cause"), "ms": None if nxt is None else nxt - t})
    return got


def phase_totals(effects):
    totals = {}
    for e in effects:
        totals[e["effect"]] = totals.get(e["effect"], 0) + e["ms"]
    return totals


def span(c, since):
    """What the journal recorded after seq `since`: effects, states, totals per effect kind."""
    recs = records_since(c, since)
    eff = effect_phases(recs)
    return {"effects": eff, "states": state_phases(recs), "ms_by_effect": phase_totals(eff),
            "records": len(recs)}


def published(c, label):
    return [r["event"] for r in records_since(c, 0)
            if r["event"].get("type") == "VersionPublished" and r["event"].get("version", {}).get("label") == label]


def journaled_digest(c, label):
    pubs = published(c, label)
    return pubs[-1].get("engine_digest") if pubs else None


def serve_metrics(svc_url):
    st, _, text = http("GET", svc_url + "/metrics", timeout=10)
    lines = text.splitlines() if isinstance(text, str) else []
    keep = [ln for ln in lines if ln.startswith("rolloutcore_") and re.search(r"sleep|wake|phase|lifecycle_state", ln)]
    return keep[:40]


def head(c):
    return c.state().get("head_seq", 0)


# ---------------------------------------------------------------- colocated building blocks
def sleep_once(c, eng, level, sleep_id):
    """One POST /v1/sleep with the memory it freed as serve, the worker extension and vLLM's log
    report it; (ok, measurement)."""
    info0, off, seq = eng.device_info(), eng.log_size(), head(c)
    t = time.time()
    code, r = call(c.sleep, level, sleep_id=sleep_id)
    t_answered = time.time()
    wall = round(t_answered - t, 3)
    time.sleep(0.3)  # the workers' log lines reach the file
    info1, st = eng.device_info(), c.state()
    free0, free1 = info0.get("free_bytes"), info1.get("free_bytes")
    m = {"http": code, "outcome": r.get("outcome"), "reason": r.get("reason") or r.get("message"), "wall_s": wall,
         "freed_bytes_answer": r.get("freed_bytes"), "device_free_before": free0, "device_free_after": free1,
         "device_freed_bytes": free1 - free0 if isinstance(free0, int) and isinstance(free1, int) else None,
         "lifecycle": st.get("lifecycle"), "sleep_level": st.get("sleep_level"),
         "engine_log": eng.log_lines(off, SLEEP_LOG), "journal": span(c, seq), "t_called": t,
         "t_answered": t_answered}
    ok = (code == 200 and r.get("outcome") == "committed" and st.get("lifecycle") == "SLEEPING"
          and st.get("sleep_level") == level)
    return ok, m


def update_from_trainer(c, eng, trainer, label, step, handles, update_id, gpu_uuids=None):
    """Export the trainer's tensors in place, POST /v1/updates with the vllm-ipc: source, release
    once the answer is here (never before: vLLM reads the tensors until finish)."""
    off = eng.log_size()
    t = time.time()
    export = trainer.export(handles, gpu_uuids=gpu_uuids)
    export_s = round(time.time() - t, 3)
    seq = head(c)
    try:
        ident = rolloutcore.Identity(export.manifest_digest, checkpoint=f"trainer-step-{step}", run="colocated",
                                     step=step)
        t = time.time()
        code, r = call(c.update, label, ident, export.source_uri, update_id=update_id)
        wall = round(time.time() - t, 3)
    finally:
        t = time.time()
        export.release()
        release_s = round(time.time() - t, 3)
    st = c.state()
    return {"http": code, "outcome": r.get("outcome"), "reason": r.get("reason") or r.get("message"),
            "wall_s": wall, "export_s": export_s, "release_s": release_s, "exported_bytes": export.nbytes,
            "tensors": len(export.names), "manifest": export.manifest_digest, "timings": r.get("timings"),
            "lifecycle": st.get("lifecycle"), "committed": st.get("committed"), "taint": st.get("taint"),
            "engine_log": eng.log_lines(off, WAKE_LOG), "journal": span(c, seq)}


def committed(u, label):
    return (u["http"] == 200 and u["outcome"] == "committed" and u["lifecycle"] == "READY"
            and (u["committed"] or {}).get("label") == label)


def train(trainer, seed):
    t = time.time()
    trainer.step(seed)
    return round(time.time() - t, 3)


def short(d):
    """A measurement without the per-effect lists (kept in the C2 line)."""
    d = {k: v for k, v in d.items() if k not in ("t_called", "t_answered")}
    if isinstance(d.get("journal"), dict):
        d["journal"] = {"ms_by_effect": d["journal"]["ms_by_effect"], "states": d["journal"]["states"]}
    return d


# ---------------------------------------------------------------- steps
def c0_provenance(rc_bin, size, trainer_uuid, eng):
    vers, gpu, rev = host_provenance(
        ("vllm", "torch", "safetensors", "tokenizers", "ray", "pybase64", "requests"))
    with open(rc_bin, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    info = eng.device_info()
    out({"step": "C0", "what": "provenance; the engine's GPU UUID (rc_device_info) is the trainer's",
         "pass": info.get("gpu_uuid") == trainer_uuid, "size": size, "versions": vers,
         "python": sys.version.split()[0], "gpu": gpu, "rolloutcore_commit": rev, "rc_binary_sha256": sha[:16],
         "trainer_gpu_uuid": trainer_uuid, "engine_device_info": info, "budget_s": BUDGET_S,
         "gpu_memory_utilization": GPU_UTIL})


def m1_sleep_wake(c, svc, eng, trainer, ids_rc1):
    ok_s, m = sleep_once(c, eng, 1, "colo-m1-sleep")
    t = time.time()
    pst, _, pbody = complete(svc, PROMPTS[0], 8, rollout_id="m1-asleep", timeout=30)
    proxied = {"http": pst, "wall_s": round(time.time() - t, 3), "body": str(pbody)[:160]}
    mem_trainer = trainer.memory()
    seq, off = head(c), eng.log_size()
    t = time.time()
    code, r = call(c.wake, wake_id="colo-m1-wake")
    wake = {"http": code, "outcome": r.get("outcome"), "reason": r.get("reason") or r.get("message"),
            "wall_s": round(time.time() - t, 3), "engine_log": eng.log_lines(off, WAKE_LOG),
            "journal": span(c, seq)}
    st = c.state()
    ids, versions = greedy_ids(svc, "m1-after")
    C2["wake_level1_no_update"] = {"sleep": m, "wake": wake}
    logs = " ".join(m["engine_log"])
    ok = (ok_s and pst == 503 and code == 200 and r.get("outcome") == "committed" and st.get("lifecycle") == "READY"
          and st.get("committed", {}).get("label") == "rc-1" and ids == ids_rc1 and versions == ["rc-1"] * 3
          and "Sleep mode freed" in logs and (m["device_freed_bytes"] or 0) > 0)
    out({"step": "M1", "what": "sleep level 1, nothing in flight: memory freed; proxy 503 while asleep; wake "
         "(no update) -> READY on rc-1, same greedy ids", "pass": ok, "sleep": short(m),
         "proxied_while_asleep": proxied,
         "trainer_view_while_asleep": mem_trainer, "wake": short(wake), "lifecycle_after": st.get("lifecycle"),
         "committed_after": st.get("committed"), "greedy_ids_equal_before": ids == ids_rc1, "versions": versions})
    return ok


def batch(svc, k, n, tag):
    """k proxied rollouts of DRAIN_PROMPT at once; each {status, ids, version, t0, t1}."""
    res = [None] * k

    def one(i):
        t0 = time.time()
        st, h, body = complete(svc, DRAIN_PROMPT, n, rollout_id=f"{tag}-{i}", timeout=300)
        res[i] = {"status": st, "ids": ids_of(st, body), "version": h.get("X-RolloutCore-Version"),
                  "t0": t0, "t1": time.time()}

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(k)]
    for th in threads:
        th.start()
    return res, threads


def c3_drain(c, svc, eng, trainer, work, n_tokens, k=8):
    ref, threads = batch(svc, k, n_tokens, "c3-ref")
    for th in threads:
        th.join(max(5.0, left_s() - 60))
    ref_ids = [r["ids"] for r in ref if r]
    seq0 = head(c)
    res, threads = batch(svc, k, n_tokens, "c3")
    wait_until(lambda: c.state().get("active_rollouts", 0) >= k, 30, 0.02)
    time.sleep(0.2)  # a few tokens in
    ok_s, m = sleep_once(c, eng, 1, "colo-c3-sleep")
    t_s0, t_s1 = m["t_called"], m["t_answered"]
    t = time.time()
    pst, _, _ = complete(svc, PROMPTS[0], 8, rollout_id="c3-asleep", timeout=30)
    proxied = {"http": pst, "wall_s": round(time.time() - t, 3)}
    acode, abody = call(c.admit, "c3-explicit", 0)
    if acode == 200:  # admitted while asleep (a failure): end it, or its lease holds every later drain
        call(c.finish, "c3-explicit", "aborted")
    for th in threads:
        th.join(max(5.0, left_s() - 60))
    recs = records_since(c, seq0)
    slept_seq = min([r["seq"] for r in recs if r["event"].get("type") == "StateChanged"
                     and r["event"].get("to") == "SLEEPING"], default=None)
    finished = {r["event"]["rollout_id"]: r["seq"] for r in recs if r["event"].get("type") == "RolloutFinished"}
    rows = [x or {} for x in res]
    in_flight = sum(1 for x in rows if x.get("t0", 1e18) < t_s0 < x.get("t1", 0))
    # Whole: every token of one answer from rc-1 (the version header) and none cut off. Equality with
    # a batch run before is reported, not required: vLLM's batched bf16 kernels are not batch-invariant,
    # and at 8B eight identical prompts in one batch already gave two different greedy answers.
    whole = [x.get("status") == 200 and x.get("version") == "rc-1" and len(x.get("ids") or []) == n_tokens
             for x in rows]
    equal_to_reference = [x.get("ids") in ref_ids for x in rows]
    before_answer = [x.get("t1", 1e18) <= t_s1 + 0.05 for x in rows]
    journal_order = [slept_seq is not None and finished.get(f"c3-{i}", 1 << 62) < slept_seq for i in range(k)]
    ok = (ok_s and in_flight == k and all(whole) and all(before_answer) and all(journal_order) and pst == 503
          and acode == 503)
    out({"step": "C3", "what": "E3: rollouts in flight at the sleep finish first and whole; nothing admitted asleep",
         "pass": ok, "rollouts": k, "tokens_each": n_tokens, "in_flight_when_sleep_asked": in_flight,
         "whole_on_rc1": whole, "(info) equal_to_an_answer_of_the_batch_before": equal_to_reference,
         "finished_before_sleep_answered": before_answer,
         "finished_before_SLEEPING_in_journal": journal_order, "sleep": short(m),
         "finish_after_sleep_asked_s": [round(x.get("t1", 0) - t_s0, 3) for x in rows],
         "proxied_while_asleep": proxied, "explicit_admission_while_asleep": {"http": acode,
                                                                              "body": str(abody)[:200]},
         "reference_batch_distinct_answers": len({json.dumps(i) for i in ref_ids})})
    t_train = train(trainer, 1001)
    u = update_from_trainer(c, eng, trainer, "rc-2", 1, os.path.join(work, "h-rc2.json"), "colo-u-rc2")
    C2["with_drain"] = {"sleep": m, "train_s": t_train, "update": u}
    out({"step": "U1", "what": "train step 1 on the freed memory, update rc-2 from the trainer's GPU memory",
         "pass": committed(u, "rc-2"), "train_s": t_train, "update": short(u)})
    return committed(u, "rc-2"), u["manifest"]


def c2_clean(c, svc, eng, trainer, work):
    """A hot transition with nothing in flight; also E4 through RolloutCore (prefix hits)."""
    warm = [long_request(svc, eng.url, f"c2-warm-{i}") for i in (1, 2)]
    ok_s, m = sleep_once(c, eng, 1, "colo-c2-sleep")
    t_train = train(trainer, 2002)
    u = update_from_trainer(c, eng, trainer, "rc-3", 2, os.path.join(work, "h-rc3.json"), "colo-u-rc3")
    after = [long_request(svc, eng.url, f"c2-after-{i}") for i in (1, 2)]
    ids, versions = greedy_ids(svc, "c2-rc3")
    C2["clean"] = {"sleep": m, "train_s": t_train, "update": u,
                   "hot_s": round(m["wall_s"] + u["wall_s"], 3)}
    C2["through_rc_prefix"] = {"warm_hits": [w["hit_tokens"] for w in warm],
                               "first_after_update_hits": after[0]["hit_tokens"],
                               "second_after_update_hits": after[1]["hit_tokens"],
                               "version_after": after[0]["version"]}
    ok = ok_s and committed(u, "rc-3") and versions == ["rc-3"] * 3
    out({"step": "U2", "what": "clean hot transition: sleep, train step 2, update rc-3 (phases in C2)", "pass": ok,
         "sleep_s": m["wall_s"], "train_s": t_train, "update": short(u),
         "prefix_hits_first_after_update": after[0]["hit_tokens"], "versions": versions})
    return ok, ids, u["manifest"]


def c5_identity_and_uuid(c, svc, eng, trainer, work, manifests, ids_rc3):
    d2, d3 = journaled_digest(c, "rc-2"), journaled_digest(c, "rc-3")
    declared = [r["event"]["identity"]["manifest_digest"] for r in records_since(c, 0)
                if r["event"].get("type") == "UpdateRequested"]
    ok_s, m = sleep_once(c, eng, 1, "colo-c5-sleep")
    u = update_from_trainer(c, eng, trainer, "rc-wrong-gpu", 2, os.path.join(work, "h-wrong-uuid.json"),
                            "colo-u-wrong-uuid", gpu_uuids=[WRONG_UUID])
    effects = [e["effect"] for e in u["journal"]["effects"]]
    seq = head(c)
    code, r = call(c.wake, wake_id="colo-c5-wake")
    wake = {"http": code, "outcome": r.get("outcome"), "reason": r.get("reason") or r.get("message"),
            "journal": span(c, seq)}
    ids, versions = greedy_ids(svc, "c5-after")
    st = c.state()
    ok = (bool(d2) and bool(d3) and d2 != d3 and len(set(manifests)) == 1 and manifests[0] == trainer.manifest
          and set(declared) == {trainer.manifest} and ok_s and u["http"] == 422 and u["outcome"] == "refused"
          and u["lifecycle"] == "SLEEPING" and "transfer" not in effects and code == 200
          and st.get("lifecycle") == "READY" and st.get("committed", {}).get("label") == "rc-3" and ids == ids_rc3)
    out({"step": "C5", "what": "E5: one manifest, two digests; handles without the engine's GPU UUID refused in "
         "preflight, engine stays SLEEPING; wake -> rc-3", "pass": ok, "digest_rc2": (d2 or "")[:16],
         "digest_rc3": (d3 or "")[:16], "digests_differ": d2 != d3, "export_manifests": [x[:16] for x in manifests],
         "declared_manifests": sorted({x[:16] for x in declared}), "bootstrap_manifest": trainer.manifest[:16],
         "wrong_uuid_update": short(u), "effects_of_refused_update": effects, "engine_uuid": trainer.uuid,
         "wake": short(wake), "greedy_ids_equal_rc3": ids == ids_rc3, "versions": versions})
    return ok


def corrupt_copy(good_path, bad_path):
    """The good file with its pickle cut in half: the right UUIDs and manifest, handles that
    vLLM's worker cannot unpickle (after /start_weight_update took the model apart)."""
    with open(good_path) as f:
        doc = json.load(f)
    raw = base64.b64decode(doc["ipc_handles_pickled"])
    doc["ipc_handles_pickled"] = base64.b64encode(raw[: len(raw) // 2]).decode("ascii")
    fd = os.open(bad_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    return "vllm-ipc:" + os.path.abspath(bad_path)


def c7_taint_and_restore(c, serve, eng, trainer, work, d1, ids_rc3, start_timeout_s, fallback_need_s):
    ok_s, m = sleep_once(c, eng, 1, "colo-c7-sleep")
    good = trainer.export(os.path.join(work, "h-rc3-good.json"))  # rc-3's weights: unchanged since U2
    try:
        bad_src = corrupt_copy(good.path, os.path.join(work, "h-corrupt.json"))
        ident = rolloutcore.Identity(good.manifest_digest, checkpoint="corrupt", run="colocated", step=2)
        t = time.time()
        code, r = call(c.update, "rc-corrupt", ident, bad_src, update_id="colo-u-corrupt")
        wall = round(time.time() - t, 3)
        st = c.state()
        pst, _, _ = complete(serve.url, PROMPTS[0], 8, rollout_id="c7-refused", timeout=30)
        serve_exit = serve.stop()
        back = serve.restart(120)
        st2 = c.state() if back else {}
        tainted = (code == 500 and r.get("outcome") == "tainted" and st.get("lifecycle") == "TAINTED" and pst == 503
                   and back and st2.get("lifecycle") == "TAINTED" and bool((st2.get("taint") or {}).get("cause")))
        out({"step": "C7a", "what": "E7: truncated pickle under the right UUID -> tainted, TAINTED (why in "
             "/v1/state), proxy 503, still TAINTED after serve restarts", "pass": ok_s and tainted,
             "update_http": code, "outcome": r.get("outcome"),
             "reason": (r.get("reason") or r.get("message") or "")[:600],
             "wall_s": wall, "taint": st.get("taint"), "proxied_http": pst, "serve_exit": serve_exit,
             "restarted": back, "taint_after_restart": st2.get("taint"),
             "lifecycle_after_restart": st2.get("lifecycle")})
        t = time.time()
        rcode, rr = call(c.restore, "rc-3", source=good.source_uri, restore_id="colo-r-ipc")
        rwall = round(time.time() - t, 3)
    finally:
        good.release()
    restored = rcode == 200 and rr.get("outcome") == "committed"
    how = "ipc restore from the trainer's rc-3 tensors"
    if not restored and left_s() > fallback_need_s:
        how = "fallback: engine restarted on a checkpoint of the trainer's rc-3 tensors, restore(adopt=True)"
        rcode, rr, rwall = adopt_after_restart(c, eng, trainer, work, d1, min(start_timeout_s, left_s() - 60))
        restored = rcode == 200 and rr.get("outcome") == "committed"
    st3 = c.state()
    ids, versions = greedy_ids(serve.url, "c7-after") if restored else (None, None)
    pubs = published(c, "rc-3")
    ok = (restored and st3.get("lifecycle") == "READY" and len(pubs) >= 2
          and pubs[-1].get("engine_digest") == pubs[0].get("engine_digest") and ids == ids_rc3)
    out({"step": "C7b", "what": "E7: restore rc-3 with proof (its journaled digest), READY, same greedy ids",
         "pass": ok, "how": how, "restore_http": rcode, "outcome": rr.get("outcome"),
         "reason": (rr.get("reason") or rr.get("message") or "")[:600], "wall_s": rwall, "timings": rr.get("timings"),
         "lifecycle": st3.get("lifecycle"), "committed": st3.get("committed"),
         "digest_equals_rc3": len(pubs) >= 2 and pubs[-1].get("engine_digest") == pubs[0].get("engine_digest"),
         "greedy_ids_equal_rc3": ids == ids_rc3, "versions": versions})
    return ok


def adopt_after_restart(c, eng, trainer, work, d1, start_timeout_s):
    """The certain recovery: a fresh engine on a checkpoint of the same weights, then adopt."""
    ckpt = os.path.join(work, "rc3-ckpt")
    trainer.save(ckpt, d1)
    eng.kill()
    wait_for_free_memory(trainer, GPU_UTIL + 0.02, 60)
    ready, start_s = eng.start(ckpt, start_timeout_s)
    if not ready:
        return 0, {"reason": f"engine did not come back ({start_s} s)"}, start_s
    t = time.time()
    code, r = call(c.restore, "rc-3", adopt=True, restore_id="colo-r-adopt")
    return code, r, round(time.time() - t + start_s, 3)


def m2_level2(c, svc, eng, trainer, work):
    ok_s, m = sleep_once(c, eng, 2, "colo-m2-sleep")
    wcode, wbody = call(c.wake, wake_id="colo-m2-wake")
    st = c.state()
    t_train = train(trainer, 3003)
    u = update_from_trainer(c, eng, trainer, "rc-4", 3, os.path.join(work, "h-rc4.json"), "colo-u-rc4")
    first = long_request(svc, eng.url, "m2-after-1")
    ids, versions = greedy_ids(svc, "m2-rc4")
    C2["level2"] = {"sleep": m, "train_s": t_train, "update": u, "hot_s": round(m["wall_s"] + u["wall_s"], 3)}
    C2["through_rc_prefix"]["level2_first_after_update_hits"] = first["hit_tokens"]
    logs = " ".join(m["engine_log"])
    ok = (ok_s and wcode == 409 and st.get("lifecycle") == "SLEEPING" and committed(u, "rc-4")
          and versions == ["rc-4"] * 3 and "Sleep mode freed" in logs)
    out({"step": "M2", "what": "sleep level 2: memory freed; wake refused (409, stays SLEEPING); train step 3, "
         "update rc-4 covering every tensor -> READY", "pass": ok, "sleep": short(m), "wake_http": wcode,
         "wake_body": str(wbody)[:200], "lifecycle_after_wake": st.get("lifecycle"), "train_s": t_train,
         "update": short(u), "versions": versions})
    return ok, ids, first


def wait_for_free_memory(trainer, fraction, timeout_s):
    """Until the GPU has `fraction` of its memory free (a killed engine's memory comes back)."""
    def enough():
        mem = trainer.memory()
        return mem["free_bytes"] >= fraction * mem["total_bytes"]
    return bool(wait_until(enough, timeout_s, 0.5))


def direct_ipc_update(eng, export):
    """vLLM's ipc update outside RolloutCore, as its RLHF examples do it: pause keeping the
    caches, start / update / finish, resume. No sleep, no cache reset, no label."""
    with open(export.path) as f:
        doc = json.load(f)
    info = {k: doc[k] for k in ("names", "dtype_names", "shapes", "ipc_handles_pickled")}
    info["packed"] = False
    steps = [("/pause?mode=keep&clear_cache=false", {}), ("/start_weight_update", {}),
             ("/update_weights", {"update_info": info}), ("/finish_weight_update", {}), ("/resume", {})]
    got = []
    for route, body in steps:
        st, _, b = http("POST", eng.url + route, body, timeout=300)
        got.append([route.split("?")[0], st, str(b)[:120]])
        if st != 200:
            break
    return got


def c1_reference_and_c4_negative(c, serve, eng, trainer, work, d1, ids_rc4, long_rc4, start_timeout_s):
    """Stops serve and the colocated engine, starts a reference engine on a checkpoint of the
    trainer's rc-4 tensors (same flags, same GPU, the trainer still holding its memory)."""
    serve_exit = serve.stop()
    eng.kill()
    freed = wait_for_free_memory(trainer, GPU_UTIL + 0.02, 60)
    ref_dir = os.path.join(work, "ref-rc4")
    t = time.time()
    trainer.save(ref_dir, d1)
    save_s = round(time.time() - t, 3)
    off = eng.log_size()
    ready, start_s = eng.start(ref_dir, start_timeout_s)
    C2["restart_to_ready"] = {"what": "reference engine: process start -> /health 200, same flags and GPU",
                              "total_s": start_s, "phases": restart_phases(eng, off, start_s) if ready else None,
                              "checkpoint_save_s": save_s}
    if not ready:
        out({"step": "C1", "what": "reference engine on the rc-4 weights", "pass": False, "ready": False,
             "start_s": start_s, "serve_exit": serve_exit, "memory_freed_in_time": freed})
        return
    ids, _ = greedy_ids(eng.url, "ref")
    fresh = long_request(eng.url, eng.url, "ref-long")
    out({"step": "C1", "what": "E1: greedy ids after the colocated ipc update (rc-4, level 2) == a reference "
         "engine started on the same weights (after the colocated engine stopped)", "pass": ids == ids_rc4,
         "identical_per_prompt": [a == b for a, b in zip(ids, ids_rc4 or [])], "reference_start_s": start_s,
         "checkpoint_save_s": save_s, "serve_exit": serve_exit, "reference_ids_head": [x[:8] if x else x for x in ids],
         "long_prompt_ids_equal": fresh["ids"] == long_rc4["ids"]})
    c4_negative(eng, trainer, work, fresh, long_rc4)


def c4_negative(eng, trainer, work, fresh_ref, long_rc4):
    warm = [long_request(eng.url, eng.url, f"neg-warm-{i}") for i in (1, 2)]
    t_train = train(trainer, 4004)
    with trainer.export(os.path.join(work, "h-direct.json")) as export:
        steps = direct_ipc_update(eng, export)
    stale = long_request(eng.url, eng.url, "neg-stale")
    st, _, _ = http("POST", eng.url + "/reset_prefix_cache", {}, timeout=30)
    fresh = long_request(eng.url, eng.url, "neg-fresh")
    through = C2.get("through_rc_prefix", {})
    through_ok = (through.get("first_after_update_hits") == 0 and through.get("level2_first_after_update_hits") == 0
                  and fresh_ref["ids"] == long_rc4["ids"] and long_rc4["hit_tokens"] == 0)
    # The ids carry the proof (stale KV changes greedy ids; a fresh prefill reproduces the reference);
    # vLLM's hit counters are reported beside them with the raw metric lines.
    negative_shows = all(s[1] == 200 for s in steps) and len(steps) == 5 and stale["ids"] != fresh["ids"]
    out({"step": "C4", "what": "E4: through RolloutCore no old-version prefix hit and ids == reference; negative "
         "control outside it (pause keep, ipc update, resume): stale hits, ids differ from the same engine reset",
         "pass": through_ok and negative_shows,
         "through_rolloutcore": dict(through, long_ids_equal_reference=fresh_ref["ids"] == long_rc4["ids"]),
         "negative_warm_hits": [w["hit_tokens"] for w in warm], "negative_train_s": t_train,
         "negative_direct_update": steps, "(expected) stale_hit_tokens": stale["hit_tokens"],
         "(expected true) stale_ids_differ_from_fresh": stale["ids"] != fresh["ids"], "reset_http": st,
         "fresh_hit_tokens": fresh["hit_tokens"], "prefix_metric_lines": prefix_metric_lines(eng.url)})


def c2_report(first_start):
    restart = C2.get("restart_to_ready") or first_start
    clean, lvl2 = C2.get("clean"), C2.get("level2")
    figures = {}
    for name in ("clean", "with_drain", "level2"):
        m = C2.get(name)
        if m:
            figures[name] = {"sleep_s": m["sleep"]["wall_s"], "update_s": m["update"]["wall_s"],
                             "hot_s": round(m["sleep"]["wall_s"] + m["update"]["wall_s"], 3),
                             "train_s": m["train_s"], "export_s": m["update"]["export_s"],
                             "release_s": m["update"]["release_s"], "update_timings": m["update"]["timings"],
                             "sleep_journal": m["sleep"]["journal"], "update_journal": m["update"]["journal"],
                             "freed_bytes_answer": m["sleep"]["freed_bytes_answer"]}
    wake = C2.get("wake_level1_no_update")
    if wake:
        figures["wake_without_update"] = {"sleep_s": wake["sleep"]["wall_s"], "wake_s": wake["wake"]["wall_s"],
                                          "wake_journal": wake["wake"]["journal"]}
    ok = bool(clean) and bool(clean["update"]["journal"]["effects"]) and bool(restart.get("total_s"))
    out({"step": "C2", "what": "E2: hot colocated transition (sleep + update, train excluded) vs restart-to-ready, "
         "phases from the journal", "pass": ok, "restart_to_ready": restart, "hot": figures,
         "hot_clean_s": clean and clean["hot_s"], "hot_level2_s": lvl2 and lvl2["hot_s"],
         "speedup_vs_restart": round(restart["total_s"] / clean["hot_s"], 1) if ok and clean["hot_s"] else None})


# ---------------------------------------------------------------- main
def make_checkpoint(size, work):
    py = os.environ.get("RC_COLO_MODEL_PY", sys.executable)
    d1 = os.path.join(work, "seed1")
    done = os.path.join(work, "seed1.done")  # outside the checkpoint: vLLM globs its directory
    t = time.time()
    if not (os.path.exists(done) and os.path.exists(os.path.join(d1, "model.safetensors"))):
        p = subprocess.run([py, os.path.join(HERE, "make_model.py"), "--shape", SHAPES[size], "--out", d1,
                            "--seed", "1"], capture_output=True, text=True, timeout=max(10.0, left_s() - 60))
        if p.returncode != 0:
            out({"step": "model", "pass": False, "stderr": p.stderr[-1500:]})
            return None
        open(done, "w").close()
    out({"step": "model", "what": "seed-1 checkpoint (make_model.py)", "pass": True, "shape": SHAPES[size],
         "seconds": round(time.time() - t, 1),
         "bytes": os.path.getsize(os.path.join(d1, "model.safetensors"))})
    return d1


def run(rc_bin, size, work, torch, eng, serve):
    start_timeout_s = 120 if size != "8b" else 300
    d1 = make_checkpoint(size, work)
    if not d1:
        return
    off = eng.log_size()
    ready, start_s = eng.start(d1, start_timeout_s)
    first_start = {"what": "the colocated engine's own start: process start -> /health 200", "total_s": start_s,
                   "phases": restart_phases(eng, off, start_s) if ready else None}
    out({"step": "engine", "what": "colocated engine start on seed 1", "pass": ready, "start_s": start_s,
         "command": " ".join(eng.command(d1))})
    if not ready:
        os.system(f"tail -c 3000 {eng.log_path}")
        return
    t = time.time()
    trainer = Trainer(torch, os.path.join(d1, "model.safetensors"))  # after the engine's start-up profiling
    out({"step": "trainer", "what": "trainer loads seed 1 onto the same GPU", "pass": True,
         "load_s": round(time.time() - t, 3), "tensors": len(trainer.order), "manifest": trainer.manifest[:16],
         "memory": trainer.memory()})
    c0_provenance(rc_bin, size, trainer.uuid, eng)
    up = serve.start(eng.url, trainer.manifest, d1, 120)
    out({"step": "serve", "what": "serve --transfer ipc start (bootstrap rc-1)", "pass": up, "url": serve.url})
    if not up:
        print(open(serve.log_path).read()[-3000:])
        return
    c = rolloutcore.Client(serve.url, TOKEN, timeout_s=60, update_timeout_s=300)
    ids_rc1, versions = greedy_ids(serve.url, "rc1")
    if versions != ["rc-1"] * 3:
        out({"step": "bootstrap", "pass": False, "versions": versions, "state": c.state()})
        return
    steps_after_bootstrap(c, serve, eng, trainer, work, d1, size, ids_rc1, start_timeout_s)
    c2_report(first_start)


def steps_after_bootstrap(c, serve, eng, trainer, work, d1, size, ids_rc1, start_timeout_s):
    m1_sleep_wake(c, serve.url, eng, trainer, ids_rc1)
    ok, m_rc2 = c3_drain(c, serve.url, eng, trainer, work, 256 if size == "8b" else 512)
    if not ok:
        return
    ok, ids_rc3, m_rc3 = c2_clean(c, serve.url, eng, trainer, work)
    if not ok:
        return
    c5_identity_and_uuid(c, serve.url, eng, trainer, work, [m_rc2, m_rc3], ids_rc3)
    need_s = 200 if size == "8b" else 60  # a checkpoint save and an engine start, with margin
    if not c7_taint_and_restore(c, serve, eng, trainer, work, d1, ids_rc3, start_timeout_s, need_s):
        return
    ok, ids_rc4, long_rc4 = m2_level2(c, serve.url, eng, trainer, work)
    if not ok:
        return
    if left_s() < need_s:
        out({"step": "C1", "what": "reference engine", "pass": False, "skipped": f"budget: {round(left_s())} s left"})
        return
    c1_reference_and_c4_negative(c, serve, eng, trainer, work, d1, ids_rc4, long_rc4,
                                 min(start_timeout_s, left_s() - 30))


# ---------------------------------------------------------------- GPU check without vLLM or serve
def tensor_sha(t):
    return hashlib.sha256(t.detach().reshape(-1).contiguous().view(__import__("torch").uint8).cpu()
                          .numpy().tobytes()).hexdigest()[:16]


def ipc_receive(path):
    """Opens a vllm-ipc: file as vLLM 0.25.1's worker does (IPCWeightTransferEngine.receive_weights,
    unpacked): its own UUID looked up in each dict, element 6 set to its device, torch's
    rebuild_cuda_tensor; prints what it read."""
    import pickle
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    with open(path) as f:
        doc = json.load(f)
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    got = {"uuid": uuid, "digests": {}, "dtypes": [], "shapes": []}
    for name, handle in zip(doc["names"], pickle.loads(base64.b64decode(doc["ipc_handles_pickled"]))):
        if uuid not in handle:
            got["error"] = f"IPC handle not found for GPU UUID {uuid}. Available UUIDs: {list(handle)}"
            break
        args = list(handle[uuid])
        args[6] = 0
        t = rebuild_cuda_tensor(*args)
        got["digests"][name] = tensor_sha(t)
        got["dtypes"].append(str(t.dtype).split(".")[-1])
        got["shapes"].append(list(t.shape))
    print(json.dumps(got), flush=True)


def receive(path):
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--ipc-receive", path], capture_output=True,
                       text=True, timeout=120)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"receiver exit {p.returncode}: {p.stderr[-800:]}"}


def ipc_expandable(path):
    """With expandable segments the export is either refused, or another process (opening the handles
    as vLLM's worker does) reads the tensor whole while the exporter holds it."""
    import torch
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    try:
        ex = rolloutcore.export_vllm_ipc({"x": x}, path)
    except ValueError as e:
        print(json.dumps({"refused": True, "error": str(e)[:200]}))
        return
    got = receive(ex.path)
    print(json.dumps({"refused": False, "received": got, "expected": {"x": tensor_sha(x)}}))
    ex.release()


def ipc_check(work):
    """One GPU, no vLLM, no serve: the Trainer and export_vllm_ipc against a receiver process
    that opens the handles as vLLM's worker does."""
    import gc
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # before torch: expandable segments cannot be exported
    import torch
    from safetensors.torch import save_file
    from rolloutcore.vllm_ext import RolloutCoreWorkerExtension
    os.makedirs(work, exist_ok=True)
    ckpt = os.path.join(work, "model.safetensors")
    g = torch.Generator().manual_seed(1)
    save_file({"model.b.weight": torch.randn(64, 48, generator=g).to(torch.bfloat16),
               "model.a.bias": torch.randn(7, generator=g), "model.c.norm": torch.randn(3000, generator=g).half()},
              ckpt)
    trainer = Trainer(torch, ckpt)
    before = {n: tensor_sha(t) for n, t in trainer.tensors.items()}
    trainer.step(5)
    want = {n: tensor_sha(t) for n, t in trainer.tensors.items()}
    with trainer.export(os.path.join(work, "h.json")) as export:
        got = receive(export.path)
    out({"step": "K1", "what": "the trainer's tensors read by another process as vLLM's worker opens them",
         "pass": got.get("digests") == want and got.get("dtypes") == export.dtype_names
         and got.get("shapes") == export.shapes and got.get("uuid") == trainer.uuid and before != want,
         "received": got, "expected": want, "dtype_names": export.dtype_names, "shapes": export.shapes,
         "step_changed_every_tensor": all(before[n] != want[n] for n in want)})
    base = torch.cuda.memory_allocated(0)
    x = {"x": torch.randn(1 << 22, device="cuda")}  # 16 MiB
    want_x = tensor_sha(x["x"])
    ex = rolloutcore.export_vllm_ipc(x, os.path.join(work, "alive.json"))
    del x
    gc.collect()
    held = torch.cuda.memory_allocated(0) - base
    got = receive(ex.path)  # the receiver process has exited: it holds nothing any more
    ex.release()
    gc.collect()
    left = torch.cuda.memory_allocated(0) - base
    # torch itself keeps a shared block allocated until the receiver lets go (its "limbo"), so `held`
    # shows the memory kept, not which of the two keeps it; the stand-in tests check the export's own.
    out({"step": "K2", "what": "an export of a tensor nothing else references is read whole by another process; "
         "release() frees it and removes the file", "pass": got.get("digests") == {"x": want_x}
         and left < 16 << 20 and not os.path.exists(ex.path),
         "held_bytes_before_release": held, "bytes_left_after_release": left, "received": got, "expected": want_x})
    with trainer.export(os.path.join(work, "wrong.json"), gpu_uuids=[WRONG_UUID]) as wrong:
        got = receive(wrong.path)
    out({"step": "K3", "what": "handles keyed by another UUID: the receiver does not find its GPU (as vLLM)",
         "pass": "not found" in got.get("error", ""), "received": got})
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--ipc-expandable", os.path.join(work, "e.json")],
                       capture_output=True, text=True, timeout=120, env=env)
    lines = p.stdout.strip().splitlines()
    res = json.loads(lines[-1]) if lines else {"error": p.stderr[-500:]}
    read_whole = res.get("received", {}).get("digests") == res.get("expected")
    out({"step": "K4", "what": "expandable segments: refused before any file, or read whole by another process",
         "pass": res.get("refused") is True or read_whole,
         "result": res, "file_written": os.path.exists(os.path.join(work, "e.json"))})

    class Worker(RolloutCoreWorkerExtension):
        rank, device = 0, torch.device("cuda:0")

    info = Worker().rc_device_info()
    free, total = torch.cuda.mem_get_info(0)
    out({"step": "K5", "what": "rc_device_info on a real GPU: the trainer's UUID, mem_get_info",
         "pass": info["gpu_uuid"] == trainer.uuid and info["total_bytes"] == total
         and abs(info["free_bytes"] - free) < (1 << 30), "info": info})


def main():
    modes = {"--ipc-check": ipc_check, "--ipc-receive": ipc_receive, "--ipc-expandable": ipc_expandable}
    if len(sys.argv) == 3 and sys.argv[1] in modes:
        modes[sys.argv[1]](os.path.abspath(sys.argv[2]))
        return 0 if all(RESULTS.values()) else 1
    rc_bin, size, work = sys.argv[1], sys.argv[2], os.path.abspath(sys.argv[3])
    if size not in SHAPES:
        print("size: 125m, 8b or tiny", file=sys.stderr)
        return 2
    os.makedirs(work, exist_ok=True)
    shutil.rmtree(os.path.join(work, "journal"), ignore_errors=True)  # one run, one journal
    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("RC_COLO_GPU", "0")  # the trainer's GPU is the engine's
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # expandable segments cannot be exported
    import torch
    if not torch.cuda.is_available():
        out({"step": "C0", "pass": False, "reason": "no CUDA device: colocated mode needs one GPU"})
        return 1
    eng = Engine(work, int(os.environ.get("RC_VLLM_PORT", "8000")), os.environ["CUDA_VISIBLE_DEVICES"])
    serve = Serve(rc_bin, work)
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(BudgetExceeded()))
    signal.alarm(int(max(10, BUDGET_S)))
    try:
        run(rc_bin, size, work, torch, eng, serve)
        return 0 if RESULTS and all(RESULTS.values()) else 1
    except BudgetExceeded:
        out({"step": "budget", "pass": False, "reason": f"RC_COLO_BUDGET_S={BUDGET_S} spent"})
        return 1
    except Exception as e:  # report, then still stop both processes
        import traceback
        out({"step": "exception", "pass": False, "error": repr(e)[:800], "where": traceback.format_exc()[-1500:]})
        return 1
    finally:
        signal.alarm(0)
        serve.kill()
        eng.kill()
        out({"step": "summary", "pass": bool(RESULTS) and all(RESULTS.values()), "steps": RESULTS,
             "wall_s": round(time.time() - T0, 1), "work": work})


if __name__ == "__main__":
    sys.exit(main())
