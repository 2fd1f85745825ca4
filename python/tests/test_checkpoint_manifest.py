"""rc_checkpoint_manifest (rolloutcore.vllm_ext) and rolloutcore.manifest: the manifest digest of a
checkpoint on the engine's disk, compared with RolloutCore's C++ (the `rolloutcore serve` update
route and the vLLM double) on the same fixture files."""
import hashlib
import json
import os
import signal
import struct

import pytest

import rolloutcore
from conftest import BUILD, TOKEN, _start
from rolloutcore.manifest import checkpoint_manifest
from rolloutcore.vllm_ext import RolloutCoreWorkerExtension
from test_vllm_ext import rpc

SIZES = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "U8": 1}


class FakeWorker(RolloutCoreWorkerExtension):
    """vLLM's Worker as the extension sees it: a rank and a load_config."""

    def __init__(self, load_format="auto"):
        self.rank = 0
        self.load_config = type("LoadConfig", (), {"load_format": load_format})()


def write_safetensors(path, tensors, fill=0):
    """tensors: [(name, dtype, shape)] laid out in this order; the header lists them reversed,
    so that header order and data order differ."""
    header, offset, data = {}, 0, b""
    for i, (name, dtype, shape) in enumerate(tensors):
        n = SIZES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        data += bytes([(fill + i) % 256]) * n
        offset += n
    header = dict(reversed(list(header.items())))
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


def canonical(lines):
    return hashlib.sha256(("rolloutcore-manifest-v1\n" + "".join(lines)).encode()).hexdigest()


@pytest.fixture
def ckpt(tmp_path):
    """Three checkpoints: a file alone in its directory, a sharded directory with an index (and
    files vLLM skips), and a file beside another."""
    alone = tmp_path / "alone"
    alone.mkdir()
    write_safetensors(alone / "model.safetensors",
                      [("z.weight", "BF16", [2, 3]), ("a.bias", "F32", [3]), ("s", "I64", [])])
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    write_safetensors(sharded / "model-00002-of-00002.safetensors", [("layer.1.w", "F16", [4])])
    write_safetensors(sharded / "model-00001-of-00002.safetensors", [("layer.0.w", "F16", [4]),
                                                                    ("embed", "BF16", [8, 2])])
    write_safetensors(sharded / "consolidated-stale.bin.safetensors.old", [("x", "U8", [1])])
    write_safetensors(sharded / "stray.safetensors", [("stray", "U8", [1])])  # not in the index
    write_safetensors(sharded / ".hidden.safetensors", [("hidden", "U8", [1])])
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "layer.0.w": "model-00001-of-00002.safetensors", "embed": "model-00001-of-00002.safetensors",
        "layer.1.w": "model-00002-of-00002.safetensors"}}))
    crowded = tmp_path / "crowded"
    crowded.mkdir()
    write_safetensors(crowded / "a.safetensors", [("a", "U8", [2])])
    write_safetensors(crowded / "b.safetensors", [("b", "U8", [2])])
    return {"alone": str(alone), "file": str(alone / "model.safetensors"),
            "sharded": str(sharded), "crowded_file": str(crowded / "a.safetensors"),
            "tmp": tmp_path}


def test_digest_is_the_canonical_form_in_data_order(ckpt):
    # Proves one file's digest is SHA-256 of effects/manifest.h's canonical form with the tensors
    # in data-offset order, whatever the header's order; would catch a digest over the header's
    # key order or torch/safetensors dtype names mixed up (the C++ would then refuse the update).
    m = FakeWorker().rc_checkpoint_manifest(ckpt["file"])
    assert m["error"] == ""
    assert m["manifest_digest"] == canonical(["z.weight\tbfloat16\t2,3\n", "a.bias\tfloat32\t3\n",
                                              "s\tint64\t\n"])
    assert (m["tensors"], m["bytes"], m["files"]) == (3, 12 + 12 + 8, 1)
    assert m["weights_path"] == ckpt["alone"], "vLLM is given the file's directory"
    assert m["load_format"] == "auto"


def test_a_directory_is_what_vllm_would_load(ckpt):
    # Proves a directory's manifest covers exactly the files vLLM's default loader reads (the
    # index's shards in name order; no stray, hidden or non-matching file), and that a directory
    # holding one file has that file's digest; would catch a manifest over files the engine does
    # not load, which would let a wrong checkpoint pass preflight.
    m = FakeWorker("safetensors").rc_checkpoint_manifest(ckpt["sharded"])
    assert m["error"] == ""
    assert m["manifest_digest"] == canonical(["layer.0.w\tfloat16\t4\n", "embed\tbfloat16\t8,2\n",
                                              "layer.1.w\tfloat16\t4\n"])
    assert (m["files"], m["tensors"], m["weights_path"]) == (2, 3, ckpt["sharded"])
    assert FakeWorker().rc_checkpoint_manifest(ckpt["alone"])["manifest_digest"] == \
        FakeWorker().rc_checkpoint_manifest(ckpt["file"])["manifest_digest"]


def test_refusals_say_why_and_quote_no_content(ckpt):
    # Proves every checkpoint reload_weights could not load cleanly is refused with a reason and
    # no digest, and that no reason quotes a tensor name from the file; would catch a preflight
    # that lets `--load-format dummy` or a missing path reach reload_weights (which fails only
    # after it has taken the model's layers apart).
    tmp = ckpt["tmp"]
    truncated = tmp / "truncated"
    truncated.mkdir()
    path = write_safetensors(truncated / "m.safetensors", [("secret-name", "F32", [4])])
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)
    huge = tmp / "huge"
    huge.mkdir()
    (huge / "m.safetensors").write_bytes(struct.pack("<Q", (100 << 20) + 1) + b"{}")
    gap = tmp / "gap"
    gap.mkdir()
    raw = json.dumps({"secret-name": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}).encode()
    (gap / "m.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"xx")
    cases = [(FakeWorker("dummy"), ckpt["alone"], "dummy"),
             (FakeWorker("pt"), ckpt["alone"], "load_format 'pt'"),
             (FakeWorker(), str(tmp / "missing"), "no such file"),
             (FakeWorker(), "relative/path", "absolute"),
             (FakeWorker(), ckpt["crowded_file"], "loads a directory"),
             (FakeWorker(), str(truncated), "data section"),
             (FakeWorker(), str(huge), "header length exceeds"),
             (FakeWorker(), str(gap), "gap")]
    for worker, path, why in cases:
        m = worker.rc_checkpoint_manifest(path)
        assert m["manifest_digest"] == "" and why in m["error"], (path, m)
        assert "secret-name" not in m["error"]


def test_double_answers_like_the_extension(engine, ckpt):
    # Proves the vLLM double's rc_checkpoint_manifest (C++, fixtures/double_checkpoint.cc) gives
    # the extension's digest, counts and directory for the same files, and refuses what it
    # refuses; would catch the double and the extension drifting apart, which would make the C++
    # transfer's tests prove nothing about a real engine.
    for path in [ckpt["file"], ckpt["alone"], ckpt["sharded"], ckpt["crowded_file"],
                 str(ckpt["tmp"] / "missing")]:
        got = rpc(engine, "rc_checkpoint_manifest", [path])["results"][0]
        want = FakeWorker().rc_checkpoint_manifest(path)
        for key in ("manifest_digest", "tensors", "bytes", "files", "weights_path", "load_format"):
            assert got[key] == want[key], (path, key, got, want)
        assert (got["error"] == "") == (want["error"] == ""), (path, got, want)


def test_reload_through_serve_commits_what_the_cpp_digest_accepts(engine, ckpt, tmp_path):
    # Proves the extension's digest is the C++ one of the same file (the update route recomputes
    # it with effects/nccl/weight_source.cc and answers 422 on any difference), and that `serve
    # --transfer reload` then commits with the engine's digest of the reloaded weights; would
    # catch a Python twin of the manifest that disagrees with the C++ on any byte.
    v1 = tmp_path / "v1"
    v1.mkdir()
    src1 = "safetensors:" + write_safetensors(v1 / "model.safetensors",
                                              [("model.layers.0.weight", "BF16", [4, 4])], fill=7)
    proc, addr = _start([str(BUILD / "cli" / "rolloutcore"), "serve", "--engine-url", engine,
                         "--journal", str(tmp_path / "journal"), "--port", "0", "--auth-token",
                         TOKEN, "--transfer", "reload", "--initial-source",
                         "safetensors:" + ckpt["file"], "--initial-checkpoint", "v0"],
                        "rolloutcore serve")
    try:
        c = rolloutcore.Client("http://" + addr, TOKEN)
        python_digest = checkpoint_manifest(src1[len("safetensors:"):])["manifest_digest"]
        assert c.manifest_digest(src1) == python_digest  # the double's C++, through preflight
        ident = rolloutcore.Identity(python_digest, checkpoint="v1", step=1)
        assert c.update("rc-1", ident, src1, update_id="py-reload")["outcome"] == "committed"
        committed = c.state(full=True)["committed_digest"]["combined"]
        assert committed == rpc(engine, "rc_weight_digest")["results"][0]["combined"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
