#!/usr/bin/env python3
# Proves that SIGKILLing a live `rolloutcore serve` at random points (mid-traffic, mid-update)
# loses no acknowledged event and never lets a rollout span two versions; it would catch an
# answer (admission, finish, update outcome, X-RolloutCore-Head) sent before it was durable, a
# recovery that rewrites or drops history, or an unnoticed engine replacement.
"""Crash-loop soak of the real `rolloutcore serve` against the `vllm-double` engine.

Client threads send proxied completions (streaming and not) and explicit rollouts (admit,
renew the lease, DELETE); a trainer thread sends updates with unique update_ids and labels.
Every answer is recorded. The main thread SIGKILLs serve at seeded random times (uniform in a
window, or just after an update was sent), restarts it on the same journal with the engine still
running, waits for /readyz, and checks every answer received so far against
`rolloutcore replay JOURNAL --events --json` and `rolloutcore audit --expect-head SEQ:HASH`.
A fraction of iterations kills and restarts the engine double instead: serve must turn TAINTED
(engine_replaced); the loop then starts a new journal and engine. See tests/soak/README.md.

Standard library + the in-repo client only; loopback only; every wait has a deadline; processes
are killed and the private temporary directory removed on every exit path (kept on failure).
"""
from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
import rolloutcore  # noqa: E402  (the in-repo client)

TOKEN = "soak-token"
SOURCE = "synthetic:4x64"
HOST = "127.0.0.1"
BAD_DIGEST = "ab" * 32


class Failure(Exception):
    pass


def now() -> float:
    return time.monotonic()


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------
class Proc:
    """A child process whose stdout goes to a file; `listening on HOST:PORT` is read from it."""

    def __init__(self, name: str, cmd: list, logdir: pathlib.Path, registry: "Procs"):
        self.name = name
        self.cmd = cmd
        self.out_path = logdir / f"{name}.stdout"
        self.err_path = logdir / f"{name}.stderr"
        self.proc = None
        self.registry = registry

    def start(self, deadline_s: float) -> str:
        out = open(self.out_path, "ab")  # appended: one log per journal, across restarts
        err = open(self.err_path, "ab")
        offset = out.tell()
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        finally:
            out.close()
            err.close()
        self.registry.add(self)
        end = now() + deadline_s
        while now() < end:
            with open(self.out_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
            for line in text.splitlines():
                if line.startswith("listening on "):
                    return line.split()[-1].strip()
            if self.proc.poll() is not None:
                raise Failure(f"{self.name} exited {self.proc.returncode} before listening: "
                              f"{self.stderr_tail()}")
            time.sleep(0.005)
        self.kill()
        raise Failure(f"{self.name} did not print 'listening on' within {deadline_s} s")

    def stderr_tail(self, n: int = 1500) -> str:
        try:
            return self.err_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, deadline_s: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            rc = self.proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            raise Failure(f"{self.name} (pid {self.proc.pid}) still alive {deadline_s} s after SIGKILL")
        self.registry.remove(self)
        return rc


class Procs:
    """Every child this script started, so that any exit path can kill them (by pid)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.live = set()

    def add(self, p: Proc):
        with self.lock:
            self.live.add(p)

    def remove(self, p: Proc):
        with self.lock:
            self.live.discard(p)

    def kill_all(self):
        with self.lock:
            procs = list(self.live)
        for p in procs:
            try:
                p.kill(deadline_s=5)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass


# ---------------------------------------------------------------------------------------------
# Raw HTTP (binding headers are needed, so not urllib)
# ---------------------------------------------------------------------------------------------
class Answer:
    __slots__ = ("status", "headers", "body", "done", "error_event")

    def __init__(self, status, headers, body, done=False, error_event=False):
        self.status, self.headers, self.body = status, headers, body
        self.done, self.error_event = done, error_event


def request(url: str, method: str, path: str, body=None, headers=None, timeout=10.0,
            stream=False) -> Answer:
    u = urllib.parse.urlsplit(url)
    assert u.hostname == HOST, "traffic only to loopback"
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        h = {"Content-Type": "application/json"}
        if headers:
            h.update(headers)
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=h)
        r = conn.getresponse()
        hdrs = {k.lower(): v for k, v in r.getheaders()}
        if stream and r.status == 200:
            done = err = False
            end = now() + timeout
            while now() < end:
                line = r.readline()
                if not line:
                    break
                if line.startswith(b"data: [DONE]"):
                    done = True
                    break
                if line.startswith(b"data: ") and b'"error"' in line[:20]:
                    err = True
            return Answer(r.status, hdrs, None, done, err)
        raw = r.read()
        try:
            doc = json.loads(raw) if raw else {}
        except ValueError:
            doc = {"_raw": raw[:200].decode(errors="replace")}
        return Answer(r.status, hdrs, doc)
    finally:
        conn.close()


NET_ERRORS = (OSError, http.client.HTTPException)


# ---------------------------------------------------------------------------------------------
# Shared state
# ---------------------------------------------------------------------------------------------
class World:
    """The current serve endpoint (url, epoch) and the log of every answer received."""

    def __init__(self):
        self.lock = threading.Lock()
        self.url = None
        self.epoch = 0
        self.answers = []          # dicts; "epoch" = the journal whose serve answered
        self.stop = threading.Event()
        self.update_sent = threading.Event()
        self.counts = collections.Counter()
        self.thread_errors = []

    def endpoint(self):
        with self.lock:
            return self.url, self.epoch

    def set_endpoint(self, url, epoch):
        with self.lock:
            self.url, self.epoch = url, epoch

    def record(self, a: dict):
        with self.lock:
            self.answers.append(a)

    def count(self, key, n=1):
        with self.lock:
            self.counts[key] += n


def client_thread(w: World, tid: int, seed: int, p_stream: float, p_explicit: float):
    rng = random.Random(seed)
    n = 0
    while not w.stop.is_set():
        url, epoch = w.endpoint()
        if url is None:
            time.sleep(0.02)
            continue
        n += 1
        r = rng.random()
        try:
            if r < p_explicit:
                explicit_rollout(w, rng, tid, n, url, epoch)
            else:
                proxied(w, rng, tid, n, url, epoch, stream=r < p_explicit + p_stream)
        except NET_ERRORS:
            w.count("net_errors")
            time.sleep(0.01)
        except Exception:  # noqa: BLE001 - reported as a failure by the main thread
            w.thread_errors.append(traceback.format_exc())
            return


def proxied(w, rng, tid, n, url, epoch, stream):
    rid = f"p{tid}-{n}"
    route = rng.choice(["/v1/completions", "/v1/chat/completions"]) if not stream else "/v1/completions"
    body = {"max_tokens": rng.randint(1, 8)}
    if route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": f"q{n}"}]
    else:
        body["prompt"] = f"hello {tid} {n}"
    if stream:
        body["stream"] = True
    kind = "proxy_stream" if stream else "proxy"
    try:
        a = request(url, "POST", route, body, {"X-RolloutCore-Rollout-Id": rid}, timeout=15,
                    stream=stream)
    except NET_ERRORS:
        w.count(f"{kind}_net_error")
        return
    h = a.headers
    w.record({"kind": kind, "epoch": epoch, "rid": rid, "status": a.status,
              "hdr_rid": h.get("x-rolloutcore-rollout-id"),
              "hdr_gen": h.get("x-rolloutcore-generation"),
              "hdr_label": h.get("x-rolloutcore-version"),
              "hdr_seq": h.get("x-rolloutcore-admission-seq"),
              "hdr_head": h.get("x-rolloutcore-head"),
              "done": a.done, "error_event": a.error_event,
              "err_type": ((a.body or {}).get("error") or {}).get("type")
              if isinstance((a.body or {}).get("error"), dict) else None})


def explicit_rollout(w, rng, tid, n, url, epoch):
    rid = f"x{tid}-{n}"
    auth = {"Authorization": "Bearer " + TOKEN}
    try:
        a = request(url, "POST", "/v1/rollouts", {"rollout_id": rid, "wait_ms": 1500,
                                                  "lease_ms": 3000}, auth, timeout=10)
    except NET_ERRORS:
        w.count("admit_net_error")
        return
    w.record({"kind": "admit", "epoch": epoch, "rid": rid, "status": a.status,
              "body": a.body if a.status == 201 else None,
              "hdr_head": a.headers.get("x-rolloutcore-head")})
    if a.status != 201:
        return
    hold_end = now() + rng.uniform(0.0, 0.05)
    if rng.random() < 0.5:  # renew once while holding it
        time.sleep(max(0.0, hold_end - now()) / 2)
        u2, e2 = w.endpoint()
        if e2 == epoch and u2:
            try:
                r = request(u2, "POST", f"/v1/rollouts/{rid}/lease", {}, auth, timeout=10)
                w.record({"kind": "renew", "epoch": epoch, "rid": rid, "status": r.status})
            except NET_ERRORS:
                w.count("renew_net_error")
    time.sleep(max(0.0, hold_end - now()))
    outcome = "completed" if rng.random() < 0.8 else "aborted"
    # The DELETE is retried across executor restarts (the lease survives them while renewed);
    # given up after a deadline (longer than a slow recovery, RESULTS.md finding 1) or when the
    # journal changed (the rollout then expires).
    end = now() + 30.0
    while now() < end and not w.stop.is_set():
        u2, e2 = w.endpoint()
        if e2 != epoch:
            w.count("finish_given_up_epoch_changed")
            return
        if u2 is None:
            time.sleep(0.02)
            continue
        try:
            d = request(u2, "DELETE", f"/v1/rollouts/{rid}",
                        {"outcome": outcome, "prompt_tokens": 3, "completion_tokens": 5},
                        auth, timeout=10)
        except NET_ERRORS:
            w.count("finish_net_error")
            time.sleep(0.03)
            try:  # keep the lease alive meanwhile
                request(w.endpoint()[0] or u2, "POST", f"/v1/rollouts/{rid}/lease", {}, auth,
                        timeout=2)
            except NET_ERRORS:
                pass
            continue
        w.record({"kind": "finish", "epoch": epoch, "rid": rid, "status": d.status,
                  "sent_outcome": outcome, "body": d.body if d.status == 200 else None,
                  "hdr_head": d.headers.get("x-rolloutcore-head")})
        if d.status == 503:
            time.sleep(0.05)
            continue
        return
    w.count("finish_given_up_deadline")


def trainer_thread(w: World, seed: int, digest: str, p_bad: float):
    rng = random.Random(seed)
    n = 0
    while not w.stop.is_set():
        time.sleep(rng.uniform(0.3, 1.0))
        url, epoch = w.endpoint()
        if url is None:
            continue
        n += 1
        uid, label = f"u{n}", f"rc-{n}"
        bad = rng.random() < p_bad
        ident = rolloutcore.Identity(BAD_DIGEST if bad else digest, checkpoint=f"ckpt-{n}",
                                     run="soak", step=n)
        # Same id + same body until an outcome is known, within this journal, bounded.
        end = now() + 10.0
        tries = 0
        while now() < end and not w.stop.is_set():
            u2, e2 = w.endpoint()
            if e2 != epoch:
                break
            if u2 is None:
                time.sleep(0.02)
                continue
            tries += 1
            c = rolloutcore.Client(u2, TOKEN, timeout_s=10, update_timeout_s=15)
            rec = {"kind": "update", "epoch": epoch, "uid": uid, "label": label, "bad": bad,
                   "try": tries}
            w.update_sent.set()
            try:
                # Each step's seed names other weights, so the weight digest changes per update.
                doc = c.update(label, ident, f"{SOURCE}:{n}", update_id=uid)
                rec.update(status=200, outcome=doc.get("outcome"), head=doc.get("head"),
                           replayed=doc.get("replayed"))
            except rolloutcore.OutcomeUnknown as e:
                rec.update(status=e.status, outcome="outcome_unknown")
            except rolloutcore.UpdateFailed as e:
                rec.update(status=e.status, outcome=e.outcome, head=e.body.get("head"),
                           replayed=e.body.get("replayed"))
            except rolloutcore.RolloutCoreError as e:
                err = e.body.get("error") if isinstance(e.body.get("error"), dict) else {}
                rec.update(status=e.status, outcome=None, err_type=err.get("type"),
                           message=e.message[:200])
            except NET_ERRORS:
                w.count("update_net_error")
                time.sleep(0.05)
                continue
            w.record(rec)
            if rec["outcome"] in ("committed", "refused", "tainted"):
                break
            if rec["status"] == 409 and "TAINTED" in rec.get("message", ""):
                break
            if rec["status"] in (400, 401, 403, 404, 413, 422):
                break  # refused before anything was journaled (e.g. 422 manifest_mismatch)
            time.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# The journal, as replay prints it, and the checks
# ---------------------------------------------------------------------------------------------
class JournalView:
    def __init__(self, lines: list, report: dict):
        self.report = report
        self.hash = {}             # seq -> hash
        self.admitted = {}         # rollout id -> (seq, generation, label)
        self.finished = {}         # rollout id -> (seq, outcome, committed generation then)
        self.update_ended = {}     # update id -> outcome
        self.published = {}        # update id -> label
        self.spans = []            # problems found while folding
        committed_gen = 0
        for d in lines:
            seq = d["seq"]
            self.hash[seq] = d["hash"]
            ev = d["event"]
            t = ev.get("type")
            if t == "RolloutAdmitted":
                v = ev["version"]
                if ev["rollout_id"] in self.admitted:
                    self.spans.append(f"rollout {ev['rollout_id']} admitted twice (seq {seq})")
                if v["generation"] != committed_gen:
                    self.spans.append(f"rollout {ev['rollout_id']} admitted under generation "
                                      f"{v['generation']} while {committed_gen} was committed")
                self.admitted[ev["rollout_id"]] = (seq, v["generation"], v["label"])
            elif t == "RolloutFinished":
                rid = ev["rollout_id"]
                if rid in self.finished:
                    self.spans.append(f"rollout {rid} finished twice (seq {seq})")
                self.finished[rid] = (seq, ev.get("outcome"), committed_gen)
                adm = self.admitted.get(rid)
                if adm is None:
                    self.spans.append(f"rollout {rid} finished at seq {seq} but never admitted")
                elif adm[1] != committed_gen:
                    self.spans.append(f"rollout {rid} admitted under generation {adm[1]} finished "
                                      f"at seq {seq} under generation {committed_gen}")
            elif t == "VersionPublished":
                committed_gen = ev["version"]["generation"]
                self.published[ev.get("update_id", "")] = ev["version"]["label"]
            elif t == "UpdateEnded":
                self.update_ended[ev["update_id"]] = ev["outcome"]
        self.lifecycle = report.get("state", {}).get("lifecycle")
        self.taint = report.get("state", {}).get("taint")


def read_journal(rc_bin: str, journal: pathlib.Path, deadline_s: float) -> JournalView:
    p = subprocess.run([rc_bin, "replay", str(journal), "--events", "--json"],
                       capture_output=True, timeout=deadline_s)
    out = p.stdout.decode(errors="replace").splitlines()
    if p.returncode != 0 or not out:
        raise Failure(f"replay {journal} exit {p.returncode}: "
                      f"{p.stderr.decode(errors='replace')[-800:]} {out[-1][:800] if out else ''}")
    recs = [json.loads(x) for x in out[:-1]]
    report = json.loads(out[-1])
    if not report.get("ok"):
        raise Failure(f"replay verification not OK on {journal}: {out[-1][:1500]}")
    if p.stderr.strip():
        raise Failure(f"replay printed on stderr: {p.stderr.decode(errors='replace')[-800:]}")
    return JournalView(recs, report)


def run_audit(rc_bin: str, journal: pathlib.Path, head: str | None, deadline_s: float):
    cmd = [rc_bin, "audit", str(journal)] + (["--expect-head", head] if head else [])
    p = subprocess.run(cmd, capture_output=True, timeout=deadline_s)
    return p.returncode, p.stdout.decode(errors="replace")


class Checker:
    """Checks every answer of one journal (epoch) against a JournalView."""

    def __init__(self):
        self.failures = []

    def fail(self, msg):
        self.failures.append(msg)

    def check_answers(self, view: JournalView, answers: list, tally: collections.Counter | None):
        for s in view.spans:
            self.fail("journal: " + s)
        heads = []
        for a in answers:
            k = a["kind"]
            head = a.get("hdr_head") or a.get("head")
            if head:
                heads.append(head)
                seq_s, _, hx = head.partition(":")
                if view.hash.get(int(seq_s)) != hx:
                    self.fail(f"{k} {a.get('rid') or a.get('uid')}: acknowledged head {head} not in "
                              f"the journal (it has {view.hash.get(int(seq_s))})")
            if k in ("proxy", "proxy_stream"):
                if a["status"] != 200:
                    if tally is not None:
                        tally[f"{k} {a['status']} {a.get('err_type') or ''}".strip()] += 1
                    continue
                if tally is not None:
                    tally[f"{k} 200"] += 1
                rid = a["rid"]
                if a["hdr_rid"] != rid:
                    self.fail(f"{k} {rid}: X-RolloutCore-Rollout-Id {a['hdr_rid']}")
                adm = view.admitted.get(rid)
                if adm is None:
                    self.fail(f"{k} {rid}: answered 200 (generation {a['hdr_gen']}) but no "
                              f"RolloutAdmitted in the journal")
                    continue
                if str(adm[1]) != a["hdr_gen"] or adm[2] != a["hdr_label"]:
                    self.fail(f"{k} {rid}: headers say generation {a['hdr_gen']} '{a['hdr_label']}'"
                              f", journal admitted it under {adm[1]} '{adm[2]}'")
                if a["hdr_seq"] and int(a["hdr_seq"]) != adm[0]:
                    self.fail(f"{k} {rid}: X-RolloutCore-Admission-Seq {a['hdr_seq']} != {adm[0]}")
                fin = view.finished.get(rid)
                if tally is not None:
                    tally[f"{k} 200 journal finish={fin[1] if fin else 'none'}"] += 1
                if fin and fin[2] != int(a["hdr_gen"]):
                    self.fail(f"{k} {rid}: served as generation {a['hdr_gen']}, finished under "
                              f"{fin[2]}")
            elif k == "admit":
                if tally is not None:
                    tally[f"admit {a['status']}"] += 1
                if a["status"] != 201:
                    continue
                b = a["body"]
                adm = view.admitted.get(a["rid"])
                if adm is None:
                    self.fail(f"admit {a['rid']}: answered 201 but no RolloutAdmitted")
                    continue
                if (adm[0], adm[1], adm[2]) != (b["admission_seq"], b["version"]["generation"],
                                                b["version"]["label"]):
                    self.fail(f"admit {a['rid']}: answer {b['admission_seq']} {b['version']} vs "
                              f"journal {adm}")
                fin = view.finished.get(a["rid"])
                if fin and fin[2] != b["version"]["generation"]:
                    self.fail(f"admit {a['rid']}: admitted under generation "
                              f"{b['version']['generation']}, finished under {fin[2]}")
            elif k == "finish":
                if tally is not None:
                    tally[f"finish {a['status']}"] += 1
                if a["status"] != 200:
                    continue
                fin = view.finished.get(a["rid"])
                if fin is None:
                    self.fail(f"finish {a['rid']}: answered 200 but no RolloutFinished")
                elif fin[1] != a["sent_outcome"] or a["body"].get("outcome") != a["sent_outcome"]:
                    self.fail(f"finish {a['rid']}: sent {a['sent_outcome']}, answered "
                              f"{a['body'].get('outcome')}, journal {fin[1]}")
            elif k == "renew":
                if tally is not None:
                    tally[f"renew {a['status']}"] += 1
            elif k == "update":
                o = a.get("outcome")
                if tally is not None:
                    tally[f"update answer {a['status']} {o or a.get('err_type') or ''}".strip()] += 1
                if o in ("committed", "refused", "tainted"):
                    jo = view.update_ended.get(a["uid"])
                    if jo != o:
                        self.fail(f"update {a['uid']}: answered {o} (replayed={a.get('replayed')}),"
                                  f" journal UpdateEnded {jo}")
                    if o == "committed" and view.published.get(a["uid"]) != a["label"]:
                        self.fail(f"update {a['uid']}: committed but VersionPublished "
                                  f"{view.published.get(a['uid'])}")
                    if o == "committed" and a["bad"]:
                        self.fail(f"update {a['uid']}: committed with a wrong manifest digest")
        return heads


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------
class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.procs = Procs()
        self.w = World()
        self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="rc-soak-"))
        os.chmod(self.tmp, 0o700)
        self.bin = self.tmp / "bin"
        self.bin.mkdir()
        build = pathlib.Path(args.build).resolve()
        # Copies: a concurrent rebuild cannot swap the binaries under a long campaign.
        try:
            shutil.copy2(build / "cli" / "rolloutcore", self.bin / "rolloutcore")
            shutil.copy2(build / "fixtures" / "vllm-double", self.bin / "vllm-double")
        except OSError:
            shutil.rmtree(self.tmp, ignore_errors=True)  # e.g. a rebuild is relinking them
            raise
        self.rc = str(self.bin / "rolloutcore")
        self.stats = collections.Counter()
        self.findings = collections.Counter()
        self.tally = collections.Counter()
        self.checker = Checker()
        self.epoch = 0
        self.epoch_dir = None
        self.serve = None
        self.engine = None
        self.engine_port = None
        self.epoch_kills = 0
        self.views = {}            # epoch -> final JournalView
        self.epoch_audit = {}      # epoch -> expected-lifecycle notes
        self.start_time = now()

    # ---- processes ----
    def start_engine(self, port=0):
        cmd = [str(self.bin / "vllm-double"), "--host", HOST, "--port", str(port),
               "--token-delay-ms", "1", "--worker-extension-cls",
               "rolloutcore.vllm_ext.RolloutCoreWorkerExtension"]
        end = now() + 10
        while True:
            self.engine = Proc(f"engine-{self.epoch}", cmd, self.epoch_dir, self.procs)
            try:
                addr = self.engine.start(5)
                break
            except Failure:
                if now() > end:  # the port may linger a moment after a SIGKILL
                    raise
                time.sleep(0.1)
        self.engine_port = int(addr.rsplit(":", 1)[1])
        return addr

    def start_serve(self):
        cmd = [self.rc, "serve", "--engine-url", f"http://{HOST}:{self.engine_port}",
               "--journal", str(self.epoch_dir / "journal"), "--host", HOST, "--port", "0",
               "--auth-token", TOKEN, "--initial-source", SOURCE,
               "--initial-checkpoint", "ckpt-0", "--initial-run", "soak", "--initial-step", "0",
               "--admit-wait-ms", "1500", "--retry-after-s", "1", "--drain-timeout-ms", "1000",
               "--rollout-lease-ms", "3000", "--engine-monitor-interval-ms", "50",
               "--engine-startup-timeout-ms", "5000", "--request-timeout-ms", "10000",
               "--shutdown-grace-ms", "1000"]
        self.serve = Proc(f"serve-{self.epoch}", cmd, self.epoch_dir, self.procs)
        # A restart that recovers an interrupted drain with leased rollouts does not listen
        # before the runner's await-rollouts bound (10 s) + drain_timeout_ms: see RESULTS.md.
        t0 = now()
        addr = self.serve.start(self.args.deadline_s + 15)
        ms = int((now() - t0) * 1000)
        self.stats["serve_starts"] += 1
        self.stats["serve_start_ms_max"] = max(self.stats["serve_start_ms_max"], ms)
        if ms > 5000:
            self.stats["serve_starts_over_5s"] += 1
            self.finding("a restart recovering an interrupted drain with leased rollouts did not "
                         "listen for over 5 s (await-rollouts bound + drain_timeout_ms)")
        return "http://" + addr

    def wait_ready(self, url) -> dict:
        """Waits (bounded) for /readyz; returns /v1/state. TAINTED is an answer, not a wait."""
        c = rolloutcore.Client(url, TOKEN, timeout_s=5)
        end = now() + self.args.deadline_s
        last = None
        while now() < end:
            if not self.serve.alive():
                raise Failure(f"serve exited {self.serve.proc.returncode} while starting: "
                              f"{self.serve.stderr_tail()}")
            try:
                r = c.ready()
                if r.get("ready"):
                    return c.state()
                last = r
                if r.get("lifecycle") == "TAINTED":
                    return c.state()
            except NET_ERRORS as e:
                last = repr(e)
            time.sleep(0.01)
        raise Failure(f"serve not ready within {self.args.deadline_s} s: {last}")

    def new_epoch(self):
        self.epoch += 1
        self.epoch_dir = self.tmp / f"e{self.epoch}"
        self.epoch_dir.mkdir()
        self.epoch_kills = 0
        self.start_engine(0)
        url = self.start_serve()
        st = self.wait_ready(url)
        if st["lifecycle"] != "READY":
            raise Failure(f"fresh journal not READY: {st}")
        if self.epoch == 1:
            self.digest = rolloutcore.Client(url, TOKEN).manifest_digest(SOURCE)
        self.stats["journals"] += 1
        self.w.set_endpoint(url, self.epoch)

    # ---- checks ----
    def answers_of(self, epoch):
        with self.w.lock:
            return [a for a in self.w.answers if a["epoch"] == epoch]

    def check_journal(self, final=False) -> JournalView:
        """Serve is dead here: the journal is what the crash left."""
        t0 = now()
        journal = self.epoch_dir / "journal"
        view = read_journal(self.rc, journal, self.args.deadline_s * 3)
        answers = self.answers_of(self.epoch)
        heads = self.checker.check_answers(view, answers, None)
        # `audit --expect-head` on the highest head received and on one other, picked at random.
        picks = []
        if heads:
            picks.append(max(heads, key=lambda h: int(h.split(":")[0])))
            picks.append(self.rng.choice(heads))
        for head in picks or [None]:
            rc, out = run_audit(self.rc, journal, head, self.args.deadline_s * 3)
            self.stats[f"audit_exit_{rc}"] += 1
            want = 1 if view.lifecycle == "TAINTED" else 0
            if rc != want:
                self.checker.fail(f"epoch {self.epoch}: audit --expect-head {head} exit {rc} "
                                  f"(lifecycle {view.lifecycle}, expected {want}): "
                                  f"{out[-1500:]}")
            if head:
                self.stats["heads_audited"] += 1
        self.stats["checks"] += 1
        self.stats["check_seconds_x1000"] += int((now() - t0) * 1000)
        if final:
            self.views[self.epoch] = view
        return view

    def end_epoch(self, reason):
        """Stops this journal's serve + engine, checks the journal a last time."""
        self.w.set_endpoint(None, self.epoch)
        if self.serve:
            self.serve.kill()
        view = self.check_journal(final=True)
        if self.engine:
            self.engine.kill()
        self.stats[f"journal_end_{reason}"] += 1
        self.stats[f"journal_records"] += len(view.hash)
        return view

    def finding(self, msg):
        """A known product bug seen again: counted and reported, a failure only with --strict."""
        self.findings[msg] += 1
        if self.args.strict:
            self.fail_now("(strict) " + msg)

    def fail_now(self, msg):
        self.checker.fail(msg)
        raise Failure(msg)

    # ---- one iteration ----
    def kill_serve_once(self):
        a = self.args
        biased = self.rng.random() < a.p_update_bias
        if biased:
            self.w.update_sent.clear()
            sent = self.w.update_sent.wait(timeout=2.0)
            time.sleep(self.rng.uniform(0.0, 0.03))
            self.stats["kills_biased_into_update" if sent else "kills_bias_timed_out"] += 1
        else:
            time.sleep(self.rng.uniform(a.window_min_s, a.window_max_s))
        if not self.serve.alive():
            self.fail_now(f"serve exited {self.serve.proc.returncode} by itself: "
                          f"{self.serve.stderr_tail()}")
        self.w.set_endpoint(None, self.epoch)
        self.serve.kill()
        self.stats["serve_sigkills"] += 1
        self.epoch_kills += 1

    def restart_and_recover(self):
        t0 = now()
        url = self.start_serve()
        self.stats["ms_restart_listening"] += int((now() - t0) * 1000)
        st = self.wait_ready(url)
        self.stats["ms_restart_ready"] += int((now() - t0) * 1000)
        self.stats["restarts"] += 1
        if st["lifecycle"] == "TAINTED":
            cause = (st.get("taint") or {}).get("cause", "?")
            self.stats[f"tainted_after_restart_{cause}"] += 1
            return False
        self.w.set_endpoint(url, self.epoch)
        return True

    def replace_engine(self):
        """Kills the engine double and starts another on the same port; serve must notice."""
        a = self.args
        serve_up = self.rng.random() < 0.5
        time.sleep(self.rng.uniform(a.window_min_s, a.window_max_s))
        port = self.engine_port
        if not serve_up:
            self.w.set_endpoint(None, self.epoch)
            self.serve.kill()
            self.stats["serve_sigkills"] += 1
        self.engine.kill()
        self.stats["engine_sigkills"] += 1
        self.start_engine(port)
        if serve_up:
            url, _ = self.w.endpoint()
            c = rolloutcore.Client(url, TOKEN, timeout_s=5)
            end = now() + a.deadline_s
            st = None
            while now() < end:
                try:
                    st = c.state()
                    if st["lifecycle"] == "TAINTED":
                        break
                except NET_ERRORS:
                    pass
                time.sleep(0.02)
            if not st or st["lifecycle"] != "TAINTED":
                self.fail_now(f"engine replaced under a running serve: not TAINTED within "
                              f"{a.deadline_s} s: {st}")
            self.stats["engine_replaced_detected_live"] += 1
            cause = (st.get("taint") or {}).get("cause", "?")
            self.stats[f"taint_cause_{cause}"] += 1
            self.w.set_endpoint(None, self.epoch)
            self.serve.kill()
            self.stats["serve_sigkills"] += 1
        else:
            url = self.start_serve()
            st = self.wait_ready(url)
            self.stats["restarts"] += 1
            if st["lifecycle"] != "TAINTED":
                # Known product bug (RESULTS.md, finding 2): a restart that recovers an
                # interrupted drain resumes to READY without re-probing the engine, so /readyz
                # says ready and admits until the engine monitor's next probe taints it.
                c = rolloutcore.Client(url, TOKEN, timeout_s=5)
                end = now() + a.deadline_s
                while now() < end and st["lifecycle"] != "TAINTED":
                    time.sleep(0.01)
                    try:
                        st = c.state()
                    except NET_ERRORS:
                        pass
                if st["lifecycle"] != "TAINTED":
                    self.fail_now(f"engine replaced while serve was down: {st['lifecycle']} "
                                  f"{a.deadline_s} s after the restart, not TAINTED")
                self.finding("engine replaced while serve was down: the restart answered "
                             "/readyz ready before the monitor tainted it")
                self.stats["engine_replaced_detected_after_ready"] += 1
            else:
                self.stats["engine_replaced_detected_at_restart"] += 1
            cause = (st.get("taint") or {}).get("cause", "?")
            self.stats[f"taint_cause_{cause}"] += 1
        self.end_epoch("engine_replaced")

    def run(self):
        a = self.args
        threads = []
        deadline = self.start_time + a.max_minutes * 60
        try:
            self.new_epoch()
            for i in range(a.clients):
                threads.append(threading.Thread(target=client_thread, name=f"client-{i}",
                                                args=(self.w, i, a.seed * 1000 + i, 0.4, a.p_explicit),
                                                daemon=True))
            threads.append(threading.Thread(target=trainer_thread, name="trainer",
                                            args=(self.w, a.seed * 1000 + 999, self.digest, 0.2),
                                            daemon=True))
            for t in threads:
                t.start()
            last_print = now()
            while self.stats["serve_sigkills"] < a.kills:
                if now() > deadline:
                    self.fail_now(f"time budget of {a.max_minutes} min spent after "
                                  f"{self.stats['serve_sigkills']} kills")
                if self.w.thread_errors:
                    self.fail_now("traffic thread crashed: " + self.w.thread_errors[0])
                if self.rng.random() < a.p_engine_kill:
                    self.replace_engine()
                    self.new_epoch()
                    continue
                self.kill_serve_once()
                checked = False
                if self.stats["serve_sigkills"] % a.check_every == 0:
                    self.check_journal()
                    checked = True
                if self.checker.failures:
                    raise Failure(self.checker.failures[0])
                if not self.restart_and_recover():
                    self.end_epoch("tainted_at_restart")
                    self.new_epoch()
                elif self.epoch_kills >= a.kills_per_journal:
                    self.end_epoch("rotation")
                    self.new_epoch()
                if now() - last_print > 10:
                    last_print = now()
                    print(f"[{now() - self.start_time:6.0f} s] kills {self.stats['serve_sigkills']}"
                          f" restarts {self.stats['restarts']} journals {self.stats['journals']} "
                          f"answers {len(self.w.answers)} failures {len(self.checker.failures)}",
                          flush=True)
            # Orderly end: stop traffic, then one last kill and check.
            self.w.stop.set()
            self.w.set_endpoint(None, self.epoch)
            for t in threads:
                t.join(timeout=30)
                if t.is_alive():
                    self.checker.fail(f"thread {t.name} did not stop within 30 s")
            self.end_epoch("end")
            self.final_recheck()
        except Failure as e:
            if str(e) not in self.checker.failures:
                self.checker.failures.append(str(e))
        finally:
            self.w.stop.set()
            self.procs.kill_all()
        return self.report()

    def final_recheck(self):
        """Every answer of every journal against that journal's final state (late answers too)."""
        self.tally.clear()
        for epoch, view in self.views.items():
            self.checker.check_answers(view, self.answers_of(epoch), self.tally)
            for uid, outcome in view.update_ended.items():
                self.stats[f"updates_journal_{outcome}"] += 1
            self.stats["rollouts_admitted_in_journals"] += len(view.admitted)
            for rid, fin in view.finished.items():
                self.stats[f"rollouts_finished_{fin[1]}"] += 1

    def report(self):
        wall = now() - self.start_time
        with self.w.lock:
            n_answers = len(self.w.answers)
            counts = dict(self.w.counts)
        doc = {"seed": self.args.seed, "kills_requested": self.args.kills,
               "wall_seconds": round(wall, 1), "answers_recorded": n_answers,
               "stats": dict(sorted(self.stats.items())),
               "answers_by_kind": dict(sorted(self.tally.items())),
               "network_errors": dict(sorted(counts.items())),
               "known_product_findings": dict(self.findings),
               "failures": self.checker.failures[:50], "failure_count": len(self.checker.failures)}
        return doc


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=str(ROOT / "build"), help="build dir with cli/rolloutcore "
                    "and fixtures/vllm-double (copied to the temp dir before use)")
    ap.add_argument("--kills", type=int, default=1000, help="SIGKILLs of serve to perform")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--clients", type=int, default=4, help="client threads")
    ap.add_argument("--check-every", type=int, default=1,
                    help="replay+audit check after every N kills (and at each journal's end)")
    ap.add_argument("--kills-per-journal", type=int, default=50,
                    help="start a fresh journal after this many kills (bounds the check's cost)")
    ap.add_argument("--p-explicit", type=float, default=0.1,
                    help="fraction of client requests that are explicit (leased) rollouts")
    ap.add_argument("--p-update-bias", type=float, default=0.08,
                    help="fraction of kills aimed just after an update was sent")
    ap.add_argument("--p-engine-kill", type=float, default=0.03,
                    help="fraction of iterations that kill and restart the engine double")
    ap.add_argument("--window-min-s", type=float, default=0.03)
    ap.add_argument("--window-max-s", type=float, default=0.35)
    ap.add_argument("--deadline-s", type=float, default=15.0, help="bound of every single wait")
    ap.add_argument("--max-minutes", type=float, default=50.0, help="stop (as a failure) after this")
    ap.add_argument("--json-out", help="write the figures here as JSON")
    ap.add_argument("--strict", action="store_true",
                    help="count the known product findings (RESULTS.md) as failures")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir even on success")
    args = ap.parse_args()

    def on_term(signum, frame):  # SIGTERM: clean up exactly like Ctrl-C
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)

    soak = Soak(args)
    print(f"crash loop: {args.kills} kills, seed {args.seed}, temp dir {soak.tmp}", flush=True)
    keep = args.keep
    try:
        doc = soak.run()
    except KeyboardInterrupt:
        soak.w.stop.set()
        soak.procs.kill_all()
        print("interrupted: processes killed", file=sys.stderr)
        shutil.rmtree(soak.tmp, ignore_errors=True)
        return 130
    doc["command"] = " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    print(json.dumps(doc, indent=2))
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    if doc["failure_count"]:
        keep = True
        print(f"FAILED: {doc['failure_count']} failure(s); journals and logs kept in {soak.tmp}",
              file=sys.stderr)
    if keep:
        print(f"kept {soak.tmp}", file=sys.stderr)
    else:
        shutil.rmtree(soak.tmp, ignore_errors=True)
    return 1 if doc["failure_count"] else 0


if __name__ == "__main__":
    sys.exit(main())
