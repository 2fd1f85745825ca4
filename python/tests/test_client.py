"""The Python client against a real `rolloutcore serve` and `vllm-double` on loopback."""
import json
import os
import signal
import subprocess
import urllib.request

import pytest

import rolloutcore
from conftest import BUILD, TOKEN

SOURCE = "synthetic:4x64"


def proxied(url, prompt="hello"):
    req = urllib.request.Request(url + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": prompt, "max_tokens": 4}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return dict(r.headers), json.loads(r.read())


def test_update_commits_and_state_reports_it(serve):
    # Proves update() returns only once the new version is committed and state() shows it;
    # would catch a client that returns before the commit or misreads the answer.
    c = rolloutcore.Client(serve.url, TOKEN)
    assert c.state()["lifecycle"] == "READY"
    ident = rolloutcore.Identity(c.manifest_digest(SOURCE), checkpoint="ckpt-1", run="py", step=1)
    result = c.update("rc-1", ident, SOURCE, update_id="py-u1")
    assert result["outcome"] == "committed"
    v = c.version()
    assert v["version"] == {"generation": 1, "label": "rc-1"}
    assert v["identity"]["step"] == 1


def test_mismatched_manifest_is_refused_before_anything_is_journaled(serve):
    # Proves an update whose declared manifest differs from the source's is refused with 422
    # before the engine is drained or anything is journaled; would catch failures reported as
    # success, and a bad request that pauses the engine to find out.
    c = rolloutcore.Client(serve.url, TOKEN)
    head = c.state()["head_seq"]
    ident = rolloutcore.Identity("ab" * 32, checkpoint="wrong", step=1)
    with pytest.raises(rolloutcore.RolloutCoreError) as e:
        c.update("rc-1", ident, SOURCE, update_id="py-bad")
    assert e.value.status == 422
    assert "manifest" in e.value.message
    assert c.state()["lifecycle"] == "READY"
    assert c.state()["head_seq"] == head


def test_wrong_token_is_refused_and_journals_nothing(serve):
    # Proves a wrong token gets 403 and writes nothing; would catch open mutating routes.
    head = rolloutcore.Client(serve.url).state()["head_seq"]
    with pytest.raises(rolloutcore.RolloutCoreError) as e:
        rolloutcore.Client(serve.url, "nope").admit("r-x")
    assert e.value.status == 403
    assert rolloutcore.Client(serve.url).state()["head_seq"] == head


def test_rollout_context_manager_records_completion_and_abort(serve):
    # Proves the rollout() block binds to the committed version and records completed/aborted
    # with token counts; would catch a context manager that leaks active rollouts.
    c = rolloutcore.Client(serve.url, TOKEN)
    with c.rollout("py-ok") as b:
        assert b.label == "rc-0"
        assert c.state()["active_rollouts"] == 1
        b.prompt_tokens, b.completion_tokens = 5, 7
    with pytest.raises(KeyError):
        with c.rollout("py-fail"):
            raise KeyError("trainer bug")
    st = c.state()
    assert st["active_rollouts"] == 0
    assert st["counters"]["rollouts_completed"] == 1
    assert st["counters"]["rollouts_aborted"] == 1
    finished = [r["event"] for r in c.events(0)["records"]
                if r["event"]["type"] == "RolloutFinished"]
    assert any(f["rollout_id"] == "py-ok" and f["completion_tokens"] == 7 for f in finished)


def test_proxy_headers_agree_with_the_journal(serve):
    # Proves a proxied request's binding headers name the version its RolloutAdmitted recorded;
    # would catch headers and journal drifting apart across an update.
    c = rolloutcore.Client(serve.url, TOKEN)
    h0, body = proxied(serve.url)
    assert body["choices"] and "token_ids" not in body["choices"][0]
    ident = rolloutcore.Identity(c.manifest_digest(SOURCE), checkpoint="ckpt-1", step=1)
    c.update("rc-1", ident, SOURCE, update_id="py-u1")
    h1, _ = proxied(serve.url)
    assert (h0["X-RolloutCore-Version"], h1["X-RolloutCore-Version"]) == ("rc-0", "rc-1")
    admitted = {r["event"]["rollout_id"]: r["event"]["version"]["label"]
                for r in c.events(0)["records"] if r["event"]["type"] == "RolloutAdmitted"}
    assert admitted[h0["X-RolloutCore-Rollout-Id"]] == "rc-0"
    assert admitted[h1["X-RolloutCore-Rollout-Id"]] == "rc-1"


def test_watch_long_poll_sees_the_update(serve):
    # Proves watch() returns a change after an update's decisions; would catch a long-poll that
    # never wakes or reports stale state.
    c = rolloutcore.Client(serve.url, TOKEN)
    seq = c.watch(0, timeout_ms=10)["seq"]
    ident = rolloutcore.Identity(c.manifest_digest(SOURCE), step=1)
    c.update("rc-1", ident, SOURCE, update_id="py-w1")
    w = c.watch(seq, timeout_ms=5000)
    assert w["changed"] and w["committed"]["label"] == "rc-1"


def test_sigterm_drains_and_sigkill_loses_nothing_acknowledged(serve):
    # Proves SIGTERM exits cleanly (journal closed, reopenable) and that an admission
    # acknowledged before SIGKILL is in the journal after restart (an explicit rollout keeps its
    # lease across restarts, so it is still active, not abandoned); would catch acknowledging
    # before durability, a shutdown that corrupts the journal, or a restart that abandons the
    # rollouts of live clients.
    c = rolloutcore.Client(serve.url, TOKEN)
    c.admit("py-acked")
    assert serve.stop(signal.SIGTERM) == 0
    serve.start()
    c = rolloutcore.Client(serve.url, TOKEN)
    st = c.state()
    assert st["counters"]["rollouts_abandoned"] == 0
    assert st["active_rollouts"] == 1
    c.admit("py-acked-2")
    serve.stop(signal.SIGKILL)
    serve.start()
    c = rolloutcore.Client(serve.url, TOKEN)
    st = c.state()
    assert st["counters"]["rollouts_abandoned"] == 0
    assert st["counters"]["rollouts_admitted"] == 2
    assert st["active_rollouts"] + st["counters"]["rollouts_expired"] == 2
    assert "rolloutcore_lifecycle_state{state=\"READY\"} 1" in c.metrics()


def test_refused_update_can_be_retried_under_the_default_id(serve):
    # Proves update() without an update_id can be called again after a refusal (each call gets a
    # fresh id) and that re-sending one explicit id answers its recorded outcome; would catch the
    # old default id `update-<label>`, under which a refused update could never be retried.
    c = rolloutcore.Client(serve.url, TOKEN)
    ident = rolloutcore.Identity(c.manifest_digest(SOURCE), checkpoint="ckpt-1", run="py", step=1)
    # A journaled refusal: the engine answers /pause with 500 three times (the drain's retries).
    fault = {"routes": {"/pause": {"status": 500, "times": 3}}}
    req = urllib.request.Request(serve.engine_url + "/_double/faults", method="POST",
                                 data=json.dumps(fault).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).close()
    with pytest.raises(rolloutcore.UpdateFailed) as e:
        c.update("rc-1", ident, SOURCE)
    assert e.value.outcome == "refused"
    assert c.update("rc-1", ident, SOURCE)["outcome"] == "committed"
    again = c.update("rc-2", ident, SOURCE, update_id="py-explicit")
    replay = c.update("rc-2", ident, SOURCE, update_id="py-explicit")
    assert again["outcome"] == replay["outcome"] == "committed"
    assert replay["replayed"] is True
    assert c.version()["version"]["generation"] == 2


def test_rollout_block_renews_its_lease(serve):
    # Proves the rollout() block renews its lease in the background, so a block that outlives
    # the lease is recorded completed, not expired; would catch leases that lapse under a live
    # client (rollouts recorded expired while their client still works).
    import time
    c = rolloutcore.Client(serve.url, TOKEN)
    with c.rollout("py-long", lease_ms=1000) as b:
        assert b.lease_ms == 1000
        time.sleep(2.5)
        b.prompt_tokens, b.completion_tokens = 3, 4
    counters = c.state()["counters"]
    assert counters["rollouts_expired"] == 0
    assert counters["rollouts_completed"] == 1


def test_readyz_and_healthz(serve):
    # Proves /readyz answers ready on a READY executor with a reachable engine and /healthz is
    # liveness; would catch orchestrators routing rollouts by a health check that ignores state.
    c = rolloutcore.Client(serve.url, TOKEN)
    assert c.ready()["ready"] is True
    with urllib.request.urlopen(serve.url + "/healthz", timeout=10) as r:
        assert json.loads(r.read())["ok"] is True


def _double_faults(engine_url, doc, path="/_double/faults"):
    req = urllib.request.Request(engine_url + path, method="POST",
                                 data=json.dumps(doc).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_restore_with_proof_through_the_client_and_the_cli(serve, engine):
    # Proves Client.restore and `rolloutcore restore` take a TAINTED engine back to an earlier
    # version only on the recorded digest: a wrong source raises UpdateFailed (tainted) and leaves
    # it TAINTED, the right one (through the CLI, token from RC_AUTH_TOKEN) commits; would catch
    # a client that hides a failed restore or a CLI that exits 0 on one.
    c = rolloutcore.Client(serve.url, TOKEN)
    src1, src2 = "synthetic:4x64:1", "synthetic:4x64:2"
    c.update("rc-1", rolloutcore.Identity(c.manifest_digest(src1), checkpoint="c1", step=1), src1)
    _double_faults(engine, {"routes": {"/update_weights": {"status": 500}}})
    with pytest.raises(rolloutcore.UpdateFailed) as e:
        c.update("rc-2", rolloutcore.Identity(c.manifest_digest(src2), checkpoint="c2", step=2),
                 src2)
    assert e.value.outcome == "tainted"
    _double_faults(engine, {}, path="/_double/faults/clear")
    with pytest.raises(ValueError):
        c.restore("rc-1")  # neither a source nor adopt
    with pytest.raises(rolloutcore.UpdateFailed) as wrong:
        c.restore("rc-1", source=src2, restore_id="py-wrong")
    assert wrong.value.outcome == "tainted"
    assert "recorded when 'rc-1' was served" in wrong.value.reason, wrong.value.reason
    assert c.state()["lifecycle"] == "TAINTED"
    env = dict(os.environ, RC_AUTH_TOKEN=TOKEN)
    cli = subprocess.run([str(BUILD / "cli" / "rolloutcore"), "restore", "--url", serve.url,
                          "--label", "rc-1", "--source", src1], env=env, capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "committed" in cli.stdout
    s = c.state()
    assert s["lifecycle"] == "READY" and s["committed"]["label"] == "rc-1"
    assert s["counters"]["restores_committed"] == 1
