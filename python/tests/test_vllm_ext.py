"""RolloutCore's vLLM worker extension (rolloutcore.vllm_ext), and the double's model of it."""
import json
import urllib.error
import urllib.request

import pytest

from rolloutcore.vllm_ext import DEFAULT_LABEL, RolloutCoreWorkerExtension


class FakeWorker(RolloutCoreWorkerExtension):
    """Stands in for vLLM's Worker, which the extension is mixed into (it has a `rank`)."""

    def __init__(self, rank):
        self.rank = rank


def rpc(url, method, args=None):
    body = {"method": method} if args is None else {"method": method, "args": args}
    req = urllib.request.Request(url + "/collective_rpc", method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_label_starts_default_and_is_set_per_worker():
    # Proves a fresh worker reports "default" (so a restarted engine is told apart) and a set label
    # is what it reports after; would catch a class-level label shared across engines.
    a, b = FakeWorker(0), FakeWorker(1)
    nonce = a.rc_instance()
    assert a.rc_weight_info() == {"weight_version": DEFAULT_LABEL, "rank": 0, "instance": nonce}
    assert a.rc_set_weight_version("rc-1") == {"weight_version": "rc-1", "rank": 0,
                                               "instance": nonce}
    assert a.rc_weight_info()["weight_version"] == "rc-1"
    assert b.rc_weight_info()["weight_version"] == DEFAULT_LABEL


@pytest.mark.parametrize("bad", ["", None, 7, "x" * 129])
def test_bad_label_is_refused_and_changes_nothing(bad):
    # Proves an empty, non-string or over-long label raises and leaves the label as it was; would
    # catch an extension that stores garbage RolloutCore would then read back as evidence.
    w = FakeWorker(0)
    w.rc_set_weight_version("rc-3")
    with pytest.raises(ValueError):
        w.rc_set_weight_version(bad)
    assert w.rc_weight_info()["weight_version"] == "rc-3"


def test_instance_is_one_nonce_per_worker_process():
    # Proves each worker reports one nonce for its life, and another worker (or a restarted one)
    # another; would catch a restarted engine that looks like the one RolloutCore verified.
    a, b = FakeWorker(0), FakeWorker(0)
    assert a.rc_instance() == a.rc_weight_info()["instance"]
    assert a.rc_instance() != b.rc_instance()


def test_extension_methods_do_not_clash_with_vllm_worker_names():
    # Proves every public name is rc_-prefixed; vLLM refuses an extension whose attributes collide
    # with the worker's (vllm/v1/worker/worker_base.py), which would stop the engine from starting.
    names = [n for n in vars(RolloutCoreWorkerExtension) if not n.startswith("__")]
    assert names and all(n.startswith("rc_") for n in names)


def test_double_answers_like_the_extension(engine):
    # Proves the double's /collective_rpc answers have exactly the shape this class returns, per
    # worker, and that any other method fails as in vLLM (500); would catch the double and the
    # real extension drifting apart, which would make the C++ adapter's tests lie.
    got = rpc(engine, "rc_weight_info")["results"]
    assert [sorted(r) for r in got] == [sorted(FakeWorker(0).rc_weight_info())]
    assert got[0]["weight_version"] == DEFAULT_LABEL
    got = rpc(engine, "rc_set_weight_version", ["rc-9"])["results"]
    want = FakeWorker(0).rc_set_weight_version("rc-9")
    assert [{k: v for k, v in r.items() if k != "instance"} for r in got] == \
        [{k: v for k, v in want.items() if k != "instance"}]
    assert isinstance(got[0]["instance"], str) and got[0]["instance"]
    assert rpc(engine, "rc_weight_info")["results"][0]["weight_version"] == "rc-9"
    with pytest.raises(urllib.error.HTTPError) as e:
        rpc(engine, "not_a_worker_method")
    assert e.value.code == 500
