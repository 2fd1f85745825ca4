"""RolloutCore's vLLM worker extension (rolloutcore.vllm_ext), and the double's model of it."""
import json
import sys
import types
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


class _Uuid:
    def __str__(self):
        return "GPU-5f0c1f3e-0000-1111-2222-333344445555"

    def __repr__(self):
        return "<not the form vLLM uses>"


@pytest.fixture
def fake_cuda(monkeypatch):
    """A stand-in torch.cuda that records which device each call named."""
    asked = {"mem_get_info": [], "props": []}

    def mem_get_info(dev):
        asked["mem_get_info"].append(dev)
        return (7 << 30, 80 << 30)

    def props(dev):
        asked["props"].append(dev)
        return types.SimpleNamespace(uuid=_Uuid())

    cuda = types.SimpleNamespace(mem_get_info=mem_get_info, get_device_properties=props,
                                 current_device=lambda: 5)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    return asked


def test_device_info_names_the_workers_own_gpu_as_vllms_ipc_receiver_does(fake_cuda):
    # Proves rc_device_info answers str(get_device_properties(<the worker's device>).uuid) and
    # that device's mem_get_info, with exactly the spec's keys; would catch repr() of the UUID
    # or the current device instead of the worker's, either of which makes RolloutCore's
    # preflight compare the handle file against a UUID vLLM does not look up.
    w = FakeWorker(1)
    w.device = types.SimpleNamespace(type="cuda", index=2)
    info = w.rc_device_info()
    assert info == {"gpu_uuid": "GPU-5f0c1f3e-0000-1111-2222-333344445555",
                    "free_bytes": 7 << 30, "total_bytes": 80 << 30, "rank": 1,
                    "instance": w.rc_instance()}
    assert fake_cuda == {"mem_get_info": [2], "props": [2]}


def test_device_info_without_a_device_uses_the_current_one(fake_cuda):
    # Proves a worker whose device is not set yet falls back to the current CUDA device rather
    # than failing; would catch an RPC that raises (500) on a worker vLLM set up differently.
    assert FakeWorker(0).rc_device_info()["free_bytes"] == 7 << 30
    assert fake_cuda == {"mem_get_info": [5], "props": [5]}


def test_double_answers_device_info_like_the_extension(engine):
    # Proves the double's rc_device_info answer has this class's keys per worker; would catch the
    # C++ preflight being tested against a shape the real extension does not produce.
    try:
        got = rpc(engine, "rc_device_info")["results"]
    except urllib.error.HTTPError as e:
        if e.code == 500:
            pytest.skip("this build's vllm-double does not model rc_device_info")
        raise
    assert [sorted(r) for r in got] == [["free_bytes", "gpu_uuid", "instance", "rank",
                                         "total_bytes"]]
    assert isinstance(got[0]["gpu_uuid"], str) and got[0]["gpu_uuid"]
    assert 0 <= got[0]["free_bytes"] <= got[0]["total_bytes"]
