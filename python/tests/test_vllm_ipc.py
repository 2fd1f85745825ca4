"""export_vllm_ipc writes the `vllm-ipc:` file of colocated mode: the update_info vLLM 0.25.1's own
HTTP sender builds (IPCWeightTransferEngine._send_unpacked / _do_send), plus the header
RolloutCore's preflight reads. No GPU here: a stand-in `torch` reproduces what the exporter calls
(reduce_tensor's 15 rebuild args, get_device_properties(i).uuid, synchronize, ipc_collect); the
real export runs in tests/gpu/vllm/colocated.py against vLLM."""
import base64
import gc
import json
import os
import pickle
import stat
import struct
import subprocess
import sys
import types
import weakref

import pytest

from rolloutcore import ipc
from rolloutcore.ipc import IpcExport, export_vllm_ipc
from rolloutcore.manifest import manifest_digest, read_safetensors_manifest

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Dtype:
    def __init__(self, name, size):
        self.name, self.size = name, size

    def __str__(self):
        return "torch." + self.name


BF16, F32, C64 = _Dtype("bfloat16", 2), _Dtype("float32", 4), _Dtype("complex64", 8)


class _Device:
    def __init__(self, type_, index):
        self.type, self.index = type_, index

    def __str__(self):
        return f"{self.type}:{self.index}"


class _Tensor:
    """What the exporter touches of a torch tensor; detach() is a new object on one storage."""

    def __init__(self, shape, dtype=BF16, device=0, cuda=True, contiguous=True, storage=None,
                 requires_grad=True):
        self.shape, self.dtype = tuple(shape), dtype
        self.is_cuda = cuda
        self.device = _Device("cuda" if cuda else "cpu", device if cuda else None)
        self._contiguous = contiguous
        self.storage = storage if storage is not None else object()
        self.requires_grad = requires_grad

    def detach(self):
        t = _Tensor(self.shape, self.dtype, self.device.index, self.is_cuda, self._contiguous,
                    self.storage, requires_grad=False)
        return t

    def is_contiguous(self):
        return self._contiguous

    def numel(self):
        n = 1
        for d in self.shape:
            n *= d
        return n

    def element_size(self):
        return self.dtype.size


class _Uuid:
    """torch's _CudaDeviceProperties.uuid: str() is the form vLLM uses; repr() is not."""

    def __init__(self, text):
        self.text = text

    def __str__(self):
        return self.text

    def __repr__(self):
        return f"<uuid {self.text[4:]}>"


class FakeTorch:
    """The stand-in modules plus a record of what the exporter asked of them."""

    def __init__(self):
        self.reduced = []        # weak references to every tensor given to reduce_tensor
        self.props_asked = []
        self.synchronized = []
        self.ipc_collects = 0
        self.handle_type = b"c"  # torch >= 2.5 framing: b"c" cudaMalloc block, b"e" expandable
        cuda = types.SimpleNamespace(get_device_properties=self._props, synchronize=self._sync,
                                     ipc_collect=self._collect)
        self.torch = types.ModuleType("torch")
        self.torch.cuda = cuda
        self.mp = types.ModuleType("torch.multiprocessing")
        self.reductions = types.ModuleType("torch.multiprocessing.reductions")
        self.reductions.reduce_tensor = self.reduce_tensor
        self.torch.multiprocessing = self.mp
        self.mp.reductions = self.reductions

    def uuid_of(self, index):
        return f"GPU-{index:08d}-aaaa-bbbb-cccc-dddddddddddd"

    def _props(self, index):
        self.props_asked.append(index)
        return types.SimpleNamespace(uuid=_Uuid(self.uuid_of(index)))

    def _sync(self, device=None):
        self.synchronized.append(device)

    def _collect(self):
        self.ipc_collects += 1

    def args_for(self, t):
        """reduce_tensor's args for `t` (torch's layout; element 6 is the device index)."""
        # Bytes 0xf8..0xff: their standard base64 has '+' or '/', which urlsafe base64 lacks.
        handle = b"\x01" + self.handle_type + bytes([0xf8 + id(t.storage) % 8]) * 64
        return ("Tensor", t.shape, (1,), 0, "TypedStorage", str(t.dtype), t.device.index, handle,
                t.numel() * t.element_size(), 0, t.requires_grad, b"ref", 0, b"evt", True)

    def reduce_tensor(self, t):
        self.reduced.append(weakref.ref(t))
        return ("rebuild_cuda_tensor", self.args_for(t))


@pytest.fixture
def fake(monkeypatch):
    f = FakeTorch()
    monkeypatch.setitem(sys.modules, "torch", f.torch)
    monkeypatch.setitem(sys.modules, "torch.multiprocessing", f.mp)
    monkeypatch.setitem(sys.modules, "torch.multiprocessing.reductions", f.reductions)
    return f


def read(path):
    with open(path) as fh:
        return json.load(fh)


def vllm_sender_fields(fake, named, uuid):
    """What vLLM 0.25.1's _send_unpacked + _do_send put in update_info for `named`, written from
    its code's facts: dtype str after the last dot, one {uuid: reduce args} dict per tensor,
    the list pickled and standard-base64 encoded."""
    handles = [{uuid: fake.args_for(t.detach())} for _, t in named]
    return {"names": [n for n, _ in named],
            "dtype_names": [str(t.dtype).split(".")[-1] for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "ipc_handles": handles}


def test_file_is_the_update_info_vllms_sender_builds(tmp_path, fake):
    # Proves the file carries exactly the update_info fields vLLM's own HTTP sender sends, in
    # order, with the header RolloutCore reads, written private and atomically; would catch a
    # renamed field, torch-prefixed dtype names, urlsafe base64, or handles keyed per file
    # instead of per tensor, each of which vLLM refuses only after the update started.
    storage = object()
    named = [("model.a.weight", _Tensor([4, 8], BF16, storage=storage)),
             ("model.b.bias", _Tensor([16], F32, storage=storage))]
    path = tmp_path / "h.json"
    export = export_vllm_ipc(named, str(path))
    doc = read(path)
    assert set(doc) == {"format", "version", "gpu_uuids", "names", "dtype_names", "shapes",
                        "ipc_handles_pickled"}
    assert (doc["format"], doc["version"]) == ("rolloutcore-vllm-ipc", 1)
    uuid = fake.uuid_of(0)
    assert doc["gpu_uuids"] == [uuid]
    raw = base64.b64decode(doc["ipc_handles_pickled"], validate=True)  # the standard alphabet
    got = dict(doc, ipc_handles=pickle.loads(raw))
    want = vllm_sender_fields(fake, named, uuid)
    assert {k: got[k] for k in want} == want
    assert all(h[uuid][6] == 0 for h in got["ipc_handles"])  # the element vLLM overwrites
    assert export.source_uri == "vllm-ipc:" + str(path)
    assert (export.names, export.dtype_names, export.shapes) == \
        (want["names"], want["dtype_names"], want["shapes"])
    assert export.nbytes == 4 * 8 * 2 + 16 * 4
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not os.path.exists(str(path) + ".tmp")
    assert fake.synchronized == [0]


def test_source_uri_is_absolute(tmp_path, fake, monkeypatch):
    # Proves a relative path becomes an absolute URI; would catch a source serve resolves
    # against its own working directory instead of the trainer's.
    monkeypatch.chdir(tmp_path)
    export = export_vllm_ipc([("w", _Tensor([2]))], "rel.json")
    assert export.source_uri == "vllm-ipc:" + str(tmp_path / "rel.json")
    assert read(tmp_path / "rel.json")["names"] == ["w"]


def test_uuid_key_is_str_of_the_tensors_device_properties(tmp_path, fake):
    # Proves the key is str(get_device_properties(<the tensors' device>).uuid), the expression
    # vLLM's worker looks up; would catch repr(), the current device instead of the tensors',
    # or a bare hex form, each of which vLLM answers "IPC handle not found for GPU UUID".
    export = export_vllm_ipc([("w", _Tensor([2], device=3))], str(tmp_path / "h.json"))
    assert fake.props_asked == [3]
    assert export.gpu_uuids == [fake.uuid_of(3)] == read(tmp_path / "h.json")["gpu_uuids"]
    handles = pickle.loads(base64.b64decode(read(tmp_path / "h.json")["ipc_handles_pickled"]))
    assert list(handles[0]) == ["GPU-00000003-aaaa-bbbb-cccc-dddddddddddd"]


def test_explicit_gpu_uuids_key_every_handle(tmp_path, fake):
    # Proves given gpu_uuids are the keys of every dict and the header's list, and malformed
    # ones are refused; would catch a header that lists keys the handles lack (RolloutCore's
    # preflight would pass a file vLLM then rejects).
    keys = ["GPU-x", "GPU-y"]
    export = export_vllm_ipc([("a", _Tensor([2])), ("b", _Tensor([3]))],
                             str(tmp_path / "h.json"), gpu_uuids=keys)
    doc = read(tmp_path / "h.json")
    handles = pickle.loads(base64.b64decode(doc["ipc_handles_pickled"]))
    assert doc["gpu_uuids"] == keys == export.gpu_uuids
    assert [sorted(h) for h in handles] == [keys, keys]
    assert handles[0]["GPU-x"] == handles[0]["GPU-y"]
    assert fake.props_asked == []
    for bad in ("GPU-x", [], ["GPU-x", "GPU-x"], [""], [7]):
        with pytest.raises(ValueError):
            export_vllm_ipc([("a", _Tensor([2]))], str(tmp_path / "bad.json"), gpu_uuids=bad)
    assert not (tmp_path / "bad.json").exists()


def _export_and_forget(path):
    """Exports two tensors nothing else references once this returns."""
    export = export_vllm_ipc([("a", _Tensor([4])), ("b", _Tensor([8]))], path)
    return export


def test_tensors_stay_alive_until_release(tmp_path, fake):
    # Proves the export holds the exported tensors (the very objects whose handles were made)
    # until release(), then drops them, removes the file and calls torch.cuda.ipc_collect()
    # once; would catch an exporter that lets the trainer's memory be freed or reused while
    # vLLM still reads it in place (silently wrong weights), or a release that leaks it.
    path = str(tmp_path / "h.json")
    export = _export_and_forget(path)
    gc.collect()
    assert len(fake.reduced) == 2 and all(r() is not None for r in fake.reduced)
    assert not export.released and fake.ipc_collects == 0
    export.release()
    gc.collect()
    assert export.released and all(r() is None for r in fake.reduced)
    assert fake.ipc_collects == 1
    assert not os.path.exists(path)
    export.release()  # idempotent
    assert fake.ipc_collects == 1


def test_release_can_keep_the_file_and_context_manager_releases_on_error(tmp_path, fake):
    # Proves release(remove_file=False) keeps the file, and a `with` block releases even when
    # it raises; would catch a trainer loop that leaks GPU memory on a failed update.
    kept = export_vllm_ipc([("a", _Tensor([2]))], str(tmp_path / "k.json"))
    kept.release(remove_file=False)
    assert kept.released and (tmp_path / "k.json").exists()
    with pytest.raises(KeyError):
        with export_vllm_ipc([("a", _Tensor([2]))], str(tmp_path / "c.json")) as export:
            assert isinstance(export, IpcExport) and not export.released
            raise KeyError("update failed")
    assert export.released and not (tmp_path / "c.json").exists()
    assert fake.ipc_collects == 2


@pytest.mark.parametrize("case", [
    "cpu", "not_contiguous", "two_devices", "duplicate_after_map", "empty", "unknown_dtype",
    "empty_name", "long_name", "expandable_segment",
])
def test_refuses_what_vllm_cannot_read_before_writing_anything(tmp_path, fake, case):
    # Proves CPU and non-contiguous tensors, mixed devices, duplicate or bad names, dtypes a
    # manifest cannot name and expandable-segment memory are ValueErrors with no file written
    # (and, but for the last, before any handle is made); would catch a file that fails only
    # inside vLLM, after /start_weight_update took the model apart (TAINTED).
    name_map = None
    named = {
        "cpu": [("a", _Tensor([2])), ("b", _Tensor([2], cuda=False))],
        "not_contiguous": [("a", _Tensor([2, 2], contiguous=False))],
        "two_devices": [("a", _Tensor([2], device=0)), ("b", _Tensor([2], device=1))],
        "duplicate_after_map": [("a", _Tensor([2])), ("b", _Tensor([2]))],
        "empty": [],
        "unknown_dtype": [("a", _Tensor([2], C64))],
        "empty_name": [("", _Tensor([2]))],
        "long_name": [("x" * 1025, _Tensor([2]))],
        "expandable_segment": [("a", _Tensor([2]))],
    }[case]
    if case == "duplicate_after_map":
        name_map = {"b": "a"}
    if case == "expandable_segment":
        fake.handle_type = b"e"
    path = tmp_path / "bad.json"
    with pytest.raises(ValueError) as e:
        export_vllm_ipc(named, str(path), name_map=name_map)
    assert "export_vllm_ipc" in str(e.value)
    assert not path.exists() and not (tmp_path / "bad.json.tmp").exists()
    if case != "expandable_segment":
        assert fake.reduced == []


def test_file_over_the_bound_is_refused(tmp_path, fake, monkeypatch):
    # Proves a file larger than RolloutCore reads is refused before it is written; would catch
    # a trainer that learns only from a 400 at update time.
    monkeypatch.setattr(ipc, "VLLM_IPC_FILE_BYTES_MAX", 64)
    with pytest.raises(ValueError, match="over"):
        export_vllm_ipc([("a", _Tensor([2]))], str(tmp_path / "big.json"))
    assert not (tmp_path / "big.json").exists()


class _Module:
    def __init__(self, named):
        self._named = named

    def named_parameters(self):
        return iter(self._named)


def test_engine_names_from_a_map_a_callable_pairs_or_a_mapping(tmp_path, fake):
    # Proves the four ways to name tensors as the engine does keep the trainer's order, rename
    # what the map names, keep what it does not and leave out what maps to None; would catch
    # an export under the trainer's names, which vLLM's load_weights does not know.
    a, b, c = _Tensor([1]), _Tensor([2]), _Tensor([3])
    module = _Module([("net.a", a), ("net.b", b), ("net.c", c)])
    path = str(tmp_path / "h.json")

    def names(weights, name_map=None):
        return export_vllm_ipc(weights, path, name_map=name_map).names

    assert names(module) == ["net.a", "net.b", "net.c"]
    assert names(module, {"net.a": "model.a", "net.c": None}) == ["model.a", "net.b"]
    assert names(module, lambda n: None if n == "net.b" else n.replace("net.", "model.")) == \
        ["model.a", "model.c"]
    assert names([("model.x", a), ("model.y", b)]) == ["model.x", "model.y"]
    assert names({"model.y": b, "model.x": a}) == ["model.y", "model.x"]
    assert read(path)["shapes"] == [[2], [1]]


def write_safetensors(path, entries):
    """A minimal safetensors file: [(name, "BF16"/"F32", shape)] laid out in list order."""
    header, offset = {}, 0
    for name, dtype, shape in entries:
        n = {"BF16": 2, "F32": 4}[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def test_manifest_digest_equals_the_checkpoints_in_its_order(tmp_path, fake):
    # Proves a trainer that exports a checkpoint's tensors in the checkpoint's order declares
    # the checkpoint's own manifest digest (the one a bootstrap from it journaled), and that the
    # digest follows the file's order; would catch a trainer-side manifest that disagrees with
    # RolloutCore's, which refuses the update (422 manifest_mismatch).
    entries = [("model.b.weight", "BF16", [4, 8]), ("model.a.weight", "F32", [16])]
    write_safetensors(str(tmp_path / "m.safetensors"), entries)
    want = manifest_digest(read_safetensors_manifest(str(tmp_path / "m.safetensors")))
    named = [("model.b.weight", _Tensor([4, 8], BF16)), ("model.a.weight", _Tensor([16], F32))]
    export = export_vllm_ipc(named, str(tmp_path / "h.json"))
    assert export.manifest_digest == want
    swapped = export_vllm_ipc(list(reversed(named)), str(tmp_path / "h2.json"))
    assert swapped.manifest_digest != want


def test_package_imports_without_torch():
    # Proves `import rolloutcore` (and its ipc module) does not import torch; would catch a
    # top-level import that makes the trainer client need torch on hosts without a GPU.
    code = "import sys, rolloutcore, rolloutcore.ipc; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=PYTHON_DIR, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_real_torch_dtype_names_and_cpu_refusal(tmp_path):
    # Proves, with a real torch where one is installed, that dtype names are vLLM's form for
    # torch's own dtypes and a CPU tensor is refused before any file; would catch a stand-in
    # that drifted from torch.
    torch = pytest.importorskip("torch")
    assert ipc._dtype_name(torch.zeros(1, dtype=torch.bfloat16)) == "bfloat16"
    if hasattr(torch, "float8_e4m3fn"):
        assert ipc._dtype_name(torch.zeros(1).to(torch.float8_e4m3fn)) == "float8_e4m3fn"
    with pytest.raises(ValueError, match="not CUDA"):
        export_vllm_ipc({"w": torch.zeros(2, 2)}, str(tmp_path / "h.json"))
    assert not (tmp_path / "h.json").exists()
