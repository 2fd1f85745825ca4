"""Export a trainer's tensors as CUDA IPC handles: for RolloutCore's NCCL sender (`ipc:`,
`export_cuda_ipc_handles`) and for vLLM's own `ipc` backend in colocated mode (`vllm-ipc:`,
`export_vllm_ipc`, at the end of this file).

The `ipc:` file is what RolloutCore's NCCL sender reads (effects/nccl/weight_source.h):

    {"version": 1, "tensors": [{"name", "dtype" (torch name), "shape",
      "ipc_handle_b64" (the 64-byte cudaIpcMemHandle_t of the cudaMalloc block),
      "allocation_bytes" (bytes of that block the sender may map), "offset" (bytes of this
      tensor into the block), "device"}, ...]}

Tensors are listed in `model.named_parameters()` order, which is the transfer order. The
trainer keeps ownership: the tensors must stay alive and unmodified until the update commits.
torch is imported lazily, so the rest of the package needs only the standard library.
"""
from __future__ import annotations

import base64
import json
import os
import pickle
from typing import Any, Callable, List, Mapping, Optional, Sequence, Union

IPC_HANDLE_BYTES = 64


def _raw_handle(handle: bytes) -> bytes:
    # torch >= 2.5 frames the handle as [version byte][type byte][64-byte handle]; type b"c" is a
    # plain cudaMalloc block, b"e" an expandable segment that cudaIpcOpenMemHandle cannot open.
    if len(handle) == IPC_HANDLE_BYTES + 2:
        if handle[1:2] != b"c":
            raise ValueError("CUDA IPC needs cudaMalloc blocks: unset "
                             "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        handle = handle[2:]
    if len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"unexpected CUDA IPC handle length {len(handle)}")
    return handle


def export_cuda_ipc_handles(model: Any, path: str) -> str:
    """Writes the handle file for every parameter of `model`; returns the `ipc:<path>` source
    URI to pass to Client.update. All parameters must be contiguous CUDA tensors on one device.
    """
    import torch  # noqa: WPS433 (lazy on purpose)

    entries = []
    device = None
    for name, p in model.named_parameters():
        t = p.detach()
        if not t.is_cuda:
            raise ValueError(f"parameter {name} is on {t.device}, not CUDA")
        if not t.is_contiguous():
            raise ValueError(f"parameter {name} is not contiguous")
        if device is None:
            device = t.device.index
        elif t.device.index != device:
            raise ValueError(f"parameter {name} is on cuda:{t.device.index}, others on "
                             f"cuda:{device}: one device per source")
        storage = t.untyped_storage()
        _dev, handle, storage_bytes, storage_offset = storage._share_cuda_()[:4]
        offset = storage_offset + t.storage_offset() * t.element_size()
        entries.append({
            "name": name,
            "dtype": str(t.dtype).replace("torch.", ""),
            "shape": list(t.shape),
            "ipc_handle_b64": base64.b64encode(_raw_handle(handle)).decode(),
            "allocation_bytes": storage_offset + storage_bytes,
            "offset": offset,
            "device": t.device.index,
        })
    torch.cuda.synchronize()
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"version": 1, "tensors": entries}, f)
    os.replace(tmp, path)
    return "ipc:" + os.path.abspath(path)


# ---- vLLM's own `ipc` weight-transfer backend (colocated mode) -----------------------------------
#
# The file behind a `vllm-ipc:<path>` source (RolloutCore reads at most VLLM_IPC_FILE_BYTES_MAX):
#
#     {"format": "rolloutcore-vllm-ipc", "version": 1, "gpu_uuids": [...], "names": [...],
#      "dtype_names": [...], "shapes": [[...], ...], "ipc_handles_pickled": "<base64>"}
#
# RolloutCore forwards names, dtype_names, shapes and ipc_handles_pickled unchanged as the
# update_info of one unpacked `/update_weights` call, so every field is exactly what vLLM's own
# HTTP sender (IPCWeightTransferEngine._send_unpacked / _do_send) puts there: dtype names are
# `str(dtype)` after the last dot, and ipc_handles_pickled is the standard base64 of
# `pickle.dumps([{gpu_uuid: rebuild args}, ...])`, one dict per name, the args being what
# `torch.multiprocessing.reductions.reduce_tensor` returns for the tensor. vLLM's worker looks its
# GPU up by `str(torch.cuda.get_device_properties(dev).uuid)`; the keys are made the same way.

VLLM_IPC_SCHEME = "vllm-ipc:"
VLLM_IPC_FORMAT = "rolloutcore-vllm-ipc"
VLLM_IPC_VERSION = 1
VLLM_IPC_FILE_BYTES_MAX = 64 << 20
_HANDLE_ARG = 7  # reduce_tensor's args: (cls, size, stride, offset, storage_cls, dtype, device, handle, ...)


class IpcExport:
    """One written `vllm-ipc:` handle file and the tensors behind it.

    vLLM reads these tensors in place (no copy) until `/finish_weight_update`; torch's handle
    alone does not keep the memory alive. So this object holds a strong reference to every
    exported tensor until `release()`, which the trainer calls only once the update's answer
    (committed, refused or tainted) has arrived, and must not modify them before then. Use it as
    a context manager to release on exit. (After a tainted update vLLM may still hold the tensors
    of the failed attempt, docs/vllm-protocol.md §8.1; torch keeps their blocks from reuse until
    it lets go, whatever this object does.)
    """

    def __init__(self, path, names, dtype_names, shapes, gpu_uuids, tensors, nbytes):
        self.path = path
        self.names = names
        self.dtype_names = dtype_names
        self.shapes = shapes
        self.gpu_uuids = gpu_uuids
        self.nbytes = nbytes
        self._tensors = tensors

    @property
    def source_uri(self) -> str:
        """The `source` to pass to Client.update / Client.restore."""
        return VLLM_IPC_SCHEME + self.path

    @property
    def manifest_digest(self) -> str:
        """The manifest digest of the export, in file order (effects/manifest.h)."""
        from .manifest import manifest_digest
        return manifest_digest(zip(self.names, self.dtype_names, self.shapes))

    @property
    def released(self) -> bool:
        return self._tensors is None

    def release(self, remove_file: bool = True) -> None:
        """Drops the references, then lets torch free what the engine no longer maps
        (`torch.cuda.ipc_collect()`). Removes the handle file too unless told otherwise: its
        handles would now name memory the trainer may reuse. Idempotent."""
        if self._tensors is None:
            return
        self._tensors = None
        if remove_file:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        import torch  # noqa: WPS433 (lazy on purpose)
        torch.cuda.ipc_collect()

    def __enter__(self) -> "IpcExport":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def export_vllm_ipc(weights: Any, path: str, gpu_uuids: Optional[Sequence[str]] = None,
                    name_map: Union[None, Mapping[str, Optional[str]],
                                    Callable[[str], Optional[str]]] = None) -> IpcExport:
    """Writes the `vllm-ipc:` handle file for `weights` at `path` (mode 0600, replaced
    atomically) and returns the IpcExport that keeps the tensors alive.

    `weights`: a module (its `named_parameters()`), a mapping name -> tensor, or an iterable of
    (name, tensor) pairs; every tensor a contiguous CUDA tensor, all on one device, in the
    order the engine should receive them. Names must be the ENGINE's checkpoint names: when
    the trainer's differ, pass pairs under the engine's names or a `name_map` (a mapping, where
    absent names are kept and a name mapped to None is left out, or a callable returning the
    engine's name or None). `gpu_uuids`: the keys of every handle dict; default the UUID of
    the tensors' GPU as vLLM's worker computes it, which is what an engine on the same GPU
    looks up. Anything unexportable is a ValueError before any file is written.

    The file holds pickled handles that vLLM unpickles (VLLM_ALLOW_INSECURE_SERIALIZATION=1):
    whoever can write it can run code in the engine, hence 0600.
    """
    import torch  # noqa: WPS433 (lazy on purpose)
    from torch.multiprocessing.reductions import reduce_tensor

    named = _engine_named(_named_tensors(weights), name_map)
    device = _check_exportable(named)
    keys = _uuid_keys(torch, device, gpu_uuids)
    torch.cuda.synchronize(device)  # the trainer's last writes land before the engine reads
    kept, handles = [], []
    for name, tensor in named:
        t = tensor.detach()  # the same memory; what reduce_tensor accepts for any leaf
        args = reduce_tensor(t)[1]
        _check_handle(name, args[_HANDLE_ARG])
        kept.append(t)
        handles.append({key: args for key in keys})
    names = [n for n, _ in named]
    dtype_names = [_dtype_name(t) for _, t in named]
    shapes = [[int(d) for d in t.shape] for _, t in named]
    doc = {"format": VLLM_IPC_FORMAT, "version": VLLM_IPC_VERSION, "gpu_uuids": keys,
           "names": names, "dtype_names": dtype_names, "shapes": shapes,
           "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("ascii")}
    path = os.path.abspath(path)
    _write_private(path, json.dumps(doc).encode())
    nbytes = sum(t.numel() * t.element_size() for t in kept)
    return IpcExport(path, names, dtype_names, shapes, keys, kept, nbytes)


def _named_tensors(weights: Any) -> list:
    if hasattr(weights, "named_parameters"):
        return list(weights.named_parameters())
    if isinstance(weights, Mapping):
        return list(weights.items())
    return list(weights)


def _engine_named(named: list, name_map: Any) -> list:
    if name_map is None:
        return named
    if callable(name_map):
        rename = name_map
    else:
        def rename(name):
            return name_map.get(name, name)
    out = []
    for name, tensor in named:
        engine_name = rename(name)
        if engine_name is not None:
            out.append((engine_name, tensor))
    return out


def _dtype_name(t: Any) -> str:
    return str(t.dtype).split(".")[-1]  # vLLM's sender writes exactly this


def _check_exportable(named: list) -> int:
    """The one CUDA device index of `named`, after checking names, dtypes and layouts."""
    from .manifest import DTYPES, NAME_BYTES_MAX, TENSORS_MAX
    known = sorted(torch_name for torch_name, _ in DTYPES.values())
    if not named:
        raise ValueError("export_vllm_ipc: nothing to export")
    if len(named) > TENSORS_MAX:
        raise ValueError(f"export_vllm_ipc: more than {TENSORS_MAX} tensors")
    seen, device = set(), None
    for name, t in named:
        if not isinstance(name, str) or not name or len(name.encode("utf-8")) > NAME_BYTES_MAX:
            raise ValueError(f"export_vllm_ipc: name {name!r} is empty, not a string or longer "
                             f"than {NAME_BYTES_MAX} bytes")
        if name in seen:
            raise ValueError(f"export_vllm_ipc: {name} appears twice (check name_map)")
        seen.add(name)
        if not t.is_cuda:
            raise ValueError(f"export_vllm_ipc: {name} is on {t.device}, not CUDA: vLLM's ipc "
                             "backend reads the trainer's GPU memory")
        if not t.is_contiguous():
            raise ValueError(f"export_vllm_ipc: {name} is not contiguous; export a contiguous "
                             "copy and keep it alive (the engine reads the memory as it is)")
        if _dtype_name(t) not in known:
            raise ValueError(f"export_vllm_ipc: {name} has dtype {_dtype_name(t)}; a RolloutCore "
                             f"manifest knows {', '.join(known)}")
        if device is None:
            device = t.device.index
        elif t.device.index != device:
            raise ValueError(f"export_vllm_ipc: {name} is on cuda:{t.device.index}, others on "
                             f"cuda:{device}: one device per export")
    return device


def _uuid_keys(torch: Any, device: int, gpu_uuids: Optional[Sequence[str]]) -> List[str]:
    if gpu_uuids is None:
        return [str(torch.cuda.get_device_properties(device).uuid)]
    keys = list(gpu_uuids) if not isinstance(gpu_uuids, (str, bytes)) else None
    if not keys or any(not isinstance(k, str) or not k for k in keys) or len(set(keys)) != len(keys):
        raise ValueError("export_vllm_ipc: gpu_uuids must be a non-empty list of distinct, "
                         "non-empty strings")
    return keys


def _check_handle(name: str, handle: Any) -> None:
    # torch >= 2.5 frames the handle as [version][type][handle]; type b"e" is an expandable
    # segment, which another process can open only with the rights to take this process's file
    # descriptors (pidfd_getfd), which an engine that is not our child usually lacks.
    if isinstance(handle, bytes) and len(handle) == IPC_HANDLE_BYTES + 2 and handle[1:2] == b"e":
        raise ValueError(f"export_vllm_ipc: {name} lives in an expandable segment; unset "
                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the trainer")


def _write_private(path: str, data: bytes) -> None:
    if len(data) > VLLM_IPC_FILE_BYTES_MAX:
        raise ValueError(f"export_vllm_ipc: the handle file would be {len(data)} bytes, over "
                         f"RolloutCore's {VLLM_IPC_FILE_BYTES_MAX}")
    tmp = path + ".tmp"
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
