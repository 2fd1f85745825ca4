"""HTTP client for the RolloutCore trainer API (docs/api.md)."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import Any, Dict, Iterator, Optional


class RolloutCoreError(Exception):
    """An error answer from the executor: HTTP status, error type and message, full body."""

    def __init__(self, status: int, message: str, body: Optional[dict] = None):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.body = body or {}


class UpdateConflict(RolloutCoreError):
    """409: another update is running, or the lifecycle refused the request (e.g. TAINTED)."""


class UpdateFailed(RolloutCoreError):
    """The update (restore, sleep, wake) ended refused (422) or tainted (500); `outcome` and
    `reason` say which/why."""

    @property
    def outcome(self) -> Optional[str]:
        return self.body.get("outcome")

    @property
    def reason(self) -> str:
        return self.body.get("reason", "")


class OutcomeUnknown(RolloutCoreError):
    """503 outcome_unknown: the executor fail-stopped before the request's outcome was durable,
    or the plan stalled at an engine that stopped answering (serve tries it again once the
    engine answers).

    Nothing was decided for the trainer: once the executor is back, make the same call again
    with the SAME id (`self.update_id`: the update_id, restore_id, sleep_id or wake_id sent) to
    read the outcome that was recorded; never assume the request failed.
    """

    @property
    def update_id(self) -> str:
        return self.body.get("update_id", "")


class Unavailable(RolloutCoreError):
    """503: not READY within the wait, TAINTED, or shutting down; `retry_after_s` when given."""

    def __init__(self, status, message, body=None, retry_after_s=None):
        super().__init__(status, message, body)
        self.retry_after_s = retry_after_s


@dataclasses.dataclass
class Identity:
    """What a weight generation is declared to contain (WeightIdentity)."""

    manifest_digest: str
    checkpoint: str = ""
    run: str = ""
    step: int = -1
    content_digest: str = ""

    def to_json(self) -> dict:
        d = {"manifest_digest": self.manifest_digest, "checkpoint": self.checkpoint,
             "run": self.run, "step": self.step}
        if self.content_digest:
            d["content_digest"] = self.content_digest
        return d


@dataclasses.dataclass
class RolloutBinding:
    """The committed version a rollout was admitted under."""

    rollout_id: str
    admission_seq: int
    version: dict
    identity: dict
    cache_salt: str
    lease_ms: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    outcome: str = "completed"

    @property
    def label(self) -> str:
        return self.version["label"]

    @property
    def generation(self) -> int:
        return self.version["generation"]


# The routes that answer an outcome body (committed / refused / tainted), and their id fields.
_OUTCOME_ROUTES = ("/v1/updates", "/v1/restores", "/v1/sleep", "/v1/wake", "/v1/fleet/updates")
FLEET_MODES = ("all", "rolling")
_REQUEST_IDS = ("update_id", "restore_id", "sleep_id", "wake_id")
SLEEP_LEVELS = (1, 2)


class Client:
    """Client(url, token): the trainer's handle on one `rolloutcore serve` process."""

    def __init__(self, url: str, token: Optional[str] = None, timeout_s: float = 30.0,
                 update_timeout_s: float = 3600.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.update_timeout_s = update_timeout_s

    # ---- plumbing ----
    def _request(self, method: str, path: str, body: Any = None, timeout_s: Optional[float] = None,
                 auth: bool = False) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if auth and self.token:
            req.add_header("Authorization", "Bearer " + self.token)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                raw = resp.read()
                return json.loads(raw) if raw else {}
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                doc = json.loads(raw)
            except ValueError:
                doc = {"error": {"message": raw.decode(errors="replace")}}
            err = doc.get("error") or {}
            message = err.get("message") if isinstance(err, dict) else str(err)
            message = message or doc.get("reason") or f"HTTP {e.code}"
            if e.code == 409:
                raise UpdateConflict(e.code, message, doc) from None
            if e.code == 503 and isinstance(err, dict) and err.get("type") == "outcome_unknown":
                sent = body or {}
                doc.setdefault("update_id", next((sent[k] for k in _REQUEST_IDS if sent.get(k)), ""))
                raise OutcomeUnknown(e.code, message, doc) from None
            if e.code == 503:
                ra = e.headers.get("Retry-After")
                raise Unavailable(e.code, message, doc, int(ra) if ra else None) from None
            if path.startswith(_OUTCOME_ROUTES) and e.code in (422, 500) and "outcome" in doc:
                raise UpdateFailed(e.code, message, doc) from None
            raise RolloutCoreError(e.code, message, doc) from None

    # ---- trainer API ----
    def state(self, full: bool = False) -> dict:
        """The lifecycle, committed version and identity, active rollouts, taint."""
        return self._request("GET", "/v1/state" + ("?full=1" if full else ""))

    def version(self) -> dict:
        return self._request("GET", "/v1/version")

    def manifest_digest(self, source: str) -> str:
        """The manifest digest of a weight source as the executor computes it (needs the token:
        the executor opens files on its host for it)."""
        q = urllib.parse.urlencode({"source": source})
        return self._request("GET", "/v1/manifest?" + q, auth=True)["manifest_digest"]

    def update(self, label: str, identity: Identity, source: str,
               update_id: Optional[str] = None, expected_digest: Optional[str] = None) -> dict:
        """Moves the engine to a new committed version; returns when it is committed.

        Raises UpdateFailed (refused/tainted, with .outcome and .reason), UpdateConflict (409),
        OutcomeUnknown (503: the executor stopped before the outcome was durable).
        `source`: "safetensors:/path", "ipc:/path/handles.json", "vllm-ipc:/path/handles.json"
        or "synthetic:<n>x<dim>". A `vllm-ipc:` source (rolloutcore.export_vllm_ipc) is the
        colocated path: the engine sleeps (`sleep()`), and the update wakes its weights, has vLLM
        read the trainer's GPU memory in place, and wakes its KV cache once the new version is
        proven. Keep the exported tensors alive and unchanged until this call has returned or
        raised (`IpcExport.release()` after it).

        `update_id` is the idempotency key: the same id with the same body answers the outcome
        recorded for it (a retry after a lost answer or an OutcomeUnknown); the same id with
        another body is refused (409). Default: a fresh unique id per call
        (`update-<label>-<uuid>`), so a refused update can simply be called again. Pass your own
        id, and reuse it only to retry the very same request.

        `expected_digest`: the combined weight digest (lowercase hex) you computed for the target
        in the engine's own layout (rolloutcore.digest over the engine's parameter shapes). When
        given, the update is published only if the engine's digest, taken while it is still
        paused, equals it; otherwise it is TAINTED and the reason names the tensors that differ.
        """
        if update_id is None:
            update_id = f"update-{label}-{uuid.uuid4().hex}"[-128:]
        body = {"update_id": update_id, "target_label": label,
                "identity": identity.to_json(), "source": source}
        if expected_digest:
            body["expected_digest"] = expected_digest
        return self._request("POST", "/v1/updates", body, timeout_s=self.update_timeout_s,
                             auth=True)

    def fleet_update(self, label: str, identity: Identity, source: str, mode: str = "all",
                     batch_max: int = 1, min_healthy: int = 1, update_id: Optional[str] = None,
                     expected_digest: Optional[str] = None) -> dict:
        """Moves a fleet (`serve` with `engines`) to a new version; returns when it ended.

        `mode` "all": every engine that can serve drains and updates at once; "rolling": at most
        `batch_max` at a time while the fleet's min_serving engines keep serving. Fewer than
        `min_healthy` engines able to take it: refused as a whole. Each engine commits, is refused
        or goes TAINTED on its own evidence.

        Returns the end when some engine committed: `outcome` "committed" (all) or "partial"
        (read each engine's state in `engines`). Raises UpdateFailed when none committed (422),
        UpdateConflict (409: another update runs, or the id was used for another request),
        OutcomeUnknown (503). `update_id` is the idempotency key, as update()'s.
        """
        if mode not in FLEET_MODES:
            raise ValueError(f"mode must be one of {FLEET_MODES}")
        if update_id is None:
            update_id = f"fleet-{label}-{uuid.uuid4().hex}"[-128:]
        body = {"update_id": update_id, "target_label": label, "identity": identity.to_json(),
                "source": source, "mode": mode, "batch_max": batch_max,
                "min_healthy": min_healthy}
        if expected_digest:
            body["expected_digest"] = expected_digest
        return self._request("POST", "/v1/fleet/updates", body, timeout_s=self.update_timeout_s,
                             auth=True)

    def cancel_fleet_update(self, update_id: str, reason: Optional[str] = None) -> dict:
        """Cancels an open fleet update: members not started are skipped.

        Returns the acknowledgement (202; a retry while the update is open says "already").
        Once the update ended, returns its recorded end as a re-POST would (200 committed,
        207 partial, "replayed": true) or raises UpdateFailed for a recorded refusal (422).
        """
        body = {"reason": reason} if reason else {}
        return self._request("POST", f"/v1/fleet/updates/{urllib.parse.quote(update_id, safe='')}"
                             "/cancel", body, auth=True)

    def remove_engine(self, name: str) -> dict:
        """The engine admits nothing more and leaves the fleet once its last rollout ended."""
        return self._request("DELETE", f"/v1/fleet/engines/{urllib.parse.quote(name, safe='')}",
                             auth=True)

    def restore(self, label: str, source: Optional[str] = None, adopt: bool = False,
                restore_id: Optional[str] = None) -> dict:
        """Takes a TAINTED engine back to `label`, a version committed earlier in this journal.

        The engine reloads that version's weights from `source` (the same URIs as update()), or,
        with `adopt=True`, is taken as already holding them (an engine restarted on that
        checkpoint). Either way the engine's weight digest, taken while it is still paused, must
        equal the one recorded when `label` was served; only then does it serve again.

        Returns the answer when the restore committed (the engine is READY on `label`). Raises
        UpdateFailed when it was refused before anything changed or the reload failed or the
        digest differed (the engine stays TAINTED; .reason names the tensors that differ),
        UpdateConflict (409: not TAINTED, an update or restore is running, or the id was used for
        another request), OutcomeUnknown (503). `restore_id` is the idempotency key, as
        update()'s update_id.
        """
        if (source is None) == (not adopt):
            raise ValueError("restore() takes a source, or adopt=True, not both")
        if restore_id is None:
            restore_id = f"restore-{label}-{uuid.uuid4().hex}"[-128:]
        body = {"restore_id": restore_id, "label": label}
        if adopt:
            body["adopt"] = True
        else:
            body["source"] = source
        return self._request("POST", "/v1/restores", body, timeout_s=self.update_timeout_s,
                             auth=True)

    def sleep(self, level: int, sleep_id: Optional[str] = None) -> dict:
        """Colocated mode: drains the engine (rollouts in flight finish, none is admitted) and
        puts it to sleep so the trainer can use its GPU memory; returns once it sleeps
        (`lifecycle` "SLEEPING", `freed_bytes` as the engine's free memory changed, or None).

        `level` 1 keeps the weights in host memory (`wake()` restores them, or an update replaces
        them); 2 discards them, so only an update covering every parameter wakes it. Do not
        allocate on the GPU until this returns: vLLM measures what its sleep freed and fails if
        free memory shrank meanwhile.

        Raises UpdateConflict (409: not READY, or the id was used for another request),
        UpdateFailed (refused/tainted, with .outcome and .reason), OutcomeUnknown (503; retry
        with the same `sleep_id`, default a fresh `sleep-<uuid>`), Unavailable (503).
        """
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            raise ValueError(f"sleep(): level must be one of {SLEEP_LEVELS}, not {level!r}")
        if sleep_id is None:
            sleep_id = f"sleep-{uuid.uuid4().hex}"
        return self._request("POST", "/v1/sleep", {"sleep_id": sleep_id, "level": level},
                             timeout_s=self.update_timeout_s, auth=True)

    def wake(self, wake_id: Optional[str] = None) -> dict:
        """Wakes an engine asleep at level 1 on the version it served, without an update: the
        weights come back from host memory and must prove equal to the committed ones (label and
        weight digest) before it serves again; returns once it is READY.

        Raises UpdateConflict (409: not SLEEPING at level 1 — after level 2 only an update wakes
        it), UpdateFailed (refused/tainted), OutcomeUnknown (503; retry with the same `wake_id`,
        default a fresh `wake-<uuid>`), Unavailable (503).
        """
        if wake_id is None:
            wake_id = f"wake-{uuid.uuid4().hex}"
        return self._request("POST", "/v1/wake", {"wake_id": wake_id},
                             timeout_s=self.update_timeout_s, auth=True)

    def admit(self, rollout_id: Optional[str] = None, wait_ms: Optional[int] = None,
              lease_ms: Optional[int] = None) -> RolloutBinding:
        """Explicit admission. The rollout holds a lease (`lease_ms`, default the executor's
        rollout_lease_ms) that must be renewed (`renew_lease`) or it is recorded expired."""
        body: Dict[str, Any] = {}
        if rollout_id:
            body["rollout_id"] = rollout_id
        if wait_ms is not None:
            body["wait_ms"] = wait_ms
        if lease_ms is not None:
            body["lease_ms"] = lease_ms
        doc = self._request("POST", "/v1/rollouts", body, auth=True,
                            timeout_s=self.timeout_s + (wait_ms or 0) / 1000.0)
        return RolloutBinding(doc["rollout_id"], doc["admission_seq"], doc["version"],
                              doc["identity"], doc["cache_salt"], doc.get("lease_ms", 0))

    def renew_lease(self, rollout_id: str) -> dict:
        """Renews an explicit rollout's lease for another lease_ms (404 once it lapsed)."""
        q = urllib.parse.quote(rollout_id, safe="")
        return self._request("POST", f"/v1/rollouts/{q}/lease", {}, auth=True)

    def finish(self, rollout_id: str, outcome: str = "completed", prompt_tokens: int = 0,
               completion_tokens: int = 0) -> dict:
        q = urllib.parse.quote(rollout_id, safe="")
        return self._request("DELETE", f"/v1/rollouts/{q}",
                             {"outcome": outcome, "prompt_tokens": prompt_tokens,
                              "completion_tokens": completion_tokens}, auth=True)

    @contextlib.contextmanager
    def rollout(self, rollout_id: Optional[str] = None, wait_ms: Optional[int] = None,
                lease_ms: Optional[int] = None) -> Iterator[RolloutBinding]:
        """Explicit admission for clients that call the engine directly (not via the proxy).

        The engine's weights cannot change until the block exits. Set `binding.prompt_tokens` /
        `completion_tokens` inside the block; an exception records the rollout as aborted.
        Send `binding.cache_salt` as the request's cache_salt. A background thread renews the
        rollout's lease every lease_ms/3 while the block runs (it survives an executor restart
        while renewed; a process that dies stops renewing and the rollout is recorded expired).
        """
        binding = self.admit(rollout_id, wait_ms, lease_ms)
        stop = threading.Event()
        renewer = None
        if binding.lease_ms > 0:
            period_s = max(0.05, binding.lease_ms / 3000.0)

            def renew() -> None:
                while not stop.wait(period_s):
                    try:
                        self.renew_lease(binding.rollout_id)
                    except RolloutCoreError as e:
                        if e.status == 404:
                            return  # lapsed or finished: nothing left to renew
                    except OSError:
                        pass  # the executor may be restarting: keep trying

            renewer = threading.Thread(target=renew, name=f"rc-lease-{binding.rollout_id}",
                                       daemon=True)
            renewer.start()
        try:
            yield binding
        except BaseException:
            stop.set()
            if renewer:
                renewer.join()
            self.finish(binding.rollout_id, "aborted", binding.prompt_tokens,
                        binding.completion_tokens)
            raise
        stop.set()
        if renewer:
            renewer.join()
        self.finish(binding.rollout_id, binding.outcome, binding.prompt_tokens,
                    binding.completion_tokens)

    def ready(self) -> dict:
        """GET /readyz: {ready, reason?}; never raises for 503 (that is the answer)."""
        try:
            return self._request("GET", "/readyz")
        except Unavailable as e:
            return e.body

    def watch(self, after: int = 0, timeout_ms: int = 30000) -> dict:
        """Long-poll: returns when the runner journals a decision after seq `after`."""
        return self._request("GET", f"/v1/watch?after={after}&timeout_ms={timeout_ms}",
                             timeout_s=self.timeout_s + timeout_ms / 1000.0)

    def events(self, since: int = 0, limit: int = 1000) -> dict:
        """Journal records with seq > since, as JSON (a bounded page)."""
        return self._request("GET", f"/v1/events?since={since}&limit={limit}", auth=True)

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=self.timeout_s) as resp:
            return resp.read().decode()
