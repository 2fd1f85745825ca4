"""The CUDA IPC exporter writes exactly the handle file RolloutCore's NCCL sender parses
(effects/nccl/weight_source.h). No GPU here: a stand-in `torch` module reproduces what
`untyped_storage()._share_cuda_()` returns (torch >= 2.5 framing included); the real export
path runs on a host with GPUs (tests/gpu/ipc_export.py exercises the same fields end to end)."""
import base64
import json
import sys
import types

import pytest

from rolloutcore.ipc import export_cuda_ipc_handles


class _Storage:
    def __init__(self, handle, size, offset):
        self._share = (0, handle, size, offset, b"ref", 0, b"evt", False)

    def _share_cuda_(self):
        return self._share


class _Tensor:
    def __init__(self, shape, storage, storage_offset, device=0, cuda=True, contiguous=True):
        self.shape = shape
        self.dtype = "torch.bfloat16"
        self.is_cuda = cuda
        self.device = types.SimpleNamespace(index=device)
        self._storage, self._offset, self._contiguous = storage, storage_offset, contiguous

    def detach(self):
        return self

    def is_contiguous(self):
        return self._contiguous

    def untyped_storage(self):
        return self._storage

    def storage_offset(self):
        return self._offset

    def element_size(self):
        return 2


class _Model:
    def __init__(self, params):
        self._params = params

    def named_parameters(self):
        return list(self._params)


@pytest.fixture
def fake_torch(monkeypatch):
    mod = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=lambda: None))
    monkeypatch.setitem(sys.modules, "torch", mod)
    return mod


def test_handle_file_matches_the_sender_format(tmp_path, fake_torch):
    """Proves every field the sender requires is present with the sender's names and the byte
    offset includes the tensor's offset into its storage; catches the earlier format (pickled
    reduce_tensor under 'handle_b64') that the sender could not read."""
    raw = bytes(range(64))
    storage = _Storage(b"\x01c" + raw, size=4096, offset=512)  # torch >= 2.5 framing
    model = _Model([("a.weight", _Tensor([4, 8], storage, 0)),
                    ("b.weight", _Tensor([16], storage, 32))])
    uri = export_cuda_ipc_handles(model, str(tmp_path / "h.json"))
    assert uri == "ipc:" + str(tmp_path / "h.json")
    doc = json.loads((tmp_path / "h.json").read_text())
    assert doc["version"] == 1
    a, b = doc["tensors"]
    for t in (a, b):
        assert set(t) == {"name", "dtype", "shape", "ipc_handle_b64", "allocation_bytes",
                          "offset", "device"}
        assert base64.b64decode(t["ipc_handle_b64"]) == raw
        assert t["allocation_bytes"] == 512 + 4096
        assert t["dtype"] == "bfloat16"
    assert a["offset"] == 512 and b["offset"] == 512 + 32 * 2
    assert [a["name"], b["name"]] == ["a.weight", "b.weight"]


def test_refuses_what_the_sender_cannot_map(tmp_path, fake_torch):
    """Proves CPU tensors, non-contiguous tensors, expandable-segment handles and mixed devices
    are refused before any file is written; catches a handle file the sender would reject (or
    misread) only at update time."""
    good = _Storage(bytes(64), 64, 0)
    cases = [
        [("x", _Tensor([2], good, 0, cuda=False))],
        [("x", _Tensor([2], good, 0, contiguous=False))],
        [("x", _Tensor([2], _Storage(b"\x01e" + bytes(64), 64, 0), 0))],
        [("x", _Tensor([2], good, 0, device=0)), ("y", _Tensor([2], good, 0, device=1))],
    ]
    for params in cases:
        with pytest.raises(ValueError):
            export_cuda_ipc_handles(_Model(params), str(tmp_path / "bad.json"))
        assert not (tmp_path / "bad.json").exists()
