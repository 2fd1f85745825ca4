#!/usr/bin/env python3
"""Writes hand-made seed inputs for the fuzz targets into DIR/<target>/ (one file per seed).

The committed corpora (tests/fuzz/corpus/<target>/) are these seeds plus what the campaigns
found, minimised with libFuzzer's -merge=1; this script documents where each corpus started.
usage: make_corpus_seeds.py DIR
"""
import json
import os
import struct
import sys

H = "a" * 64


def j(o):
    return json.dumps(o, separators=(",", ":")).encode()


def api():
    ident = {"manifest_digest": H, "content_digest": "e" * 64, "checkpoint": "/ckpt/b",
             "run": "run-1", "step": 3}
    upd = {"update_id": "u1", "target_label": "rc-1", "identity": ident,
           "source": "synthetic:4x64"}
    yield b"\x00" + j(upd)
    yield b"\x00" + j(dict(upd, source="safetensors:/nonexistent/model.safetensors"))
    yield b"\x00" + j(dict(upd, identity={"manifest_digest": H}))
    yield b"\x00" + j(dict(upd, target_label="rc-0"))
    yield b"\x01"
    yield b"\x01" + j({"rollout_id": "a1", "wait_ms": 10, "lease_ms": 5000})
    yield b"\x01" + j({"rollout_id": "r1"})
    yield b"\x01" + j({"wait_ms": 18446744073709551615})
    yield b"\x02r1\n"
    yield b"\x02r1\n" + j({"outcome": "aborted", "prompt_tokens": 3, "completion_tokens": 4})
    yield b"\x02zz\n{}"
    yield b"\x03r1\n"
    yield b"\x03r1\n{}"


def engine():
    def r(route, knob, body):
        return bytes([route, knob]) + (body if isinstance(body, bytes) else j(body))
    for v in ["0.25.1", "0.30.0rc1", "0.23.1.dev2095+g0fe9a916e", "v0.28.0"]:
        yield r(0, 0, {"version": v})
    yield r(1, 0, {"weight_version": "rc-3"})
    yield r(1, 0, {"weight_version": "rc-3", "instance": "n1", "workers": 2})
    rpc = {"results": [{"weight_version": "rc-1", "instance": "n1"},
                       {"weight_version": "rc-1", "instance": "n2"}]}
    yield r(2, 0, rpc)
    yield r(2, 5, rpc)
    yield r(2, 0, {"results": [{"weight_version": "rc-1"}]})
    yield r(3, 0, {"status": "paused"})
    yield r(4, 0, {"is_paused": True})
    yield r(5, 0, b"")
    yield r(5, 1, {"success": False})
    yield r(5, 2, {"success": True})
    yield r(6, 0, {"world_size": 2})
    yield r(7, 0, {"success": True})
    metrics = (b"# HELP process_start_time_seconds Start time.\n"
               b"# TYPE process_start_time_seconds gauge\n"
               b"process_start_time_seconds 1.7316e+09\n"
               b"vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3\n"
               b"vllm:num_requests_waiting{engine=\"0\"} 0 1700000000000\n"
               b"vllm:prefix_cache_hits_total{engine=\"0\",} 12\n"
               b"vllm:prefix_cache_queries_total 40\n"
               b"x{a=\"q\\\"\\\\\\n\"} NaN\ny +Inf\nz -Inf\n")
    yield r(8, 0, metrics)
    yield r(8, 0, b"process_start_time_seconds 12345.5\r\n")
    sse = b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n'
    yield r(9, 0x30, sse)
    yield r(9, 0x02, sse.replace(b"\n", b"\r\n"))
    yield r(9, 0x10, b': keep-alive\n\ndata: {"a":\ndata: 1}\n\nevent: x\ndata: nope\n\n')


def proxy():
    c1 = {"id": "c", "choices": [{"index": 0, "text": "a", "token_ids": [5, 6],
                                  "logprobs": {"token_logprobs": [-0.5, None]}}],
          "prompt_token_ids": [1, 2, 3]}
    usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    chat = {"choices": [{"index": 0, "delta": {"content": "b", "token_ids": [7]},
                         "logprobs": {"content": [{"logprob": -1.25}]},
                         "finish_reason": "stop"}]}
    stream = b"".join(b"data: " + j(x) + b"\n\n" for x in (c1, chat, usage)) + b"data: [DONE]\n\n"
    for flags in (0, 1, 2, 3, 4, 7, 0x41):
        yield bytes([flags]) + stream
    yield b"\x03" + b"data: " + j({"choices": [{"index": 1, "token_ids": [1] * 50}]}) + b"\n\n"


def safetensors():
    def st(header, data_len, extra_sel=0):
        h = j(header)
        return bytes([extra_sel]) + struct.pack("<Q", len(h)) + h + b"\0" * data_len
    yield st({"__metadata__": {"format": "pt"},
              "a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
              "b": {"dtype": "F32", "shape": [4], "data_offsets": [12, 28]}}, 28)
    yield st({"z": {"dtype": "F16", "shape": [0], "data_offsets": [0, 0]},
              "w": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}, 8)
    yield st({"a": {"dtype": "U8", "shape": [1, 1, 1], "data_offsets": [0, 1]}}, 1, 3)
    yield st({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}, 0, 0xF1)


def tcp_store():
    def s(b):
        return struct.pack("<Q", len(b)) + b

    def feed(conn, payload, read=True):
        out = b""
        while payload:  # one op per <= 255 bytes
            part, payload = payload[:255], payload[255:]
            out += bytes([conn | (0x20 if read else 0), len(part)]) + part
        return out
    validate = b"\x00" + struct.pack("<I", 0x3C85F7CE)
    yield feed(0, validate + b"\x01" + s(b"/k") + s(b"v") + b"\x03" + s(b"/k"))
    yield feed(1, b"\x06" + struct.pack("<Q", 1) + s(b"/w")) + feed(0, b"\x01" + s(b"/w") + s(b"1"))
    yield feed(0, b"\x04" + s(b"init/") + struct.pack("<q", 1) + b"\x04" + s(b"init/") +
               struct.pack("<q", -3) + b"\x07\x0d" + struct.pack("<I", 7))
    yield feed(0, b"\x0b" + struct.pack("<Q", 2) + s(b"/a") + s(b"1") + s(b"/b") + s(b"2") +
               b"\x0a" + struct.pack("<Q", 2) + s(b"/a") + s(b"/b") +
               b"\x05" + struct.pack("<Q", 1) + s(b"/a"))
    yield feed(0, b"\x02" + s(b"/c") + s(b"") + s(b"x") + b"\x09" + s(b"/c") + s(b"yz") +
               b"\x08" + s(b"/c") + b"\x0c")
    yield bytes([0xC4, 4]) + b"uid!" + feed(2, b"\x01" + s(b"/broadcast_from/0/0") + s(b"evil"))
    yield feed(1, b"\x06" + struct.pack("<Q", 1) + s(b"/broadcast_from/0/0")) + bytes([0xC4, 2]) + b"id"


def text():
    for t in [b"hello", b"tab\there", b"\x1b[31mred", b"\xff\xfe", "é€𝄞".encode(), b"a\\b",
              b"line\nbreak\r", b"\xed\xa0\x80", b"\xc0\xaf", b"\x7f"]:
        yield t


def main():
    out = sys.argv[1]
    for name, gen in [("api_fuzz", api), ("engine_response_fuzz", engine),
                      ("proxy_stream_fuzz", proxy), ("safetensors_fuzz", safetensors),
                      ("tcp_store_fuzz", tcp_store), ("text_fuzz", text)]:
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        for i, data in enumerate(gen()):
            with open(os.path.join(d, "seed-%02d" % i), "wb") as f:
                f.write(data)


if __name__ == "__main__":
    main()
