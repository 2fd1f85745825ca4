"""Fixtures: a real `vllm-double` process and a real `rolloutcore serve` process on loopback.

Binaries come from $RC_BUILD (default: ../build relative to this package).
"""
import os
import pathlib
import signal
import subprocess
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("RC_BUILD", ROOT / "build"))
TOKEN = "py-test-token"


def _start(cmd, what):
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        line = proc.stdout.readline()
        if line.startswith("listening on "):
            return proc, line.split()[-1].strip()
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
    proc.kill()
    raise RuntimeError(f"{what} did not start")


@pytest.fixture
def engine():
    proc, addr = _start([str(BUILD / "fixtures" / "vllm-double"), "--port", "0",
                         "--token-delay-ms", "2", "--worker-extension-cls",
                         "rolloutcore.vllm_ext.RolloutCoreWorkerExtension"], "vllm-double")
    yield "http://" + addr
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


class Serve:
    def __init__(self, engine_url, tmp_path):
        self.engine_url = engine_url
        self.journal = tmp_path / "journal"
        self.proc = None
        self.url = None

    def start(self):
        self.proc, addr = _start(
            [str(BUILD / "cli" / "rolloutcore"), "serve", "--engine-url", self.engine_url,
             "--journal", str(self.journal), "--port", "0", "--auth-token", TOKEN,
             "--initial-source", "synthetic:4x64", "--initial-checkpoint", "ckpt-0",
             "--initial-run", "py", "--initial-step", "0", "--shutdown-grace-ms", "5000"],
            "rolloutcore serve")
        self.url = "http://" + addr
        return self

    def stop(self, sig=signal.SIGTERM):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
        return self.proc.returncode


@pytest.fixture
def serve(engine, tmp_path):
    s = Serve(engine, tmp_path).start()
    yield s
    s.stop(signal.SIGKILL)
