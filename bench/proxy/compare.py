#!/usr/bin/env python3
"""Side-by-side proxy benchmark: wrk against the vLLM double directly, through nginx, and through
`rolloutcore serve`, in one run on one machine. Prints a Markdown table (README.md explains it).

  bench/proxy/compare.py --build build
  bench/proxy/compare.py --rolloutcore PATH --vllm-double PATH --duration 10

Python 3 stdlib only; needs wrk and nginx (Debian: apt-get install wrk nginx-light).
"""
import argparse
import grp
import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import BenchError, log  # noqa: E402

NOFILE = 65536
PROMPT = "hello world"
MAX_TOKENS = 4


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_binary_args(p)
    p.add_argument("--nginx", default="/usr/sbin/nginx", metavar="PATH", help="nginx binary (%(default)s)")
    p.add_argument("--wrk", default="wrk", metavar="PATH", help="wrk binary (%(default)s, from PATH)")
    p.add_argument("--duration", type=int, default=10, metavar="S", help="seconds per cell (%(default)s)")
    p.add_argument("--connections", default="16,256", metavar="N,N",
                   help="wrk connection counts, comma-separated (%(default)s)")
    p.add_argument("--threads", type=int, default=2, metavar="N", help="wrk threads (%(default)s)")
    p.add_argument("--wrk-timeout", type=int, default=10, metavar="S",
                   help="wrk's per-request timeout; slower answers count as timeout errors (%(default)s)")
    p.add_argument("--paths", default="direct,nginx,serve", metavar="LIST",
                   help="which paths to drive, comma-separated from direct,nginx,serve (%(default)s)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="nginx worker processes, and serve's event loops (io_threads) unless "
                        "--serve-set gives them (%(default)s)")
    p.add_argument("--json", metavar="FILE", help="also write the raw figures as JSON")
    p.add_argument("--idle-probe", type=int, default=3, metavar="S",
                   help="seconds to measure the double's CPU with the largest connection count held "
                        "idle (keep-alive) before the cells; 0 skips it (%(default)s)")
    a = p.parse_args()
    try:
        a.conns = [int(x) for x in a.connections.split(",") if x.strip()]
    except ValueError:
        p.error(f"--connections: comma-separated integers, got {a.connections!r}")
    if not a.conns or any(c < 1 for c in a.conns):
        p.error("--connections: at least one count, each >= 1")
    if a.duration < 1 or a.threads < 1 or a.wrk_timeout < 1:
        p.error("--duration, --threads and --wrk-timeout must be >= 1")
    if a.idle_probe < 0:
        p.error("--idle-probe must be >= 0")
    if any(c < a.threads for c in a.conns):
        p.error(f"wrk needs connections >= threads ({a.threads})")
    a.path_list = [x.strip() for x in a.paths.split(",") if x.strip()]
    bad = [x for x in a.path_list if x not in ("direct", "nginx", "serve")]
    if bad or not a.path_list:
        p.error(f"--paths: choose from direct,nginx,serve (got {a.paths!r})")
    return a


def check_tools(args):
    wrk = shutil.which(args.wrk)
    if not wrk:
        raise BenchError(f"wrk not found ({args.wrk}); on Debian: apt-get install wrk")
    args.wrk = wrk
    if "nginx" in args.path_list:
        if not (os.path.isfile(args.nginx) and os.access(args.nginx, os.X_OK)):
            raise BenchError(f"nginx not found at {args.nginx}; on Debian: apt-get install nginx-light "
                             "(or give --nginx PATH, or leave nginx out with --paths direct,serve)")


# ---------------------------------------------------------------- nginx

def nginx_config(lab_dir, nginx_bin, listen_port, upstream, nofile, workers):
    ngx = os.path.join(lab_dir, "nginx")
    os.makedirs(ngx)
    v = subprocess.run([nginx_bin, "-V"], capture_output=True, text=True, timeout=10)
    build = v.stdout + v.stderr
    temp_lines = [f"    client_body_temp_path {ngx}/client_body;",
                  f"    proxy_temp_path {ngx}/proxy;"]
    for mod in ("fastcgi", "uwsgi", "scgi"):  # each compiled-in module has a temp path to create
        if f"--without-http_{mod}_module" not in build:
            temp_lines.append(f"    {mod}_temp_path {ngx}/{mod};")
    user_line = ""
    if os.geteuid() == 0:
        # As root the worker switches to an unprivileged user; let it reach its temp dirs.
        try:
            pw = pwd.getpwnam("nobody")
        except KeyError:
            raise BenchError("running as root, nginx's worker needs the user 'nobody', which "
                             "does not exist here")
        group = grp.getgrgid(pw.pw_gid).gr_name
        user_line = f"user nobody {group};"
        os.chmod(lab_dir, 0o711)
        os.chown(ngx, pw.pw_uid, pw.pw_gid)
    conf = f"""# generated by bench/proxy/compare.py
daemon off;
master_process on;
worker_processes {workers};
worker_rlimit_nofile {nofile};
{user_line}
pid {ngx}/nginx.pid;
error_log {ngx}/error.log warn;
events {{
    worker_connections {max(1024, nofile // 2)};
}}
http {{
    access_log off;
{chr(10).join(temp_lines)}
    upstream double {{
        server {upstream};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{listen_port} backlog=4096;
        location / {{
            proxy_pass http://double;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""
    path = os.path.join(ngx, "nginx.conf")
    with open(path, "w") as f:
        f.write(conf)
    return ngx, path


def start_nginx(lab, nginx_bin, upstream, nofile, workers):
    port = harness.free_port()
    ngx, conf = nginx_config(lab.dir, nginx_bin, port, upstream, nofile, workers)
    t = subprocess.run([nginx_bin, "-t", "-p", ngx, "-e", f"{ngx}/error.log", "-c", conf],
                       capture_output=True, text=True, timeout=30)
    if t.returncode != 0:
        raise BenchError(f"nginx -t rejected the generated config {conf}:\n{t.stderr}")
    child = lab.spawn("nginx", [nginx_bin, "-p", ngx, "-e", f"{ngx}/error.log", "-c", conf],
                      nofile=nofile)
    end = time.monotonic() + harness.START_TIMEOUT_S
    while time.monotonic() < end:
        child.check_alive()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return child, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    raise BenchError(f"nginx did not accept on 127.0.0.1:{port} within "
                     f"{harness.START_TIMEOUT_S:.0f} s; see {ngx}/error.log")


# ---------------------------------------------------------------- wrk

LUA = """-- generated by bench/proxy/compare.py: POST /v1/completions, non-streaming
wrk.method = "POST"
wrk.path = "/v1/completions"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[{body}]==]
"""


def to_ms(value, unit):
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4, "h": 3.6e6}[unit]


def parse_wrk(text):
    r = {"requests": None, "rps": None, "p50_ms": None, "p99_ms": None, "non2xx": 0,
         "socket_errors": {}}
    m = re.search(r"^\s*(\d+) requests in ([\d.]+)(\w+),", text, re.M)
    if m:
        r["requests"] = int(m.group(1))
        r["seconds"] = to_ms(m.group(2), m.group(3)) / 1e3
    m = re.search(r"^Requests/sec:\s+([\d.]+)", text, re.M)
    if m:
        r["rps"] = float(m.group(1))
    for pct, key in (("50", "p50_ms"), ("99", "p99_ms")):
        m = re.search(rf"^\s*{pct}%\s+([\d.]+)(us|ms|s|m|h)\s*$", text, re.M)
        if m:
            r[key] = to_ms(m.group(1), m.group(2))
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    if m:
        r["non2xx"] = int(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    if m:
        r["socket_errors"] = {k: int(v) for k, v in zip(("connect", "read", "write", "timeout"),
                                                         m.groups()) if int(v)}
    return r


def errors_of(cell):
    errs = []
    if cell.get("wrk_rc", 0) != 0:
        errs.append(f"wrk exit {cell['wrk_rc']}")
    if cell["requests"] is None or cell["rps"] is None or cell["p99_ms"] is None:
        errs.append("wrk output not understood")
    elif cell["requests"] == 0:
        errs.append("0 requests")
    if cell["non2xx"]:
        errs.append(f"{cell['non2xx']} non-2xx")
    for k, v in cell["socket_errors"].items():
        errs.append(f"{v} {k} errors")
    return errs


# Serve's latency histograms whose means split a request's time: the journal's durable waits,
# the engine call, and what the proxy adds around it.
SPLIT = (("rolloutcore_journal_append_seconds", "journal append (admission or finish, each)"),
         ("rolloutcore_proxy_upstream_seconds", "engine call"),
         ("rolloutcore_proxy_added_seconds", "added by serve"),
         ("rolloutcore_proxy_request_seconds", "end to end"))


def histogram_sums(url, token):
    """{name: (sum_s, count)} of SPLIT's histograms from serve's /metrics."""
    st, body = harness.http("GET", url + "/metrics", headers={"Authorization": f"Bearer {token}"})
    if st != 200:
        raise BenchError(f"GET /metrics answered {st}: {body[:200]!r}")
    got = {}
    for line in body.decode("utf-8", "replace").splitlines():
        for name, _ in SPLIT:
            for suffix in ("_sum", "_count"):
                if line.startswith(name + suffix + " "):
                    got.setdefault(name, [0.0, 0.0])[suffix == "_count"] = float(line.split()[1])
    return got


def split_means_ms(before, after):
    out = {}
    for name, _ in SPLIT:
        if name in after and name in before:
            n = after[name][1] - before[name][1]
            out[name] = None if n <= 0 else (after[name][0] - before[name][0]) / n * 1e3
    return out


def run_cell(args, lab, url, conns, lua, middle_pids, double_pid, threads_pid=None, metrics=None):
    cmd = [args.wrk, f"-t{args.threads}", f"-c{conns}", f"-d{args.duration}s", "--latency",
           "--timeout", f"{args.wrk_timeout}s", "-s", lua, url + "/v1/completions"]
    mid0 = harness.cpu_seconds(middle_pids()) if middle_pids else None
    thr0 = harness.thread_cpu_by_name(threads_pid) if threads_pid else {}
    dbl0 = harness.cpu_seconds([double_pid])
    split0 = metrics() if metrics else None
    try:
        w = subprocess.run(cmd, capture_output=True, text=True, timeout=args.duration + 60)
    except subprocess.TimeoutExpired:
        raise BenchError(f"wrk did not finish within {args.duration + 60} s: {' '.join(cmd)}")
    mid1 = harness.cpu_seconds(middle_pids()) if middle_pids else None
    thr1 = harness.thread_cpu_by_name(threads_pid) if threads_pid else {}
    dbl1 = harness.cpu_seconds([double_pid])
    cell = parse_wrk(w.stdout)
    cell["split_ms"] = split_means_ms(split0, metrics()) if metrics else {}
    cell["wrk_rc"] = w.returncode
    cell["wrk_output"] = w.stdout + w.stderr
    n = cell["requests"] or 0
    cell["middle_cpu_s"] = None if mid0 is None else mid1 - mid0
    cell["double_cpu_s"] = dbl1 - dbl0
    cell["middle_us_per_req"] = None if mid0 is None or n == 0 else (mid1 - mid0) / n * 1e6
    cell["double_us_per_req"] = None if n == 0 else (dbl1 - dbl0) / n * 1e6
    cell["threads_us_per_req"] = {} if n == 0 else {
        name: (thr1[name] - thr0.get(name, 0)) / n * 1e6 for name in thr1}
    cell["errors"] = errors_of(cell)
    return cell


# ---------------------------------------------------------------- report

def fmt_ms(v):
    if v is None:
        return "—"
    return f"{v * 1e3:.0f} µs" if v < 1 else f"{v:.2f} ms" if v < 100 else f"{v:.0f} ms"


def fmt_num(v, nd=0):
    return "—" if v is None else f"{v:,.{nd}f}"


def table(args, results):
    labels = {"direct": "direct → double", "nginx": "nginx → double", "serve": "serve → double"}
    middle = {"direct": "—", "nginx": "nginx (master+worker)", "serve": "serve"}
    cs = args.conns
    head = ["path"]
    for c in cs:
        head += [f"{c} conns req/s", f"{c} conns p99"]
    head += [f"middle CPU µs/req ({' / '.join(map(str, cs))})",
             f"double CPU µs/req ({' / '.join(map(str, cs))})", "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for path in args.path_list:
        row = [labels[path]]
        errs = []
        for c in cs:
            cell = results[path][c]
            mark = " **(errors)**" if cell["errors"] else ""
            row += [fmt_num(cell["rps"]) + mark, fmt_ms(cell["p99_ms"])]
            errs += [f"{c} conns: " + ", ".join(cell["errors"])] if cell["errors"] else []
        row.append("—" if path == "direct" else
                   middle[path] + ": " + " / ".join(fmt_num(results[path][c]["middle_us_per_req"], 1)
                                                    for c in cs))
        row.append(" / ".join(fmt_num(results[path][c]["double_us_per_req"], 1) for c in cs))
        row.append("; ".join(errs) if errs else "none")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def serve_threads(args, cells):
    """Serve's CPU per request by thread name (event loops rc-io-*, the journal's committer
    rc-journal, the trajectory writer rc-trajectory), one line per connection count."""
    lines = ["Serve's CPU µs/request by thread:"]
    for c in args.conns:
        per = sorted(cells[c].get("threads_us_per_req", {}).items(), key=lambda kv: -kv[1])
        shown = ", ".join(f"{name} {us:.1f}" for name, us in per if us >= 0.05)
        lines.append(f"- {c} conns: {shown or '—'}")
    lines.append("\nServe's time per request, means from its histograms (ms):")
    for c in args.conns:
        split = cells[c].get("split_ms", {})
        shown = ", ".join(f"{label} {split[name]:.3f}" for name, label in SPLIT
                          if split.get(name) is not None)
        lines.append(f"- {c} conns: {shown or '—'}")
    return "\n".join(lines)


def idle_keepalive_cost(base_url, pid, conns, seconds):
    """The double's CPU, as % of one core, while `conns` keep-alive connections sit idle after one
    answered request each. vLLM's server (an asyncio loop) spends nothing on an idle connection;
    a double that does takes that CPU from whatever shares its cores, in proportion to how long
    the engine connections wait between requests (longest behind the slowest middle)."""
    host, port = base_url[len("http://"):].rsplit(":", 1)
    socks = []
    try:
        for _ in range(conns):
            s = socket.create_connection((host, int(port)), timeout=10)
            socks.append(s)
            s.sendall(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
            if not s.recv(4096).startswith(b"HTTP/1.1 200"):
                raise BenchError("the double's /health did not answer 200 on a fresh connection")
        time.sleep(0.2)  # the answers' own work ends
        cpu0 = harness.cpu_seconds([pid])
        time.sleep(seconds)
        return (harness.cpu_seconds([pid]) - cpu0) / seconds * 100
    except OSError as e:
        raise BenchError(f"idle keep-alive probe: {e}")
    finally:
        for s in socks:
            s.close()


def fs_type(path):
    try:
        r = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True, timeout=5)
        return r.stdout.strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main():
    args = parse_args()
    check_tools(args)
    rc_bin, dbl_bin = harness.resolve_binaries(args)
    settings = harness.parse_serve_sets(args.serve_set)
    # Like for like: nginx runs --workers worker processes, and serve as many event loops
    # (a serve from before the event-driven server has no such key, and runs as it is).
    if "io_threads" in harness.serve_config_keys(rc_bin):
        settings.setdefault("io_threads", args.workers)
    args.nofile = harness.raise_nofile(NOFILE)
    results = {p: {} for p in args.path_list}
    with harness.Lab(args, "rc-proxy-compare.") as lab:
        load_before = loadavg()
        # The double serves each connection on a thread of its own (vLLM's asyncio server has no
        # such bound), and the middles keep idle engine connections between cells: nginx up to
        # 64 per worker, serve up to the last cell's connections. Too few threads would leave
        # the next cell's connections queued until those idle ones time out (5 s).
        want = 2 * max(args.conns) + 64 * args.workers + 64
        double, dbl_url, model, dbl_cmd = lab.start_double(
            dbl_bin, 0, http_threads=want, max_num_seqs=want, nofile=args.nofile, extra=args.double_arg)
        log(f"vllm-double at {dbl_url}, model {model!r}")
        urls, middles = {"direct": dbl_url}, {"direct": None}
        serve_cfg = None
        if "nginx" in args.path_list:
            ngx, urls["nginx"] = start_nginx(lab, args.nginx, dbl_url[len("http://"):],
                                         args.nofile, args.workers)
            middles["nginx"] = lambda: [ngx.pid] + harness.children_of(ngx.pid)
            log(f"nginx at {urls['nginx']} (pids {middles['nginx']()})")
        if "serve" in args.path_list:
            srv, urls["serve"], token, serve_cfg = lab.start_serve(rc_bin, dbl_url, settings,
                                                                    nofile=args.nofile)
            middles["serve"] = lambda: [srv.pid]
            log(f"serve at {urls['serve']} (journal fsync "
                f"{'on' if serve_cfg.get('journal_sync', True) else 'OFF'})")
        body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS}
        for path in args.path_list:  # one request each before the clock starts
            st, b = harness.http("POST", urls[path] + "/v1/completions", body, timeout=30)
            if st != 200 or b"choices" not in b:
                raise BenchError(f"preflight through {path} answered {st}: {b[:300]!r}")
        idle_pct = None
        if args.idle_probe:
            idle_pct = idle_keepalive_cost(dbl_url, double.pid, max(args.conns), args.idle_probe)
            log(f"vllm-double with {max(args.conns)} idle keep-alive connections: "
                f"{idle_pct:.0f}% of a core")
        lua = os.path.join(lab.dir, "completions.lua")
        with open(lua, "w") as f:
            f.write(LUA.format(body=json.dumps(body)))
        for c in args.conns:  # connection-major: the paths of one count run close in time
            for path in args.path_list:
                for ch in lab.children:
                    ch.check_alive()
                cell = run_cell(args, lab, urls[path], c, lua, middles[path], double.pid,
                                threads_pid=srv.pid if path == "serve" else None,
                                metrics=(lambda: histogram_sums(urls["serve"], token))
                                if path == "serve" else None)
                results[path][c] = cell
                log(f"{path:6} {c:4} conns: {fmt_num(cell['rps'])} req/s, p99 {fmt_ms(cell['p99_ms'])}, "
                    f"middle {fmt_num(cell['middle_us_per_req'], 1)} µs/req, double "
                    f"{fmt_num(cell['double_us_per_req'], 1)} µs/req"
                    + (f"  ERRORS: {', '.join(cell['errors'])}" if cell["errors"] else ""))
        load_after = loadavg()
        tmp_fs = fs_type(lab.dir)

    any_err = any(results[p][c]["errors"] for p in args.path_list for c in args.conns)
    print(f"### Proxy side by side — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
    print(f"wrk {args.threads} threads, {args.duration} s per cell, POST /v1/completions "
          f"{{\"prompt\": \"{PROMPT}\", \"max_tokens\": {MAX_TOKENS}}}; double --token-delay-ms 0; "
          f"serve journal fsync {'on' if (serve_cfg or {}).get('journal_sync', True) else 'OFF'} "
          f"({tmp_fs}), io_threads {(serve_cfg or {}).get('io_threads', 'default')}, nginx workers {args.workers}; {os.cpu_count()} CPUs, load average {load_before} before, {load_after} after.\n")
    print(table(args, results))
    print("\nCPU µs/request = (utime+stime of the process, all threads) over the cell / requests wrk "
          "counted. wrk runs on the same machine.")
    if "serve" in args.path_list:
        print("\n" + serve_threads(args, results["serve"]))
    if idle_pct is not None:
        print(f"\nThe double alone, {max(args.conns)} keep-alive connections idle after one request "
              f"each: {idle_pct:.0f}% of one core (an idle connection costs vLLM's asyncio server "
              "nothing). Behind a middle slower than the double, its engine connections wait longer "
              "between requests, and this cost grows with that wait.")
    if any_err:
        print("\n**Some cells had errors (non-2xx answers or socket errors): their figures are not "
              "comparable.**")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "serve_set"},
                       "double_cmd": dbl_cmd, "serve_config": serve_cfg,
                       "double_idle_keepalive_core_percent": idle_pct,
                       "results": results}, f, indent=1, default=str)
    return 3 if any_err else 0


if __name__ == "__main__":
    harness.run_main(main)
