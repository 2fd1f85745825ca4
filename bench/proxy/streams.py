#!/usr/bin/env python3
"""Many concurrent streams through `rolloutcore serve`, and what they do to everyone else.

Holds N streaming /v1/completions open through serve (a slow double: one token a second), and
while they are open measures the latency of (a) new non-streaming admissions (max_tokens 1, one
every 10 ms), (b) trainer GET /v1/state calls and (c) the same admission sent straight to the
double, so that what serve adds is the difference; samples serve's RSS; at the end checks that
every stream ended with `data: [DONE]`. With --trickle N, N more connections send a request's
bytes at 1 byte per second for the whole run. The probes run in a process of their own, so their
latency is serve's and the double's, not this client's event loop busy with the streams. README.md
explains the report.

  bench/proxy/streams.py --build build                       # 10,000 streams
  bench/proxy/streams.py --build build --streams 0 --trickle 2000

Python 3 stdlib only (asyncio streams, no HTTP library).
"""
import argparse
import asyncio
import json
import math
import multiprocessing
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import BenchError, log  # noqa: E402

PROMPT = "hello world"


def probe_connections(args):
    """Probes that can be open at once: three kinds (the direct one goes to the double), one each
    per interval, each up to its timeout."""
    return 3 * math.ceil(args.request_timeout * 1000 / args.probe_interval_ms) + 256


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_binary_args(p)
    p.add_argument("--streams", type=int, default=10000, metavar="N",
                   help="concurrent streaming requests held open (%(default)s)")
    p.add_argument("--trickle", type=int, default=0, metavar="N",
                   help="connections sending a request at 1 byte/s, never completing (%(default)s)")
    p.add_argument("--token-delay-ms", type=int, default=None, metavar="MS",
                   help="the double's time per token (1000 with streams, else 0)")
    p.add_argument("--stream-tokens", type=int, default=None, metavar="T",
                   help="max_tokens of each stream (default: about 60 s of tokens)")
    p.add_argument("--open-concurrency", type=int, default=256, metavar="C",
                   help="connects in flight (until the request is written) while the streams "
                        "start (%(default)s)")
    p.add_argument("--open-timeout", type=float, default=90, metavar="S",
                   help="how long to wait for all streams to be established; then the measurement "
                        "starts anyway with those that are (%(default)s)")
    p.add_argument("--baseline-s", type=float, default=5, metavar="S",
                   help="probes before any stream or trickle is opened, for comparison (%(default)s)")
    p.add_argument("--measure-s", type=float, default=20, metavar="S",
                   help="probe window while the streams are open; it ends early when more than "
                        "10%% of the streams open at its start have finished (%(default)s)")
    p.add_argument("--probe-interval-ms", type=float, default=10, metavar="MS",
                   help="one admission and one /v1/state call started every MS (%(default)s)")
    p.add_argument("--request-timeout", type=float, default=10, metavar="S",
                   help="deadline of one probe, connect to last byte; slower = failed (%(default)s)")
    p.add_argument("--timeout", type=float, default=300, metavar="S",
                   help="cap of the whole run; streams still open then are reported (%(default)s)")
    p.add_argument("--ignore-nofile", action="store_true",
                   help="run even when serve's open-file limit is below what the streams need")
    p.add_argument("--json", metavar="FILE", help="also write the raw figures as JSON")
    a = p.parse_args()
    if a.streams < 0 or a.trickle < 0 or a.streams + a.trickle == 0:
        p.error("--streams and --trickle are >= 0 and not both 0")
    if a.token_delay_ms is None:
        a.token_delay_ms = 1000 if a.streams else 0
    if a.token_delay_ms < 0:
        p.error("--token-delay-ms must be >= 0")
    if a.stream_tokens is None:
        a.stream_tokens = max(1, 60000 // a.token_delay_ms) if a.token_delay_ms else 60
    for name in ("stream_tokens", "open_concurrency"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("open_timeout", "measure_s", "probe_interval_ms", "request_timeout", "timeout"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if a.baseline_s < 0:
        p.error("--baseline-s must be >= 0")
    return a


# ---------------------------------------------------------------- HTTP/1.1 over asyncio streams

class ChunkedDecoder:
    """Incremental Transfer-Encoding: chunked decoder; feed() returns the payload bytes it could
    decode so far. States: a size line, `left` bytes of data, the CRLF after the data, done."""

    def __init__(self):
        self.buf = bytearray()
        self.left = 0
        self.state = "size"
        self.done = False

    def feed(self, data):
        self.buf += data
        out = bytearray()
        while True:
            if self.state == "size":
                i = self.buf.find(b"\r\n")
                if i < 0:
                    break
                size = int(bytes(self.buf[:i]).split(b";")[0].strip(), 16)
                del self.buf[:i + 2]
                if size == 0:  # the last chunk; trailers are not needed
                    self.state, self.done = "done", True
                    break
                self.state, self.left = "data", size
            elif self.state == "data":
                take = min(self.left, len(self.buf))
                out += self.buf[:take]
                del self.buf[:take]
                self.left -= take
                if self.left:
                    break
                self.state = "crlf"
            elif self.state == "crlf":
                if len(self.buf) < 2:
                    break
                if self.buf[:2] != b"\r\n":
                    raise ValueError("chunk not followed by CRLF")
                del self.buf[:2]
                self.state = "size"
            else:
                break
        return bytes(out)


async def read_head(reader):
    """Status code and lower-cased headers of a response."""
    line = await reader.readline()
    if not line:
        raise ConnectionError("closed before the status line")
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise ConnectionError(f"bad status line {line[:80]!r}")
    status = int(parts[1])
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers


async def read_body(reader, headers, on_data=None):
    """Reads the whole body (chunked, Content-Length or to EOF); on_data gets each payload piece.
    Returns (bytes if on_data is None else b"", complete)."""
    keep = on_data is None
    body = bytearray()

    def take(piece):
        if piece:
            if keep:
                body.extend(piece)
            else:
                on_data(piece)

    if "chunked" in headers.get("transfer-encoding", "").lower():
        dec = ChunkedDecoder()
        while not dec.done:
            data = await reader.read(65536)
            if not data:
                return bytes(body), False
            take(dec.feed(data))
        return bytes(body), True
    if "content-length" in headers:
        n = int(headers["content-length"])
        while n > 0:
            data = await reader.read(min(n, 65536))
            if not data:
                return bytes(body), False
            take(data)
            n -= len(data)
        return bytes(body), True
    while True:
        data = await reader.read(65536)
        if not data:
            return bytes(body), True
        take(data)


def request_bytes(host, port, method, path, body=None, headers=()):
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    lines += list(headers)
    payload = b""
    if body is not None:
        payload = json.dumps(body).encode()
        lines += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


def close_writer(writer):
    try:
        writer.close()
    except (OSError, RuntimeError):
        pass


# ---------------------------------------------------------------- measurements

class Latencies:
    def __init__(self, name):
        self.name = name
        self.ok = []        # seconds
        self.failed = {}    # reason -> count
        self.samples = {}   # reason -> the start of one such answer's body

    def fail(self, reason, body=None):
        self.failed[reason] = self.failed.get(reason, 0) + 1
        if body is not None and reason not in self.samples:
            self.samples[reason] = body[:200].decode("utf-8", "replace")

    def summary(self):
        n_fail = sum(self.failed.values())
        n = len(self.ok) + n_fail
        s = sorted(self.ok)

        def pct(q):  # failures count as infinitely slow
            if n == 0:
                return None
            k = max(0, math.ceil(q * n) - 1)
            return s[k] * 1e3 if k < len(s) else math.inf
        return {"count": n, "ok": len(s), "failed": dict(self.failed), "samples": dict(self.samples),
                "p50_ms": pct(0.50), "p99_ms": pct(0.99), "max_ms": s[-1] * 1e3 if s else None}


async def probe(kind, lat, target, req, timeout):
    host, port = target
    t0 = time.monotonic()
    writer = None
    try:
        async def once():
            nonlocal writer
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(req)
            await writer.drain()
            status, headers = await read_head(reader)
            body, complete = await read_body(reader, headers)
            return status, body, complete
        status, body, complete = await asyncio.wait_for(once(), timeout)
        if status != 200:
            lat.fail(f"HTTP {status}", body)
        elif not complete:
            lat.fail("truncated body")
        elif kind != "state" and b'"choices"' not in body:
            lat.fail("no choices in body")
        else:
            lat.ok.append(time.monotonic() - t0)
    except asyncio.TimeoutError:
        lat.fail(f"timeout {timeout:g} s")
    except (OSError, ConnectionError, ValueError, asyncio.IncompleteReadError) as e:
        lat.fail(type(e).__name__)
    finally:
        if writer is not None:
            close_writer(writer)


async def launch_probes(lats, stop, targets, reqs, interval, duration, timeout):
    """Open-loop: one probe of each kind started every interval, whatever the answers, until
    `duration` is up or `stop` is set; then waits for the last ones (each has its own timeout).
    Returns the seconds it launched probes for."""
    tasks = set()
    start = time.monotonic()
    next_t = start
    while time.monotonic() < start + duration and not stop.is_set():
        if time.monotonic() >= next_t:
            for kind, lat in lats.items():
                t = asyncio.ensure_future(probe(kind, lat, targets[kind], reqs[kind], timeout))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            next_t += interval
        # Short naps, so that `stop` is seen soon even with a long --probe-interval-ms.
        await asyncio.sleep(max(0.0, min(next_t - time.monotonic(), 0.05)))
    launched_s = time.monotonic() - start
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
    return launched_s


def probe_child(conn, stop, targets, reqs, interval, duration, timeout):
    """The probe process: runs launch_probes in its own event loop and sends back ("ok", launched
    seconds, {kind: (ok, failed, samples)}), or ("error", traceback)."""
    try:
        lats = {kind: Latencies(kind) for kind in reqs}
        launched_s = asyncio.run(launch_probes(lats, stop, targets, reqs, interval, duration, timeout))
        conn.send(("ok", launched_s, {k: (l.ok, l.failed, l.samples) for k, l in lats.items()}))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


async def child_result(proc, conn, stop, window_over, limit):
    """The probe process's answer; sets `stop` once the window is over. Never blocks the event
    loop, which still drives the streams and trickles. Raises if the process dies, fails or sends
    nothing within `limit` seconds."""
    loop = asyncio.get_running_loop()
    end = time.monotonic() + limit
    while not conn.poll():  # also true at EOF: the process closed the pipe or died
        if window_over.is_set():
            stop.set()
        if time.monotonic() > end:
            raise BenchError(f"the probe process (pid {proc.pid}) sent nothing within {limit:.0f} s")
        await asyncio.sleep(0.05)
    try:
        msg = await loop.run_in_executor(None, conn.recv)
    except (EOFError, OSError):
        await loop.run_in_executor(None, proc.join, 5)
        raise BenchError(f"the probe process (pid {proc.pid}) ended without sending its figures "
                         f"(exit status {proc.exitcode})")
    if msg[0] != "ok":
        raise BenchError(f"the probe process failed:\n{msg[1]}")
    return msg[1], msg[2]


async def run_probes(run, duration, admit, state, direct):
    """One admission and one /v1/state through serve, and the same admission straight to the
    double (what serve adds is the difference), every interval, in a process of their own: in
    this one they would queue behind thousands of streams and trickles, and measure that. Ends
    early when run.window_over is set. Returns the seconds it launched probes for."""
    serve = (run.host, run.port)
    targets = {"admit": serve, "state": serve, "direct": run.double}
    reqs = {"admit": run.admit_req, "state": run.state_req, "direct": run.direct_req}
    timeout = run.args.request_timeout
    # spawn, not fork: a forked child would hold the trickles' sockets open after they close here.
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    recv_end, send_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=probe_child, name="probes", daemon=True,
                       args=(send_end, stop, targets, reqs, run.args.probe_interval_ms / 1e3,
                             duration, timeout))
    proc.start()
    send_end.close()
    try:
        launched_s, figures = await child_result(proc, recv_end, stop, run.window_over,
                                                 duration + timeout + 60)
    except BaseException:
        proc.kill()
        raise
    finally:
        await asyncio.get_running_loop().run_in_executor(None, proc.join, 10)
        if proc.is_alive():
            proc.kill()
        recv_end.close()
    for kind, lat in (("admit", admit), ("state", state), ("direct", direct)):
        ok, failed, samples = figures[kind]
        lat.ok.extend(ok)
        lat.failed.update(failed)
        lat.samples.update(samples)
    return launched_s


class Run:
    def __init__(self, args, host, port, double, model, token, serve_pid):
        self.args, self.host, self.port, self.serve_pid = args, host, port, serve_pid
        self.double = double
        self.admit_req = request_bytes(host, port, "POST", "/v1/completions",
                                       {"model": model, "prompt": PROMPT, "max_tokens": 1})
        self.direct_req = request_bytes(double[0], double[1], "POST", "/v1/completions",
                                        {"model": model, "prompt": PROMPT, "max_tokens": 1})
        self.state_req = request_bytes(host, port, "GET", "/v1/state",
                                       headers=[f"Authorization: Bearer {token}"])
        self.stream_req = request_bytes(host, port, "POST", "/v1/completions",
                                        {"model": model, "prompt": PROMPT,
                                         "max_tokens": args.stream_tokens, "stream": True})
        # A request too long to finish at 1 byte/s within the run.
        pad = "x" * max(0, int(args.timeout) + 4096)
        self.trickle_req = request_bytes(host, port, "POST", "/v1/completions",
                                         {"model": model, "prompt": pad, "max_tokens": 1})
        self.stream_status = {}     # outcome -> count
        self.established = 0
        self.ended_unestablished = 0  # streams that ended (failed) before their first event
        self.open_now = 0
        self.open_min_in_window = None
        self.window_floor = 0       # the window ends when fewer streams than this are open
        self.window_over = asyncio.Event()
        self.status_samples = {}    # HTTP status -> the start of one such answer's body
        self.open_slots = asyncio.Semaphore(args.open_concurrency)
        self.open_times = []
        self.stream_lengths = []
        self.trickle = {"connections": 0, "closed_by_server": {}, "close_after_s": []}
        self.stopping = False
        self.window_active = False
        self.rss = {"peak_kib": 0, "hwm_kib": 0, "threads_peak": 0, "fds_peak": 0, "samples": 0}

    def outcome(self, what, established=True):
        self.stream_status[what] = self.stream_status.get(what, 0) + 1
        if not established:
            self.ended_unestablished += 1

    async def stream(self):
        """One streaming request. An open slot is held from connect until the request is written,
        so at most --open-concurrency connects are in flight, while every stream is offered to
        serve whatever serve does with it."""
        t0 = time.monotonic()
        writer = None
        stage = "waiting for an open slot"
        held = False
        try:
            await self.open_slots.acquire()
            held = True
            stage = "connecting"
            reader, writer = await asyncio.open_connection(self.host, self.port)
            writer.write(self.stream_req)
            await writer.drain()
            self.open_slots.release()
            held = False
            stage = "sent, no answer yet"
            status, headers = await read_head(reader)
            if status != 200:
                self.outcome(f"HTTP {status}", established=False)
                if status not in self.status_samples:
                    self.status_samples[status] = b""
                    try:
                        body, _ = await asyncio.wait_for(read_body(reader, headers), 5)
                        self.status_samples[status] = body[:300]
                    except (asyncio.TimeoutError, OSError, ConnectionError, ValueError):
                        pass
                return
            stage = "200, no event yet"
            tail = bytearray()
            seen = {"first": False, "done": False}

            def on_data(piece):
                nonlocal stage
                if not seen["first"]:
                    seen["first"] = True
                    stage = "streaming"
                    self.established += 1
                    self.open_now += 1
                    self.open_times.append(time.monotonic() - t0)
                tail.extend(piece)
                if b"data: [DONE]" in tail:
                    seen["done"] = True
                del tail[:-16]

            try:
                _, complete = await read_body(reader, headers, on_data)
            finally:
                if seen["first"]:
                    self.open_now -= 1
                    self.note_open()
            if seen["done"] and complete:
                self.outcome("completed with [DONE]")
                self.stream_lengths.append(time.monotonic() - t0)
            elif not seen["first"]:
                self.outcome("200 but no data", established=False)
            else:
                self.outcome("ended without [DONE]" if complete else "cut off mid-stream")
        except asyncio.CancelledError:
            self.outcome(f"at the run's deadline: {stage}", established=stage == "streaming")
            raise
        except (OSError, ConnectionError, ValueError, asyncio.IncompleteReadError) as e:
            self.outcome(f"error {stage}: {type(e).__name__}", established=stage == "streaming")
        finally:
            if held:
                self.open_slots.release()
            if writer is not None:
                close_writer(writer)

    def note_open(self):
        if self.window_active:
            if self.open_min_in_window is None or self.open_now < self.open_min_in_window:
                self.open_min_in_window = self.open_now
            if self.open_now < self.window_floor:
                self.window_over.set()

    async def trickle_one(self):
        req = self.trickle_req
        while not self.stopping:
            writer = None
            await self.open_slots.acquire()
            held = True
            t0 = time.monotonic()
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
                self.trickle["connections"] += 1
                self.open_slots.release()
                held = False
                reason = None
                for i in range(len(req)):
                    writer.write(req[i:i + 1])
                    await writer.drain()
                    try:
                        data = await asyncio.wait_for(reader.read(256), 1.0)
                    except asyncio.TimeoutError:
                        continue
                    if not data:
                        reason = "closed"
                    else:
                        line = data.split(b"\r\n", 1)[0].decode("latin-1")
                        reason = " ".join(line.split()[1:2]) or line[:20]
                        reason = f"HTTP {reason}"
                    break
                else:
                    reason = "request completed (should not happen)"
            except asyncio.CancelledError:
                raise
            except (OSError, ConnectionError) as e:
                reason = type(e).__name__
            finally:
                if held:
                    self.open_slots.release()
                if writer is not None:
                    close_writer(writer)
            if not self.stopping:
                d = self.trickle["closed_by_server"]
                d[reason] = d.get(reason, 0) + 1
                lasted = time.monotonic() - t0
                self.trickle["close_after_s"].append(lasted)
                if lasted < 1.0:  # refused at once: no reconnect storm
                    await asyncio.sleep(1.0)

    async def sample_serve(self):
        n = 0
        while True:
            try:
                st = harness.proc_status(self.serve_pid)
                self.rss["peak_kib"] = max(self.rss["peak_kib"], st.get("VmRSS", 0))
                self.rss["hwm_kib"] = max(self.rss["hwm_kib"], st.get("VmHWM", 0))
                self.rss["threads_peak"] = max(self.rss["threads_peak"], st.get("Threads", 0))
                if n % 8 == 0:  # listing 20k fds is not free
                    self.rss["fds_peak"] = max(self.rss["fds_peak"], harness.fd_count(self.serve_pid))
                self.rss["samples"] += 1
            except OSError:
                return
            n += 1
            await asyncio.sleep(0.25)


def fmt_delta(through_ms, direct_ms):
    """Serve's share of an admission's latency at one percentile: through serve minus direct."""
    if through_ms is None or direct_ms is None or math.inf in (through_ms, direct_ms):
        return "—"
    return f"{through_ms - direct_ms:+.1f} ms"


def md_code(text):
    """Text as inline code in a Markdown table cell."""
    return "`" + text.replace("|", "\\|").replace("`", "'").replace("\n", " ")[:200] + "`"


def fmt_ms(v):
    if v is None:
        return "—"
    if v == math.inf:
        return "∞ (failures ≥ 1%)"
    return f"{v:.1f} ms" if v < 1000 else f"{v / 1e3:.2f} s"


async def drive(args, run, serve):
    t_start = time.monotonic()
    deadline = t_start + args.timeout
    out = {"phases": {}}
    sampler = asyncio.ensure_future(run.sample_serve())
    cpu0 = harness.cpu_seconds([serve.pid])

    # 1. baseline: nothing else open
    base_a, base_s, base_d = Latencies("admit"), Latencies("state"), Latencies("direct")
    if args.baseline_s > 0:
        log(f"baseline: probes for {args.baseline_s:g} s with nothing else open")
        await run_probes(run, args.baseline_s, base_a, base_s, base_d)
    out["baseline"] = {"admission": base_a.summary(), "state": base_s.summary(),
                       "direct": base_d.summary()}

    # 2. open the trickles and the streams
    t_open = time.monotonic()
    trickles = [asyncio.ensure_future(run.trickle_one()) for _ in range(args.trickle)]
    streams = [asyncio.ensure_future(run.stream()) for _ in range(args.streams)]
    log(f"opening {args.streams} streams and {args.trickle} trickle connections "
        f"({args.open_concurrency} at a time)")
    open_end = min(t_open + args.open_timeout, deadline)
    last_log = 0
    while time.monotonic() < open_end:
        settled = run.established + run.ended_unestablished
        if settled >= args.streams and run.trickle["connections"] >= args.trickle:
            break
        if time.monotonic() - last_log > 5:
            last_log = time.monotonic()
            log(f"  {run.established} streams established, {run.ended_unestablished} failed before "
                f"their first event, {run.trickle['connections']} trickle connects, serve RSS "
                f"{run.rss['peak_kib'] / 1024:.0f} MiB peak")
        await asyncio.sleep(0.1)
    out["phases"]["open_s"] = time.monotonic() - t_open
    out["established_when_window_started"] = run.established
    log(f"{run.established}/{args.streams} streams established in {out['phases']['open_s']:.1f} s; "
        f"probing for up to {args.measure_s:g} s")

    # 3. the window: probes while the streams are open, until the first one finishes
    win_a, win_s, win_d = Latencies("admit"), Latencies("state"), Latencies("direct")
    open_at_start = run.open_now
    run.open_min_in_window = open_at_start
    run.window_floor = math.ceil(0.9 * open_at_start)
    run.window_active = True
    out["phases"]["window_s"] = await run_probes(
        run, max(0.0, min(args.measure_s, deadline - time.monotonic())), win_a, win_s, win_d)
    run.window_active = False
    out["window"] = {"admission": win_a.summary(), "state": win_s.summary(),
                     "direct": win_d.summary(),
                     "streams_open_at_start": open_at_start,
                     "streams_open_min": run.open_min_in_window,
                     "ended_early": run.window_over.is_set()}
    log(f"window {out['phases']['window_s']:.1f} s: admission p99 "
        f"{fmt_ms(out['window']['admission']['p99_ms'])}, /v1/state p99 "
        f"{fmt_ms(out['window']['state']['p99_ms'])}; waiting for the streams to finish")

    # 4. let the streams finish (bounded), then stop the trickles
    remaining = deadline - time.monotonic()
    if streams:
        done, pending = await asyncio.wait(streams, timeout=max(0.0, remaining))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    run.stopping = True
    for t in trickles:
        t.cancel()
    await asyncio.gather(*trickles, return_exceptions=True)
    out["phases"]["total_s"] = time.monotonic() - t_start
    out["serve_cpu_s"] = harness.cpu_seconds([serve.pid]) - cpu0
    sampler.cancel()
    await asyncio.gather(sampler, return_exceptions=True)
    return out


def report(args, out, run, cfg, dbl_cmd, nofile):
    st = run.stream_status
    completed = st.get("completed with [DONE]", 0)
    ok = completed == args.streams
    w, b = out["window"], out["baseline"]
    print(f"### Streams through serve — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
    print(f"{args.streams} streams (max_tokens {args.stream_tokens}, double --token-delay-ms "
          f"{args.token_delay_ms}), {args.trickle} trickle connections, probes every "
          f"{args.probe_interval_ms:g} ms (timeout {args.request_timeout:g} s) from a process of their "
          f"own, so their latency is not this client's queueing; {os.cpu_count()} CPUs; "
          f"open-file limit {nofile}.\n")
    ot = sorted(run.open_times)
    print("| figure | value |\n|---|---|")
    rows = [] if not args.streams else [
        ("streams established (first event received)", f"{run.established} / {args.streams} "
         f"(in {out['phases']['open_s']:.1f} s" + (f", p99 time-to-first-event "
                                                    f"{fmt_ms(ot[max(0, math.ceil(.99 * len(ot)) - 1)] * 1e3)}"
                                                    if ot else "") + ")"),
        ("streams completed with `data: [DONE]`", f"{completed} / {args.streams}"
         + ("" if ok or not args.streams else " **(NOT ALL)**")),
        ("stream outcomes", ", ".join(f"{k}: {v}" for k, v in sorted(st.items())) or "—"),
    ] + [
        (f"a stream's HTTP {k} answer began", md_code(v.decode("utf-8", "replace")))
        for k, v in sorted(run.status_samples.items())
    ]
    rows.append(("probe window", f"{out['phases']['window_s']:.1f} s"
                 + (f", streams open {w['streams_open_at_start']} at start, {w['streams_open_min']} "
                    "at least" if args.streams else "")
                 + (" (ended early: more than 10% of the streams finished)"
                    if w["ended_early"] else "")))
    for label, key in (("admission (POST max_tokens 1)", "admission"),
                       ("the same admission straight to the double", "direct"),
                       ("trainer GET /v1/state", "state")):
        for phase, d in (("baseline", b), ("under load", w)):
            s = d[key]
            fails = "; failed " + ", ".join(f"{k}: {v}" for k, v in s["failed"].items()) if s["failed"] else ""
            rows.append((f"{label}, {phase}: p50 / p99 / max",
                         f"{fmt_ms(s['p50_ms'])} / {fmt_ms(s['p99_ms'])} / {fmt_ms(s['max_ms'])} "
                         f"({s['ok']}/{s['count']} ok{fails})"))
            for reason, body in s["samples"].items():
                rows.append((f"{label}, {phase}: a {reason} answer began", md_code(body)))
    for phase, d in (("baseline", b), ("under load", w)):
        rows.append((f"added by serve to an admission, {phase}: p50 / p99",
                     f"{fmt_delta(d['admission']['p50_ms'], d['direct']['p50_ms'])} / "
                     f"{fmt_delta(d['admission']['p99_ms'], d['direct']['p99_ms'])}"))
    rows += [
        ("serve RSS peak (sampled VmRSS / kernel VmHWM)",
         f"{run.rss['peak_kib'] / 1024:.0f} MiB / {run.rss['hwm_kib'] / 1024:.0f} MiB"),
        ("serve threads peak / open fds peak", f"{run.rss['threads_peak']} / {run.rss['fds_peak']}"),
        ("serve CPU over the run", f"{out['serve_cpu_s']:.1f} s in {out['phases']['total_s']:.0f} s"),
    ]
    if args.trickle:
        t = run.trickle
        ca = sorted(t["close_after_s"])
        rows += [("trickle connections made (reconnects included)", str(t["connections"])),
                 ("trickle connections ended by the server", ", ".join(
                     f"{k}: {v}" for k, v in t["closed_by_server"].items()) or "none"),
                 ("trickle: median time until the server ended one",
                  f"{ca[len(ca) // 2]:.1f} s" if ca else "—")]
    for k, v in rows:
        print(f"| {k} | {v} |")
    print(f"\nserve config: {json.dumps({k: v for k, v in cfg.items() if k not in ('auth_token', 'journal_path', 'engine_url')})}")
    print(f"double: {' '.join(os.path.basename(c) if i == 0 else c for i, c in enumerate(dbl_cmd))}")
    probe_fail = any(out[p][k]["failed"] for p in ("baseline", "window")
                     for k in ("admission", "state", "direct"))
    if not ok or probe_fail:
        print("\n**Not a clean run: streams that did not complete, or probes that failed, are listed "
              "above.**")
    return 0 if ok and not probe_fail else 3


def main():
    args = parse_args()
    rc_bin, dbl_bin = harness.resolve_binaries(args)
    settings = harness.parse_serve_sets(args.serve_set)
    margin = probe_connections(args)
    conns = args.streams + args.trickle + margin
    # serve holds a client socket and an engine socket per stream (2 per stream), plus its own.
    serve_needs = 2 * args.streams + args.trickle + margin + margin // 2
    nofile = harness.raise_nofile(max(65536, serve_needs))
    if nofile < conns:
        raise BenchError(f"this process can open only {nofile} files; {conns} are needed "
                         "(raise the hard limit: ulimit -Hn, /etc/security/limits.conf)")
    if nofile < serve_needs and not args.ignore_nofile:
        raise BenchError(
            f"serve needs about {serve_needs} open files for {args.streams} streams (a client and "
            f"an engine socket each) but the hard limit here is {nofile} and cannot be raised "
            f"(needs root/CAP_SYS_RESOURCE). Raise it, use fewer --streams, or pass --ignore-nofile "
            f"to run anyway")
    known = harness.known_serve_keys(rc_bin)
    defaults = {}
    if "http_connections_max" in known:  # else serve answers 503 beyond its default 4096
        defaults["http_connections_max"] = min(65536, max(4096, conns))
    if "shutdown_grace_ms" in known:  # teardown does not wait for streams cut by a deadline
        defaults["shutdown_grace_ms"] = 1000
    defaults.update(settings)

    with harness.Lab(args, "rc-proxy-streams.") as lab:
        want = args.streams + margin
        double, dbl_url, model, dbl_cmd = lab.start_double(
            dbl_bin, args.token_delay_ms, http_threads=want, max_num_seqs=want, nofile=nofile,
            extra=args.double_arg)
        if "--http-threads" not in dbl_cmd and args.streams > 64:
            log("note: this vllm-double has no --http-threads; its fixed thread pool may not hold "
                f"{args.streams} streams at once (they queue in the double)")
        serve, url, token, cfg = lab.start_serve(rc_bin, dbl_url, defaults, nofile=nofile)
        host, port = url[len("http://"):].rsplit(":", 1)
        log(f"double {dbl_url}, serve {url}")

        async def go():
            dhost, dport = dbl_url[len("http://"):].rsplit(":", 1)
            run = Run(args, host, int(port), (dhost, int(dport)), model, token, serve.pid)
            out = await drive(args, run, serve)
            return run, out
        run, out = asyncio.run(go())
        alive = serve.proc.poll() is None
        if not alive:
            log(f"serve exited with status {serve.proc.returncode} during the run:\n    " + serve.tail())
        rc = report(args, out, run, cfg, dbl_cmd, nofile)
        if not alive:
            print(f"\n**serve exited with status {serve.proc.returncode} during the run.**")
            rc = 3
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "out": out,
                       "stream_status": run.stream_status, "rss": run.rss,
                       "trickle": {k: v for k, v in run.trickle.items() if k != "close_after_s"}},
                      f, indent=1, default=str)
    return rc


if __name__ == "__main__":
    harness.run_main(main)
