#!/usr/bin/env python3
"""A vLLM receiver double for the NCCL weight-transfer protocol (docs/vllm-protocol.md §2, §5).

Rank >= 1 of the trainer<->engine group, on its own GPU: the dev-mode RL HTTP routes, TCPStore
rendezvous through the real torch.distributed.TCPStore client (unpickling the id into a stand-in
class with vLLM's qualified name) or the unique-id mode, NCCL through ctypes like vLLM's
pynccl_wrapper, packed-chunk unpacking with vLLM's rule, and byte-for-byte verification of every
tensor against the seeded generator the C++ driver also uses. Test-only routes live under /test/.

The control routes the Runner uses answer as vLLM does (reference §1.2, §1.3, §1.5): GET /health
(200, empty body), /version, /weight_info, /is_paused; POST /update_weight_version {"new_version"}
-> {"success": true, "new_version"}; /pause?mode=abort|wait|keep&clear_cache=... -> {"status":
"paused"} (no requests run here, so wait completes at once); /resume -> {"status": "resumed"};
/reset_prefix_cache -> {"success": true}; /reset_encoder_cache and /reset_mm_cache -> 200 empty.
Below version 0.26 the route set is vLLM 0.25.1's, as the real engine answered
(bench/gpu/results/vllm/README.md): no /weight_info or /update_weight_version (404), the finish
body ignored, every reset an empty 200; the label comes from RolloutCore's worker extension over
POST /collective_rpc (rc_weight_info, rc_set_weight_version), modelled as installed.
Timestamps for the sender's benchmarks use time.monotonic_ns() (CLOCK_MONOTONIC, the clock of the
C++ side's steady_clock): first_post_mono_ns is taken just before the first receive is posted.
"""
import argparse, base64, ctypes, datetime, json, os, pickle, sys, threading, time, types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

PROCESS_START = time.time()  # what /metrics reports as process_start_time_seconds, as vLLM does

# ---- stand-in for vllm.distributed.device_communicators.pynccl_wrapper.ncclUniqueId ----
class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]

_mod_name = "vllm.distributed.device_communicators.pynccl_wrapper"
_parts = _mod_name.split(".")
for k in range(1, len(_parts) + 1):
    name = ".".join(_parts[:k])
    if name not in sys.modules:
        sys.modules[name] = types.ModuleType(name)
sys.modules[_mod_name].ncclUniqueId = ncclUniqueId
ncclUniqueId.__module__ = _mod_name
ncclUniqueId.__qualname__ = "ncclUniqueId"

def load_nccl():
    import nvidia
    path = os.path.join(list(nvidia.__path__)[0], "nccl", "lib", "libnccl.so.2")
    lib = ctypes.CDLL(path if os.path.exists(path) else "libnccl.so.2")
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ncclUniqueId, ctypes.c_int]
    lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_void_p]
    lib.ncclBroadcast.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_void_p]
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    return lib, path

NCCL, NCCL_PATH = load_nccl()
NCCL_DTYPE = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
              torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}

def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: {NCCL.ncclGetErrorString(rc).decode()}")

INIT_KEYS_025 = {"master_address", "master_port", "rank_offset", "world_size"}
PACK_KEYS = {"packed", "packed_buffer_size_bytes", "packed_num_buffers"}

def legacy_routes(version):
    major, minor = (int(x) for x in version.split(".")[:2])
    return (major, minor) < (0, 26)

def line_of(version):
    major, minor = (int(x) for x in version.split(".")[:2])
    if (major, minor) < (0, 28): return "update"   # packed* in update_info
    if (major, minor) < (0, 30): return "init"     # packed* in init_info, TCPStore only
    return "uid"                                    # + nccl_unique_id_b64

def expected_bytes(seed, i, nbytes, device):
    nwords = (nbytes + 3) // 4
    j = torch.arange(nwords, dtype=torch.int64, device=device)
    w = (j * 2654435761 + ((i + 1) * 2246822519 + seed)) & 0xFFFFFFFF
    w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
    return w.view(torch.uint8)[:nbytes]

class Engine:
    def __init__(self, device, version):
        self.device = device
        self.version = version
        self.lock = threading.Lock()
        self.comm = None
        self.store = None
        self.rank = None
        self.packing = dict(packed=False, packed_buffer_size_bytes=1 << 30, packed_num_buffers=2)
        self.active = False
        self.weight_version = "default"
        self.paused = False
        self.seed = None            # set by /test/config: verify received bytes
        self.stall_after_first_s = 0.0  # /test/config: hold back after the first broadcast
        self.report = {}

    def set_device(self):
        torch.cuda.set_device(self.device)  # current device is per thread (the article's pitfall)

    def init(self, info):
        self.set_device()
        line = line_of(self.version)
        allowed = set(INIT_KEYS_025)
        if line != "update": allowed |= PACK_KEYS
        if line == "uid": allowed |= {"nccl_unique_id_b64"}
        extra = set(info) - allowed
        if extra: raise ValueError(f"Invalid init_info: unexpected keys {sorted(extra)}")
        world, rank = int(info["world_size"]), int(info["rank_offset"])
        if line != "update":
            for k in PACK_KEYS:
                if k in info: self.packing[k] = info[k]
        uid_mode = info.get("nccl_unique_id_b64") is not None
        tcp_mode = info.get("master_address") is not None and info.get("master_port") is not None
        if uid_mode == tcp_mode: raise ValueError("Invalid init_info: exactly one rendezvous mode")
        if uid_mode:
            raw = base64.b64decode(info["nccl_unique_id_b64"], validate=True)
            if len(raw) != 128: raise ValueError("nccl_unique_id_b64 must decode to 128 bytes")
            uid = ncclUniqueId.from_buffer_copy(raw)
        else:
            from torch.distributed import TCPStore
            self.store = TCPStore(info["master_address"], int(info["master_port"]), world_size=world,
                                  is_master=False, timeout=datetime.timedelta(seconds=60), use_libuv=False)
            uid = pickle.loads(self.store.get("broadcast_from/0/0"))
            if type(uid).__module__ + "." + type(uid).__qualname__ != _mod_name + ".ncclUniqueId":
                raise ValueError(f"unpickled {type(uid)}")
        comm = ctypes.c_void_p()
        check(NCCL.ncclCommInitRank(ctypes.byref(comm), world, uid, rank), "ncclCommInitRank")
        self.comm, self.rank = comm, rank
        buf = torch.zeros(1, device=self.device)
        out = torch.empty_like(buf)
        stream = torch.cuda.current_stream()
        check(NCCL.ncclAllReduce(buf.data_ptr(), out.data_ptr(), 1, 7, 0, comm, stream.cuda_stream), "warm-up")
        stream.synchronize()
        self.report = {"init": "uid" if uid_mode else "tcpstore", "uid_bytes": bytes(uid.internal).hex()[:16]}

    def bcast(self, tensor, dtype_code, stream):
        check(NCCL.ncclBroadcast(None, tensor.data_ptr(), tensor.numel(), dtype_code, 0, self.comm,
                                 stream.cuda_stream), "ncclBroadcast")

    def update(self, info):
        self.set_device()
        if not self.active: raise ValueError("No active weight update")
        line = line_of(self.version)
        allowed = {"names", "dtype_names", "shapes"} | (PACK_KEYS if line == "update" else set())
        extra = set(info) - allowed
        if extra: raise ValueError(f"Invalid update_info: unexpected keys {sorted(extra)}")
        names, dts, shapes = info["names"], info["dtype_names"], info["shapes"]
        self.report["first_post_mono_ns"] = 0
        if not (len(names) == len(dts) == len(shapes)): raise ValueError("length mismatch")
        packing = dict(self.packing)
        if line == "update":
            for k in PACK_KEYS:
                if k in info: packing[k] = info[k]
        dtypes = [getattr(torch, d) for d in dts]
        sizes = [int(torch.Size(s).numel()) * torch.empty(0, dtype=dt).element_size() for s, dt in zip(shapes, dtypes)]
        nbuf = max(1, int(packing["packed_num_buffers"]))
        streams = [torch.cuda.Stream(device=self.device) for _ in range(nbuf)]
        t0 = time.perf_counter()
        received = []  # (tensor index list, flat uint8 chunk) or (index, tensor)
        if packing["packed"]:
            limit = int(packing["packed_buffer_size_bytes"])
            chunk, total = [], 0
            chunks = []
            for i, n in enumerate(sizes):
                chunk.append(i); total += n
                if total > limit:
                    chunks.append((chunk, total)); chunk, total = [], 0
            if chunk: chunks.append((chunk, total))
            for k, (idx, total) in enumerate(chunks):
                s = streams[k % nbuf]
                with torch.cuda.stream(s):
                    buf = torch.empty(total, dtype=torch.uint8, device=self.device)
                    if k == 0: self.report["first_post_mono_ns"] = time.monotonic_ns()
                    self.bcast(buf, 1, s)
                received.append((idx, buf))
                if k == 0 and self.stall_after_first_s > 0:
                    torch.cuda.synchronize(self.device)
                    time.sleep(self.stall_after_first_s)
        else:
            for i, (shape, dt) in enumerate(zip(shapes, dtypes)):
                s = streams[i % nbuf]
                with torch.cuda.stream(s):
                    t = torch.empty(shape, dtype=dt, device=self.device)
                    if i == 0: self.report["first_post_mono_ns"] = time.monotonic_ns()
                    self.bcast(t, NCCL_DTYPE[dt], s)
                received.append(([i], t))
        torch.cuda.synchronize(self.device)
        recv_s = time.perf_counter() - t0
        ok, bad = 0, []
        if self.seed is not None:
            for idx, buf in received:
                flat = buf.reshape(-1).view(torch.uint8) if buf.dim() else buf.reshape(1).view(torch.uint8)
                off = 0
                for i in idx:
                    got = flat[off:off + sizes[i]]
                    # unpack like vLLM: view(dtype).view(shape) must succeed
                    got.view(dtypes[i]).view(shapes[i]) if sizes[i] % dtypes[i].itemsize == 0 else None
                    if torch.equal(got, expected_bytes(self.seed, i, sizes[i], self.device)): ok += 1
                    else: bad.append(names[i])
                    off += sizes[i]
                if off != flat.numel(): bad.append(f"chunk size mismatch at {idx[0]}")
        self.report.update(tensors=len(names), bytes=sum(sizes), broadcasts=len(received), verified_ok=ok,
                           verified_bad=bad[:20], verified=self.seed is not None, recv_s=recv_s,
                           packed=bool(packing["packed"]), line=line)
        del received
        torch.cuda.empty_cache() if sum(sizes) > (8 << 30) else None

    def raw_recv(self, nbytes, chunk):
        self.set_device()
        s = torch.cuda.current_stream()
        bufs, off = [], 0
        t0 = time.perf_counter()
        while off < nbytes:
            n = min(chunk, nbytes - off)
            b = torch.empty(n, dtype=torch.uint8, device=self.device)
            if off == 0: self.report["first_post_mono_ns"] = time.monotonic_ns()
            self.bcast(b, 1, s)
            bufs.append(b); off += n
        s.synchronize()
        self.report["raw_recv_s"] = time.perf_counter() - t0
        del bufs

ENGINE = None

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def reply(self, code, obj):
        self.send_body(code, b"" if obj is None else json.dumps(obj).encode(), "application/json")
    def reply_text(self, code, text):
        self.send_body(code, text.encode(), "text/plain; version=0.0.4")
    def send_body(self, code, body, content_type):
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True
    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw) if raw else None
    def do_GET(self):
        e, p = ENGINE, self.path.split("?")[0]
        e.report["calls"] = e.report.get("calls", 0) + 1
        if p == "/version": return self.reply(200, {"version": e.version})
        if p == "/weight_info":
            if legacy_routes(e.version): return self.reply(404, {"detail": "Not Found"})
            return self.reply(200, {"weight_version": e.weight_version})
        if p == "/is_paused": return self.reply(200, {"is_paused": e.paused})
        if p == "/get_world_size": return self.reply(200, {"world_size": 1})
        if p == "/health": return self.reply(200, None)  # vLLM: 200, empty body
        if p == "/metrics":  # vLLM's Prometheus text includes the process collector's start time
            return self.reply_text(200, "# HELP process_start_time_seconds Start time of the process "
                                        "since unix epoch in seconds.\n# TYPE process_start_time_seconds "
                                        f"gauge\nprocess_start_time_seconds {PROCESS_START:.2f}\n")
        if p == "/test/report": return self.reply(200, e.report)
        return self.reply(404, {"error": "not found"})
    def do_POST(self):
        e, p = ENGINE, self.path.split("?")[0]
        query = dict(kv.split("=", 1) for kv in self.path.split("?", 1)[1].split("&") if "=" in kv) if "?" in self.path else {}
        try:
            body = self.body()
            if p == "/init_weight_transfer_engine":
                if not isinstance(body, dict) or "init_info" not in body: return self.reply(400, {"error": "init_info missing"})
                with e.lock: e.init(body["init_info"])
                return self.reply(200, {"message": "Weight transfer initialized"})
            if p == "/start_weight_update":
                with e.lock:
                    if e.active: raise ValueError("weight update already active")
                    e.active = True
                return self.reply(200, {"message": "Weight update started"})
            if p == "/update_weights":
                if not isinstance(body, dict) or "update_info" not in body: return self.reply(400, {"error": "update_info missing"})
                with e.lock: e.update(body["update_info"])
                return self.reply(200, {"message": "Weights updated"})
            if p == "/finish_weight_update":
                with e.lock:
                    e.active = False
                    if not legacy_routes(e.version) and isinstance(body, dict) and body.get("weight_version") is not None:
                        e.weight_version = body["weight_version"]
                return self.reply(200, {"message": "Weight update finished"})
            if p == "/pause":
                mode = query.get("mode", "abort")
                if mode not in ("abort", "wait", "keep"): raise ValueError(f"invalid pause mode {mode!r}")
                e.paused = True
                e.report.setdefault("pauses", []).append({"mode": mode, "clear_cache": query.get("clear_cache", "true")})
                return self.reply(200, {"status": "paused"})
            if p == "/resume": e.paused = False; return self.reply(200, {"status": "resumed"})
            if p == "/update_weight_version":
                if legacy_routes(e.version): return self.reply(404, {"detail": "Not Found"})
                if not isinstance(body, dict) or not isinstance(body.get("new_version"), str):
                    return self.reply(400, {"error": "new_version (str) required"})
                e.weight_version = body["new_version"]
                return self.reply(200, {"success": True, "new_version": e.weight_version})
            if p == "/reset_prefix_cache":
                return self.reply(200, None if legacy_routes(e.version) else {"success": True})
            if p == "/collective_rpc":  # the worker extension's two methods, one worker
                m = body.get("method") if isinstance(body, dict) else None
                if m == "rc_set_weight_version":
                    e.weight_version = body["args"][0]
                if m in ("rc_weight_info", "rc_set_weight_version"):
                    return self.reply(200, {"results": [{"weight_version": e.weight_version, "rank": 0}]})
                return self.reply(500, {"error": f"Method {m!r} is not implemented."})
            if p in ("/reset_mm_cache", "/reset_encoder_cache"): return self.reply(200, None)  # empty 200
            if p == "/test/config":
                e.seed = body.get("seed"); e.stall_after_first_s = float(body.get("stall_after_first_s", 0)); e.version = body.get("version", e.version); e.active = False
                return self.reply(200, {"ok": True})
            if p == "/test/raw_recv":
                with e.lock: e.raw_recv(int(body["bytes"]), int(body["chunk_bytes"]))
                return self.reply(200, {"ok": True, "recv_s": e.report["raw_recv_s"]})
            return self.reply(404, {"error": "not found"})
        except Exception as ex:  # vLLM answers 500 with {"error": ...} (400 for invalid info)
            e.active = False if p == "/update_weights" else e.active
            return self.reply(400 if isinstance(ex, ValueError) else 500, {"error": f"{type(ex).__name__}: {ex}"})

def main():
    global ENGINE
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--device", type=int, default=1)
    ap.add_argument("--version", default="0.30.0")
    ap.add_argument("--pid-file")
    a = ap.parse_args()
    ENGINE = Engine(a.device, a.version)
    torch.cuda.set_device(a.device)
    torch.zeros(1, device=a.device)
    if a.pid_file:
        with open(a.pid_file, "w") as f: f.write(str(os.getpid()))
    srv = ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    print(f"receiver_double: port {a.port} device {a.device} version {a.version} nccl {NCCL_PATH}", flush=True)
    srv.serve_forever()

if __name__ == "__main__":
    main()
