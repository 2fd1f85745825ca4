"""The Python client against a real `rolloutcore serve` driving a fleet of two `vllm-double`s."""
import json
import signal
import urllib.request

import pytest

import rolloutcore
from conftest import BUILD, TOKEN, _start

SOURCE = "synthetic:4x64"


@pytest.fixture
def fleet(tmp_path):
    engines = [_start([str(BUILD / "fixtures" / "vllm-double"), "--port", "0",
                       "--token-delay-ms", "2", "--worker-extension-cls",
                       "rolloutcore.vllm_ext.RolloutCoreWorkerExtension"], "vllm-double")
               for _ in range(2)]
    cmd = [str(BUILD / "cli" / "rolloutcore"), "serve", "--journal", str(tmp_path / "journal"),
           "--port", "0", "--auth-token", TOKEN, "--initial-source", SOURCE,
           "--initial-checkpoint", "ckpt-0", "--initial-run", "py", "--initial-step", "0",
           "--shutdown-grace-ms", "5000"]
    for i, (_, addr) in enumerate(engines):
        cmd += ["--fleet-engine", f"e{i}=http://{addr}"]
    serve, addr = _start(cmd, "rolloutcore serve")
    yield "http://" + addr
    serve.send_signal(signal.SIGKILL)
    serve.wait(timeout=30)
    for proc, _ in engines:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def proxied(url):
    req = urllib.request.Request(url + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": "hi", "max_tokens": 2}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return dict(r.headers)


def test_fleet_update_moves_every_engine_and_rollouts_name_theirs(fleet):
    # Proves `serve --fleet-engine` drives both engines: a rolling fleet_update() commits on
    # each, later rollouts are bound to the new label on an engine the answer names, and a
    # removed engine gets none; would catch a client or CLI that drives only one engine.
    c = rolloutcore.Client(fleet, TOKEN)
    state = c.state()
    assert sorted(state["engines"]) == ["e0", "e1"]
    ident = rolloutcore.Identity(c.manifest_digest(SOURCE), checkpoint="ckpt-1", run="py", step=1)
    end = c.fleet_update("rc-1", ident, SOURCE, mode="rolling", update_id="py-f1")
    assert end["outcome"] == "committed" and end["committed"] == 2
    assert all(e["committed"]["label"] == "rc-1" for e in c.state()["engines"].values())
    again = c.fleet_update("rc-1", ident, SOURCE, mode="rolling", update_id="py-f1")
    assert again["outcome"] == "committed"
    headers = proxied(fleet)
    assert headers["X-RolloutCore-Version"] == "rc-1"
    assert headers["X-RolloutCore-Engine"] in ("e0", "e1")
    c.remove_engine("e1")
    assert all(proxied(fleet)["X-RolloutCore-Engine"] == "e0" for _ in range(5))
    with pytest.raises(rolloutcore.UpdateConflict):
        c.update("rc-2", ident, SOURCE)  # one engine's route: 409 on a fleet
    with pytest.raises(ValueError):
        c.fleet_update("rc-2", ident, SOURCE, mode="sideways")
