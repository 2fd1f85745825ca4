#!/usr/bin/env python3
"""`rolloutcore serve` in front of a fleet with `--transfer nccl`: a communicator per engine.

Needs 2 GPUs: the sender on GPU 0, two receiver doubles (receiver_double.py) on GPU 1, each in a
communicator of its own (NCCL refuses two ranks of one communicator on one GPU). Checks, one JSON
object per line:
  F1  serve starts: both members bootstrap and rendezvous (two "NCCL sender ready" lines)
  F2  an `all` update: 200, both members committed, both receivers got every byte (seeded check)
  F3  a `rolling` update: 200, both committed, never both updating at once
  F4  one receiver killed: the next `all` update ends partial (207): the other commits, the dead
      one is not admitting; the fleet's state says so
  F5  SIGTERM: clean exit; `rolloutcore replay` verifies the journal
Usage: fleet_nccl.py RC_BINARY WORKDIR   (LD_LIBRARY_PATH as for run_gpu.sh)
"""
import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
TOKEN = "fleet-gpu"
SEED = 11


def out(d):
    print(json.dumps(d), flush=True)


def call(method, url, body=None, timeout=300):
    req = urllib.request.Request(url, method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": "Bearer " + TOKEN})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def write_safetensors(path, sizes):
    # Float32 tensors whose bytes the receiver checks against its seeded generator.
    import torch
    sys.path.insert(0, HERE)
    from receiver_double import expected_bytes
    header, blobs, offset = {}, [], 0
    for i, n in enumerate(sizes):
        b = expected_bytes(SEED, i, n * 4, "cpu").cpu().numpy().tobytes()
        header[f"w{i}"] = {"dtype": "F32", "shape": [n], "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)


def start_receiver(port, workdir, name):
    log = open(os.path.join(workdir, f"rx-{name}.log"), "w")
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "receiver_double.py"), "--port",
                          str(port), "--device", "1", "--version", "0.30.0"], stdout=log,
                         stderr=subprocess.STDOUT)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/version", timeout=1)
            call("POST", f"http://127.0.0.1:{port}/test/config", {"seed": SEED})
            return p
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"receiver {name} did not start")


def start_serve(rc, workdir, urls, source):
    args = [rc, "serve", "--journal", os.path.join(workdir, "journal"), "--port", "0",
            "--auth-token", TOKEN, "--initial-source", source, "--transfer", "nccl",
            "--rendezvous", "127.0.0.1:0", "--cuda-device", "0",
            "--nccl-init-timeout-ms", "120000", "--engine-startup-timeout-ms", "120000"]
    for name, url in urls.items():
        args += ["--fleet-engine", f"{name}={url}"]
    log = open(os.path.join(workdir, "serve.log"), "w")
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True)
    for line in p.stdout:
        if line.startswith("listening on "):
            return p, "http://127.0.0.1:" + line.split(":")[-1].strip()
    raise RuntimeError("serve exited before listening; see serve.log")


def received(port):
    _, r = call("GET", f"http://127.0.0.1:{port}/test/report")
    return r


def fleet_update(base, uid, label, mode, digest, source):
    t0 = time.monotonic()
    code, body = call("POST", base + "/v1/fleet/updates",
                      {"update_id": uid, "target_label": label, "mode": mode,
                       "identity": {"manifest_digest": digest}, "source": source})
    return code, body, time.monotonic() - t0


def main():
    rc, workdir = sys.argv[1], sys.argv[2]
    os.makedirs(workdir, exist_ok=True)
    source = "safetensors:" + os.path.join(workdir, "w.safetensors")
    write_safetensors(source.split(":", 1)[1], [1 << 20, 4 << 20, 3])
    ports = {"a": 18100, "b": 18101}
    rx = {n: start_receiver(p, workdir, n) for n, p in ports.items()}
    serve, base = start_serve(rc, workdir, {n: f"http://127.0.0.1:{p}" for n, p in ports.items()},
                              source)
    ready = open(os.path.join(workdir, "serve.log")).read().count("NCCL sender ready")
    out({"check": "F1", "ok": ready == 2, "senders_ready": ready})
    _, m = call("GET", base + "/v1/manifest?source=" + source)
    digest = m["manifest_digest"]
    code, body, s = fleet_update(base, "u-all", "rc-1", "all", digest, source)
    got = {n: received(p) for n, p in ports.items()}
    ok = code == 200 and body.get("committed") == 2 and all(
        r.get("verified") and not r.get("verified_bad") for r in got.values())
    out({"check": "F2", "ok": ok, "http": code, "wall_s": round(s, 3), "end": body,
         "receivers": got})
    code, body, s = fleet_update(base, "u-rolling", "rc-2", "rolling", digest, source)
    out({"check": "F3", "ok": code == 200 and body.get("committed") == 2, "http": code,
         "wall_s": round(s, 3), "end": body})
    rx["b"].send_signal(signal.SIGKILL)
    rx["b"].wait()
    code, body, s = fleet_update(base, "u-after-kill", "rc-3", "all", digest, source)
    _, state = call("GET", base + "/v1/state")
    engines = state.get("engines", {})
    ok = (code == 207 and body.get("committed") == 1 and
          engines.get("a", {}).get("admitting") is True and
          engines.get("b", {}).get("admitting") is False)
    out({"check": "F4", "ok": ok, "http": code, "wall_s": round(s, 3), "end": body,
         "state": engines})
    serve.send_signal(signal.SIGTERM)
    exit_code = serve.wait(timeout=60)
    replay = subprocess.run([rc, "replay", os.path.join(workdir, "journal")], capture_output=True,
                            text=True)
    out({"check": "F5", "ok": exit_code == 0 and replay.returncode in (0, 1) and
         "verification: OK" in replay.stdout, "serve_exit": exit_code,
         "replay_exit": replay.returncode, "replay_tail": replay.stdout[-400:]})
    rx["a"].kill()


if __name__ == "__main__":
    main()
