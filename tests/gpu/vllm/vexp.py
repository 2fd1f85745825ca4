#!/usr/bin/env python3
"""Client side of the real-vLLM experiments (tests/gpu/vllm/run_vllm.sh). Talks HTTP to a real
`vllm serve` and prints one JSON object per line. Subcommands:
  ready URL TIMEOUT_S        poll GET /health until 200; prints seconds waited
  greedy URL OUT.json        greedy completions (temperature 0, ignore_eos) of fixed prompts
  same A.json B.json LABEL   compares two greedy files token id for token id
  e1 URL                     control plane only: drain a 256-token request with pause mode=wait
                             (clear_cache=false), 3 resets, label, validate while paused, resume;
                             greedy ids before == after. The label goes through GET /weight_info
                             or, on vLLM 0.25.x (404 there), RolloutCore's worker extension over
                             POST /collective_rpc.
  label URL                  the engine's label, by either route
  reset URL                  POST /reset_prefix_cache (status and body as the engine answers)
  differ A.json B.json LABEL  two `prefix` outputs: whether their texts/ids differ
  phases LOG TOTAL_S         restart-to-ready phase split from a vLLM log: weight loading, model
                             loading, engine init (profile + KV cache + warm-up) as vLLM reports
                             them; the rest (process start, imports, API server) = TOTAL - those
  prefix URL TAG [OUT.json]  one request of the fixed long prompt; vLLM's own /metrics prefix-cache
                             counters before/after (the delta = this request's hits)
  live URL SECONDS OUT.json  streams requests back to back for SECONDS (rollout during an update)
"""
import json, os, sys, threading, time
import requests

PROMPTS = ["policy weight update drain cache token", "alpha beta gamma delta rollout engine",
           "trainer version label prefix resume pause 17"]
MODEL = os.environ.get("VEXP_MODEL", "m")  # vLLM is started with --served-model-name m
LONG = " ".join(["reward rollout engine trainer version label prefix cache"] * 40)


def out(d):
    print(json.dumps(d), flush=True)


def complete(url, prompt, n, timeout=120):
    r = requests.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": n,
                      "temperature": 0, "ignore_eos": True, "return_token_ids": True}, timeout=timeout)
    r.raise_for_status()
    c = r.json()["choices"][0]
    return {"text": c.get("text"), "token_ids": c.get("token_ids"), "finish_reason": c.get("finish_reason"),
            "usage": r.json().get("usage")}


def label_get(url):
    r = requests.get(url + "/weight_info", timeout=10)
    if r.status_code != 404:
        return {"route": "/weight_info", "status": r.status_code, "label": r.json().get("weight_version")}
    r = requests.post(url + "/collective_rpc", json={"method": "rc_weight_info"}, timeout=10)
    res = r.json().get("results") if r.status_code == 200 else None
    return {"route": "/collective_rpc", "status": r.status_code, "results": res,
            "label": res[0]["weight_version"] if res else None, "raw": None if res else r.text[:200]}


def label_set(url, label):
    r = requests.post(url + "/update_weight_version", json={"new_version": label}, timeout=10)
    if r.status_code != 404:
        return {"route": "/update_weight_version", "status": r.status_code, "body": r.text[:120]}
    r = requests.post(url + "/collective_rpc", json={"method": "rc_set_weight_version", "args": [label]},
                      timeout=10)
    return {"route": "/collective_rpc", "status": r.status_code, "body": r.text[:200]}


def greedy(url, n=48):
    return [complete(url, p, n) for p in PROMPTS]


def metrics(url):
    m = {}
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:prefix_cache") or line.startswith("vllm:num_requests"):
            k, v = line.rsplit(" ", 1)
            m[k.split("{")[0]] = m.get(k.split("{")[0], 0) + float(v)
    return m


def main():
    cmd, url = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
    if cmd == "ready":
        t0, lim = time.time(), float(sys.argv[3])
        pid = int(sys.argv[4]) if len(sys.argv) > 4 else 0
        while time.time() - t0 < lim:
            if pid:
                try:
                    os.kill(pid, 0)
                except OSError:
                    out({"ready": False, "engine_exited": True, "waited_s": round(time.time() - t0, 3)}); return 1
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    out({"ready": True, "waited_s": round(time.time() - t0, 3)}); return 0
            except Exception:
                pass
            time.sleep(0.1)
        out({"ready": False, "waited_s": lim}); return 1
    if cmd == "greedy":
        g = greedy(url)
        json.dump(g, open(sys.argv[3], "w"))
        out({"greedy": sys.argv[3], "first_ids": g[0]["token_ids"][:12], "first_text": g[0]["text"][:60]}); return 0
    if cmd == "same":
        a, b = json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
        same = [x["token_ids"] == y["token_ids"] for x, y in zip(a, b)]
        out({"check": sys.argv[4], "identical_per_prompt": same, "pass": all(same)}); return 0
    if cmd == "e1":
        before = greedy(url)
        res = {}
        def long_req():
            t = time.time()
            try:
                res["r"] = complete(url, "policy drain", 256)
            except Exception as e:
                res["err"] = repr(e)
            res["done_at"] = time.time(); res["took"] = time.time() - t
        th = threading.Thread(target=long_req); th.start()
        time.sleep(0.05)
        t0 = time.time()
        p = requests.post(url + "/pause", params={"mode": "wait", "clear_cache": "false"}, timeout=120)
        t_paused = time.time()
        th.join(120)
        steps = {"pause": [p.status_code, p.text[:80]], "pause_blocked_s": round(t_paused - t0, 4),
                 "long_request_finished_before_pause_returned": res.get("done_at", 1e18) <= t_paused + 0.01,
                 "long_request_tokens": (res.get("r") or {}).get("usage"), "long_request_err": res.get("err"),
                 "long_finish_reason": (res.get("r") or {}).get("finish_reason")}
        for route in ("/reset_prefix_cache", "/reset_encoder_cache", "/reset_mm_cache"):
            r = requests.post(url + route, timeout=10)
            steps[route] = [r.status_code, r.text[:80], r.headers.get("content-type")]
        steps["label_set"] = label_set(url, "e1-label")
        steps["label_while_paused"] = label_get(url)
        steps["is_paused"] = requests.get(url + "/is_paused", timeout=10).json()
        r = requests.post(url + "/resume", timeout=10); steps["resume"] = [r.status_code, r.text[:80]]
        steps["cycle_s"] = round(time.time() - t0, 4)
        after = greedy(url)
        same = [x["token_ids"] == y["token_ids"] for x, y in zip(before, after)]
        out({"check": "E1 control plane only on real vLLM", "steps": steps, "identical_per_prompt": same,
             "pass": all(same) and steps["long_request_finished_before_pause_returned"] and
                     (steps["long_request_tokens"] or {}).get("completion_tokens") == 256 and
                     steps["label_while_paused"].get("label") == "e1-label"}); return 0
    if cmd == "phases":
        import re
        text = open(sys.argv[2], errors="replace").read()
        def grab(pat):
            m = re.search(pat, text)
            return float(m.group(1)) if m else None
        total = float(sys.argv[3])
        ph = {"weights_load_s": grab(r"Loading weights took ([0-9.]+) seconds"),
              "model_load_s": grab(r"Model loading took [0-9.]+ GiB and ([0-9.]+) seconds"),
              "engine_init_s": grab(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s")}
        known = sum(v for k, v in ph.items() if v is not None and k != "weights_load_s")
        out({"restart_phases": sys.argv[2], "total_s": total, **ph,
             "process_start_imports_api_s": round(total - known, 3)}); return 0
    if cmd == "label":
        out({"label": label_get(url)}); return 0
    if cmd == "reset":
        r = requests.post(url + "/reset_prefix_cache", timeout=10)
        out({"reset_prefix_cache": [r.status_code, r.text[:80], r.headers.get("content-type")]}); return 0
    if cmd == "differ":
        a, b = json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
        out({"check": sys.argv[4], "a_text": a["text"][:40], "b_text": b["text"][:40],
             "ids_differ": a["ids"] != b["ids"]}); return 0
    if cmd == "prefix":
        m0 = metrics(url)
        r = complete(url, LONG, 8)
        m1 = metrics(url)
        d = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1 if k.startswith("vllm:prefix_cache")}
        res = {"prefix": sys.argv[3], "metrics_delta": d, "text": r["text"], "ids": r["token_ids"],
               "usage": r["usage"]}
        if len(sys.argv) > 4:
            json.dump(res, open(sys.argv[4], "w"))
        out(res); return 0
    if cmd == "live":
        dur, res = float(sys.argv[3]), []
        t_end = time.time() + dur
        while time.time() < t_end:
            t = time.time()
            try:
                r = complete(url, PROMPTS[len(res) % 3], 32, timeout=60)
                res.append({"t0": t, "t1": time.time(), "ok": True, "n": len(r["token_ids"] or []),
                            "ids": r["token_ids"][:8]})
            except Exception as e:
                res.append({"t0": t, "t1": time.time(), "ok": False, "err": repr(e)[:200]})
        json.dump(res, open(sys.argv[4], "w"))
        out({"live_requests": len(res), "failed": sum(not r["ok"] for r in res),
             "max_latency_s": max(r["t1"] - r["t0"] for r in res) if res else None}); return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
