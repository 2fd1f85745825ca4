"""Client.sleep / Client.wake (colocated mode) against a local HTTP stub that answers as the trainer
API promises: the request each sends, and how each answer maps to a return or an exception (the
same mapping as update() and restore())."""
import http.server
import json
import threading

import pytest

import rolloutcore

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
