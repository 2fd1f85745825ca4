"""Trainer-side client for RolloutCore's executor (`rolloutcore serve`).

Standard library only (urllib); torch is imported lazily by `export_cuda_ipc_handles`.
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
from .ipc import export_cuda_ipc_handles  # noqa: F401

__all__ = [
    "Client", "Identity", "OutcomeUnknown", "RolloutBinding", "RolloutCoreError", "UpdateConflict", "UpdateFailed",
    "Unavailable", "export_cuda_ipc_handles",
]
