"""Export a torch model's parameters as CUDA IPC handles for an `ipc:` weight source.

The file is what RolloutCore's NCCL sender reads (effects/nccl/weight_source.h):

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
from typing import Any

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
