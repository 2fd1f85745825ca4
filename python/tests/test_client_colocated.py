"""Client.sleep / Client.wake (colocated mode): against a real `rolloutcore serve --transfer ipc`
and vllm-double in colocated mode (the calls work end to end), and against a local HTTP stub for
the exact request each sends and the answers a healthy serve cannot be made to give on cue
(503 outcome_unknown after a fail-stop), mapped as update() and restore() map them."""
import http.server
import json
import signal
import threading

import pytest

import rolloutcore
from conftest import BUILD, _start

TOKEN = "stub-token"


class Stub:
    """One canned answer at a time; every request is recorded (method, path, headers, body)."""

    def __init__(self):
        self.requests = []
        self.answer = (200, {}, {})
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                stub.requests.append({"method": "POST", "path": self.path,
                                      "auth": self.headers.get("Authorization"),
                                      "body": json.loads(raw) if raw else None})
                status, body, headers = stub.answer
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    s = Stub()
    yield s
    s.close()


def test_sleep_posts_its_level_and_id_with_the_token(stub):
    # Proves sleep() sends {"sleep_id", "level"} to POST /v1/sleep with the bearer token and
    # returns the committed answer; would catch a wrong route or body that serve answers 400,
    # or an unauthenticated call (401).
    answer = {"sleep_id": "s-1", "outcome": "committed", "level": 2, "lifecycle": "SLEEPING",
              "freed_bytes": 123, "reason": "engine sleeps"}
    stub.answer = (200, answer, {})
    c = rolloutcore.Client(stub.url, TOKEN)
    assert c.sleep(2, sleep_id="s-1") == answer
    assert stub.requests == [{"method": "POST", "path": "/v1/sleep", "auth": "Bearer " + TOKEN,
                              "body": {"sleep_id": "s-1", "level": 2}}]


def test_wake_posts_its_id_with_the_token(stub):
    # Proves wake() sends {"wake_id"} to POST /v1/wake with the token; would catch a body with
    # fields serve refuses (unknown fields are 400).
    stub.answer = (200, {"wake_id": "w-1", "outcome": "committed"}, {})
    c = rolloutcore.Client(stub.url, TOKEN)
    assert c.wake(wake_id="w-1")["outcome"] == "committed"
    assert stub.requests == [{"method": "POST", "path": "/v1/wake", "auth": "Bearer " + TOKEN,
                              "body": {"wake_id": "w-1"}}]


def test_default_ids_are_fresh_per_call(stub):
    # Proves each call without an id gets a new one; would catch a fixed default id, under
    # which a second sleep or wake would replay the first one's recorded outcome.
    stub.answer = (200, {"outcome": "committed"}, {})
    c = rolloutcore.Client(stub.url, TOKEN)
    c.sleep(1)
    c.sleep(1)
    c.wake()
    c.wake()
    sleeps = [r["body"]["sleep_id"] for r in stub.requests if r["path"] == "/v1/sleep"]
    wakes = [r["body"]["wake_id"] for r in stub.requests if r["path"] == "/v1/wake"]
    assert all(i.startswith("sleep-") for i in sleeps) and len(set(sleeps)) == 2
    assert all(i.startswith("wake-") for i in wakes) and len(set(wakes)) == 2


@pytest.mark.parametrize("level", [0, 3, True, "1", None])
def test_sleep_refuses_a_level_other_than_1_or_2_without_a_request(stub, level):
    # Proves a level serve cannot take is a ValueError before anything is sent; would catch
    # level=True passing as 1.
    with pytest.raises(ValueError):
        rolloutcore.Client(stub.url, TOKEN).sleep(level)
    assert stub.requests == []


def call(stub, route):
    c = rolloutcore.Client(stub.url, TOKEN)
    if route == "sleep":
        return c.sleep(1, sleep_id="s-9")
    return c.wake(wake_id="w-9")


@pytest.mark.parametrize("route", ["sleep", "wake"])
def test_error_answers_map_as_for_updates(stub, route):
    # Proves 409 -> UpdateConflict, 422/500 outcome bodies -> UpdateFailed with outcome and
    # reason, 503 outcome_unknown -> OutcomeUnknown naming the id sent, other 503 ->
    # Unavailable with Retry-After, 400 -> RolloutCoreError; would catch a trainer that reads a
    # tainted sleep as a transport error or retries an unknown outcome under a new id.
    sent_id = "s-9" if route == "sleep" else "w-9"
    stub.answer = (409, {"error": {"message": "not READY", "type": "conflict"}}, {})
    with pytest.raises(rolloutcore.UpdateConflict):
        call(stub, route)
    for status, outcome in ((422, "refused"), (500, "tainted")):
        stub.answer = (status, {"outcome": outcome, "reason": "why " + outcome}, {})
        with pytest.raises(rolloutcore.UpdateFailed) as e:
            call(stub, route)
        assert (e.value.status, e.value.outcome, e.value.reason) == \
            (status, outcome, "why " + outcome)
    stub.answer = (503, {"error": {"message": "stopped", "type": "outcome_unknown"}}, {})
    with pytest.raises(rolloutcore.OutcomeUnknown) as unknown:
        call(stub, route)
    assert unknown.value.update_id == sent_id
    stub.answer = (503, {"error": {"message": "shutting down", "type": "unavailable"}},
                   {"Retry-After": "3"})
    with pytest.raises(rolloutcore.Unavailable) as busy:
        call(stub, route)
    assert busy.value.retry_after_s == 3
    stub.answer = (400, {"error": {"message": "bad body", "type": "invalid_request"}}, {})
    with pytest.raises(rolloutcore.RolloutCoreError) as bad:
        call(stub, route)
    assert type(bad.value) is rolloutcore.RolloutCoreError and bad.value.status == 400


# ---- against a real `rolloutcore serve --transfer ipc` and vllm-double in colocated mode ----


def _colocated_stack(tmp_path):

    engine, eaddr = _start([str(BUILD / "fixtures" / "vllm-double"), "--port", "0",
                            "--token-delay-ms", "2", "--worker-extension-cls",
                            "rolloutcore.vllm_ext.RolloutCoreWorkerExtension",
                            "--weight-transfer-backend", "ipc", "--allow-insecure-serialization",
                            "--enable-sleep-mode"], "vllm-double")
    serve, saddr = _start([str(BUILD / "cli" / "rolloutcore"), "serve", "--engine-url",
                           "http://" + eaddr, "--journal", str(tmp_path / "journal"), "--port",
                           "0", "--auth-token", TOKEN, "--transfer", "ipc", "--initial-manifest",
                           "a" * 64, "--initial-run", "py", "--initial-step", "0"],
                           "rolloutcore serve")
    return engine, serve, "http://" + saddr


@pytest.fixture
def colocated(tmp_path):
    engine, serve, url = _colocated_stack(tmp_path)
    yield url
    for p in (serve, engine):
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)


def test_real_serve_sleeps_wakes_and_refuses_a_level_two_wake(colocated):
    # Proves the client's sleep() and wake() drive a real serve through SLEEPING and back
    # (level 1), and that a wake-up after level 2 is the 409 UpdateConflict; would catch a body or
    # route the real serve refuses, or a client that hides the refusal.
    c = rolloutcore.Client(colocated, TOKEN)
    slept = c.sleep(1, sleep_id="py-s1")
    assert slept["outcome"] == "committed" and slept["state"]["lifecycle"] == "SLEEPING"
    assert c.state()["sleep_level"] == 1
    woke = c.wake(wake_id="py-w1")
    assert woke["outcome"] == "committed" and woke["state"]["lifecycle"] == "READY"
    assert c.sleep(2, sleep_id="py-s2")["state"]["sleep_level"] == 2
    with pytest.raises(rolloutcore.UpdateConflict):
        c.wake(wake_id="py-w2")
    assert c.state()["lifecycle"] == "SLEEPING"
