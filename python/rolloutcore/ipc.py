"""Export a torch model's parameters as CUDA IPC handles for an `ipc:` weight source."""
from __future__ import annotations

import base64
import json
import os
import pickle
from typing import Any


def export_cuda_ipc_handles(model: Any, path: str) -> str:
    """Writes a JSON file of CUDA IPC handles for every parameter of `model`; returns the
    `ipc:<path>` source URI to pass to Client.update.

    Each entry: name, dtype (torch name), shape, device index and the pickled, base64-encoded
    `torch.multiprocessing.reductions.reduce_tensor` result (what vLLM's IPC loaders rebuild).
    The tensors must stay alive (and unmodified) until the update has committed. torch is
    imported here, lazily, so the rest of the package needs only the standard library.
    """
    import torch  # noqa: WPS433 (lazy on purpose)
    from torch.multiprocessing.reductions import reduce_tensor

    entries = []
    for name, p in model.named_parameters():
        t = p.detach()
        if not t.is_cuda:
            raise ValueError(f"parameter {name} is on {t.device}, not CUDA")
        if not t.is_contiguous():
            raise ValueError(f"parameter {name} is not contiguous")
        handle = reduce_tensor(t)
        entries.append({
            "name": name,
            "dtype": str(t.dtype).replace("torch.", ""),
            "shape": list(t.shape),
            "device": t.device.index,
            "handle_b64": base64.b64encode(pickle.dumps(handle)).decode(),
        })
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"format": "rolloutcore-ipc-v1", "torch": torch.__version__,
                   "tensors": entries}, f)
    os.replace(tmp, path)
    return "ipc:" + os.path.abspath(path)
