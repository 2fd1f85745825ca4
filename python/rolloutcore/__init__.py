"""Trainer-side client for RolloutCore's executor (`rolloutcore serve`).

Standard library only (urllib); torch is imported lazily by the CUDA IPC exporters
(`export_cuda_ipc_handles`, `export_vllm_ipc`).
"""
from .client import (  # noqa: F401
    Client,
    Identity,
    OutcomeUnknown,
    RolloutBinding,
    RolloutCoreError,
    UpdateConflict,
    UpdateFailed,
    Unavailable,
)
from .ipc import IpcExport, export_cuda_ipc_handles, export_vllm_ipc  # noqa: F401

__all__ = [
    "Client", "Identity", "IpcExport", "OutcomeUnknown", "RolloutBinding", "RolloutCoreError",
    "UpdateConflict", "UpdateFailed", "Unavailable", "export_cuda_ipc_handles", "export_vllm_ipc",
]
