"""Shared process handling for the proxy benchmarks (compare.py, streams.py). Python 3 stdlib only.

Starts the vLLM double and `rolloutcore serve` as child processes in a private temp directory,
waits for their `listening on HOST:PORT` line, reads CPU and memory figures from /proc, and takes
everything down again on exit (normal return, exception, SIGINT/SIGTERM/SIGHUP).
"""
import argparse
import json
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

START_TIMEOUT_S = 30.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
EXTENSION_CLS = "rolloutcore.vllm_ext.RolloutCoreWorkerExtension"


class BenchError(Exception):
    """A failure the user can act on; printed without a traceback."""


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def add_binary_args(p: argparse.ArgumentParser):
    p.add_argument("--build", metavar="DIR",
                   help="CMake build dir: uses DIR/cli/rolloutcore and DIR/fixtures/vllm-double")
    p.add_argument("--rolloutcore", metavar="PATH", help="the rolloutcore binary (overrides --build)")
    p.add_argument("--vllm-double", metavar="PATH", help="the vllm-double binary (overrides --build)")
    p.add_argument("--serve-set", metavar="KEY=VALUE", action="append", default=[],
                   help="extra serve config key (JSON value, or a plain string); repeatable")
    p.add_argument("--double-arg", metavar="ARG", action="append", default=[],
                   help="extra argument for vllm-double; repeatable (use --double-arg=--flag)")
    p.add_argument("--tmp-base", metavar="DIR", default=None,
                   help="where the private temp dir (journal, logs, configs) is made; default $TMPDIR "
                        "or /tmp. The journal is fsync'd there, so its disk matters")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (logs) for inspection")


def resolve_binaries(args):
    rc, dbl = args.rolloutcore, args.vllm_double
    if args.build:
        rc = rc or os.path.join(args.build, "cli", "rolloutcore")
        dbl = dbl or os.path.join(args.build, "fixtures", "vllm-double")
    if not rc or not dbl:
        raise BenchError("give --build DIR, or both --rolloutcore PATH and --vllm-double PATH")
    for name, path in (("rolloutcore", rc), ("vllm-double", dbl)):
        if not os.path.isfile(path):
            raise BenchError(f"{name} binary not found: {path} (build it first: make build)")
        if not os.access(path, os.X_OK):
            raise BenchError(f"{name} binary is not executable: {path}")
    return os.path.abspath(rc), os.path.abspath(dbl)


def serve_config_keys(binary):
    """The config keys this rolloutcore's `serve --help` lists."""
    known = set(re.findall(r"config key (\w+)", help_text(binary, "serve")))
    if not known:
        raise BenchError(f"{binary} serve --help lists no config keys; is it rolloutcore?")
    return known


def parse_serve_sets(items):
    out = {}
    for item in items:
        if "=" not in item:
            raise BenchError(f"--serve-set wants KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def raise_nofile(want):
    """Raises this process's open-file limit towards `want`: soft and hard where allowed (raising
    the hard limit needs CAP_SYS_RESOURCE), else as far as the hard limit goes. Returns the soft
    limit now in force; children started with nofile=that value get the same."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard >= want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    else:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
        except (ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def help_text(binary, *sub):
    try:
        r = subprocess.run([binary, *sub, "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BenchError(f"{binary} {' '.join(sub)} --help failed: {e}")
    return r.stdout + r.stderr


def option_upper_bound(help_txt, flag):
    """The upper bound of an integer option as CLI11 prints it ('in [1 - 20000]'), or None."""
    m = re.search(r"^\s*" + re.escape(flag) + r"\b[^\n]*?\[\s*-?\d+\s*-\s*(\d+)\s*\]", help_txt, re.M)
    return int(m.group(1)) if m else None


def proc_stat_ticks(pid):
    """utime + stime of a whole process (all its threads, live and exited), in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)


def thread_cpu_by_name(pid):
    """utime + stime of each live thread of a process, in seconds, summed by thread name."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                text = f.read()
        except OSError:
            continue  # the thread ended between the listing and the read
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0) + (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def children_of(pid):
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d))
        except (OSError, ValueError, IndexError):
            pass
    return out


def cpu_seconds(pids):
    total = 0
    for pid in pids:
        try:
            total += proc_stat_ticks(pid)
        except OSError:
            pass
    return total / CLK_TCK


def proc_status(pid):
    """VmRSS, VmHWM (KiB) and Threads of a process, from /proc/PID/status."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0])
            elif k == "Threads":
                out[k] = int(v)
    return out


def fd_count(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method, url, body=None, headers=None, timeout=10):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Child:
    def __init__(self, name, cmd, workdir, nofile=None, env=None):
        self.name, self.cmd = name, cmd
        self.out_path = os.path.join(workdir, f"{name}.stdout")
        self.err_path = os.path.join(workdir, f"{name}.stderr")
        preexec = None
        if nofile:
            def preexec():  # like `ulimit -n nofile`, as far as the hard limit allows
                soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                n = nofile if hard == resource.RLIM_INFINITY else min(nofile, hard)
                resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            try:
                self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                             cwd=workdir, preexec_fn=preexec,
                                             start_new_session=True, env=env)
            except OSError as e:
                raise BenchError(f"{name}: cannot start {cmd[0]}: {e}")
        self.pid = self.proc.pid

    def tail(self, n=15):
        lines = []
        for p in (self.out_path, self.err_path):
            try:
                with open(p, errors="replace") as f:
                    lines += f.read().splitlines()[-n:]
            except OSError:
                pass
        return "\n    ".join(lines[-n:]) or "(no output)"

    def check_alive(self):
        if self.proc.poll() is not None:
            raise BenchError(f"{self.name} exited with status {self.proc.returncode}:\n    "
                             + self.tail())

    def wait_listening(self, timeout=START_TIMEOUT_S):
        """Waits for `listening on [http://]HOST:PORT` on stdout; returns (host, port)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with open(self.out_path, errors="replace") as f:
                for line in f:
                    m = re.match(r"listening on (?:https?://)?(\S+):(\d+)\s*$", line)
                    if m:
                        return m.group(1).strip("[]"), int(m.group(2))
            self.check_alive()
            time.sleep(0.05)
        raise BenchError(f"{self.name} did not print 'listening on' within {timeout:.0f} s:\n    "
                         + self.tail())

    def stop(self, grace=5.0):
        if self.proc.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGTERM)  # its own session: the group is its own
            except OSError:
                pass
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:  # leftovers of the group (nginx workers), or one that ignored SIGTERM
            os.killpg(self.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            log(f"warning: {self.name} (pid {self.pid}) did not exit after SIGKILL")


class Lab:
    """The temp dir and the child processes; a context manager that always cleans up."""

    def __init__(self, args, prefix):
        self.args = args
        base = args.tmp_base or os.environ.get("TMPDIR") or "/tmp"
        if not os.path.isdir(base):
            raise BenchError(f"--tmp-base {base} is not a directory")
        self.dir = tempfile.mkdtemp(prefix=prefix, dir=base)
        self.children = []
        self._old = {}

    def __enter__(self):
        def on_signal(signum, _frame):
            raise SystemExit(128 + signum)
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old[s] = signal.signal(s, on_signal)
        return self

    def __exit__(self, *exc):
        # No signal may interrupt the cleanup itself.
        for s in self._old:
            signal.signal(s, signal.SIG_IGN)
        for c in reversed(self.children):
            c.stop()
        if self.args.keep_tmp:
            log(f"kept {self.dir}")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
        for s, h in self._old.items():
            signal.signal(s, h)
        return False

    def spawn(self, name, cmd, nofile=None, env=None):
        c = Child(name, cmd, self.dir, nofile=nofile, env=env)
        self.children.append(c)
        return c

    # ---- the double ----
    def start_double(self, binary, token_delay_ms, http_threads=None, max_num_seqs=None,
                     nofile=None, extra=(), model="rc-double-model"):
        """Starts vllm-double; passes --http-threads / --max-num-seqs only when its --help lists
        them (older doubles have a fixed pool). Returns (child, base_url, model_name, cmd)."""
        h = help_text(binary)
        if "--port" not in h or "--token-delay-ms" not in h:
            raise BenchError(f"{binary} does not look like vllm-double (--help: {h[:200]!r})")
        cmd = [binary, "--host", "127.0.0.1", "--port", "0", "--token-delay-ms", str(token_delay_ms)]
        if "--model-name" in h:  # the name requests must carry; set, so it is known
            cmd += ["--model-name", model]
        if "--worker-extension-cls" in h:  # the label RPCs serve's bootstrap needs below 0.26
            cmd += ["--worker-extension-cls", EXTENSION_CLS]
        for flag, want in (("--http-threads", http_threads), ("--max-num-seqs", max_num_seqs)):
            if want and flag in h:
                bound = option_upper_bound(h, flag)
                cmd += [flag, str(min(want, bound) if bound else want)]
        cmd += list(extra)
        child = self.spawn("vllm-double", cmd, nofile=nofile)
        host, port = child.wait_listening()
        return child, f"http://{host}:{port}", model, cmd

    # ---- serve ----
    def start_serve(self, binary, engine_url, settings=None, nofile=None):
        """Writes serve.json (only keys this serve knows, per `serve --help`) and starts serve;
        waits for `listening on` and /readyz. Returns (child, base_url, token, config)."""
        known = serve_config_keys(binary)
        token = "bench-" + secrets.token_hex(8)
        cfg = {
            "engine_url": engine_url,
            "journal_path": os.path.join(self.dir, "journal"),
            "listen_host": "127.0.0.1",
            "listen_port": 0,
            "auth_token": token,
            "initial_source": "synthetic:4x64",
        }
        missing = [k for k in cfg if k not in known]
        if missing:
            raise BenchError(f"this rolloutcore serve has no config key(s) {missing}")
        for k, v in (settings or {}).items():
            if k not in known:
                raise BenchError(f"serve config key {k!r} is not known to this rolloutcore "
                                 f"(serve --help lists: {', '.join(sorted(known))})")
            cfg[k] = v
        path = os.path.join(self.dir, "serve.json")
        with open(path, "w") as f:
            json.dump(cfg, f, indent=1)
        child = self.spawn("serve", [binary, "serve", "--config", path], nofile=nofile)
        host, port = child.wait_listening()
        url = f"http://{host}:{port}"
        end = time.monotonic() + START_TIMEOUT_S
        last = None
        while time.monotonic() < end:
            try:
                st, body = http("GET", url + "/readyz", timeout=5)
                if st == 200:
                    return child, url, token, cfg
                last = f"{st} {body[:200]!r}"
            except OSError as e:
                last = str(e)
            child.check_alive()
            time.sleep(0.1)
        raise BenchError(f"serve at {url} not ready within {START_TIMEOUT_S:.0f} s "
                         f"(/readyz: {last}):\n    " + child.tail())


def known_serve_keys(binary):
    return set(re.findall(r"config key (\w+)", help_text(binary, "serve")))


def run_main(main):
    """Runs main(); a BenchError is one clear line on stderr and exit status 2."""
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
