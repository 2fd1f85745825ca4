"""RolloutCore's vLLM worker extension: the weight-version label for vLLM 0.25.x, the weight digest,
the checkpoint manifest and the device the engine runs on.

vLLM 0.25.x has no ``GET /weight_info`` or ``POST /update_weight_version`` (they came later), so
the engine cannot say which weights it serves. Start it with

    PYTHONPATH=<rolloutcore>/python vllm serve ... \\
        --worker-extension-cls rolloutcore.vllm_ext.RolloutCoreWorkerExtension

and RolloutCore reads and writes the label through vLLM's ``POST /collective_rpc`` (a dev route:
``VLLM_SERVER_DEV_MODE=1``), on every worker:

    {"method": "rc_weight_info"}                         -> {"results": [{"weight_version", "rank", "instance"}]}
    {"method": "rc_set_weight_version", "args": [label]} -> the same, after setting it
    {"method": "rc_weight_digest"}                       -> {"results": [{"tensors", "combined", ...}]}
    {"method": "rc_checkpoint_manifest", "args": [path]} -> {"results": [{"manifest_digest", ...}]}
    {"method": "rc_device_info"}                         -> {"results": [{"gpu_uuid", "free_bytes", ..}]}

``rc_checkpoint_manifest`` describes a checkpoint on the engine's own disk before RolloutCore asks
vLLM's native ``reload_weights`` to load it (effects/http/checkpoint_reload.h).

The label lives in the worker processes: a restarted engine reports "default" again and new
instance nonces (one per worker process), which is how RolloutCore tells a restarted engine from
the one it published weights to. ``rc_device_info`` names each worker's GPU the way vLLM's ipc
backend looks it up in a handle dict, and its free memory (colocated mode: RolloutCore checks a
``vllm-ipc:`` file against the UUIDs and measures what a sleep freed). Nothing here changes the
weights or the caches; ``rc_weight_digest`` reads every parameter (rolloutcore.digest, ~10 ms
for 16 GB on an H200).
"""

import os
import uuid

DEFAULT_LABEL = "default"  # what vLLM's own label starts as on later versions
LABEL_BYTES_MAX = 128      # RolloutCore's bound on labels (statemachine/types.h kIdBytesMax)
ERROR_BYTES_MAX = 1024     # rc_checkpoint_manifest's error text


class RolloutCoreWorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``; methods run per worker."""

    def rc_weight_info(self) -> dict:
        return {"weight_version": getattr(self, "_rc_weight_version", DEFAULT_LABEL),
                "rank": int(getattr(self, "rank", 0)),
                "instance": self.rc_instance()}

    def rc_instance(self) -> str:
        # A nonce per worker process: a restarted engine answers with new ones, which is how
        # RolloutCore tells it from the engine it verified (generation 0 looks the same).
        nonce = getattr(self, "_rc_instance_nonce", None)
        if nonce is None:
            nonce = f"{uuid.uuid4().hex[:16]}.{os.getpid()}"
            self._rc_instance_nonce = nonce
        return nonce

    def rc_set_weight_version(self, label: str) -> dict:
        if not isinstance(label, str) or not label:
            raise ValueError("rc_set_weight_version: the label must be a non-empty string")
        if len(label.encode("utf-8")) > LABEL_BYTES_MAX:
            raise ValueError(f"rc_set_weight_version: label longer than {LABEL_BYTES_MAX} bytes")
        self._rc_weight_version = label
        return self.rc_weight_info()

    def rc_weight_digest(self) -> dict:
        """The rcd1 digest of this worker's parameters as it holds them (its shard under TP):
        {"algorithm", "tensors": {name: hex}, "combined": hex, "bytes", "elapsed_ms", "rank",
        "instance"}. Computed on the worker's GPU after its queued work has finished; it uses
        neither the scheduler nor the KV cache, so it can be called while the engine is paused.
        Needs ~bytes/64 of free device memory for the duration (256 MB for 16 GB)."""
        from .digest import named_digest  # torch is imported only when a digest is asked for

        runner = getattr(self, "model_runner", None)
        get_model = getattr(runner, "get_model", None)
        model = get_model() if callable(get_model) else getattr(runner, "model", None)
        if model is None:
            raise RuntimeError("rc_weight_digest: this worker has no model loaded")
        out = named_digest(model.named_parameters())
        out["rank"] = int(getattr(self, "rank", 0))
        out["instance"] = self.rc_instance()
        return out

    def rc_device_info(self) -> dict:
        """This worker's GPU and its memory now: {"gpu_uuid", "free_bytes", "total_bytes",
        "rank", "instance"}. ``gpu_uuid`` is ``str(torch.cuda.get_device_properties(dev).uuid)``
        of the worker's own device, the exact key vLLM's ipc receiver looks up in every handle
        dict; the byte counts are ``torch.cuda.mem_get_info`` and device-wide (a colocated
        trainer's memory is not free). Allocates nothing, so it answers while the engine sleeps."""
        import torch  # imported only when asked, like the digest

        dev = _device_index(self, torch)
        free_bytes, total_bytes = torch.cuda.mem_get_info(dev)
        return {"gpu_uuid": str(torch.cuda.get_device_properties(dev).uuid),
                "free_bytes": int(free_bytes), "total_bytes": int(total_bytes),
                "rank": int(getattr(self, "rank", 0)), "instance": self.rc_instance()}

    def rc_checkpoint_manifest(self, path: str) -> dict:
        """What vLLM's ``reload_weights(weights_path=...)`` would load for the checkpoint at
        ``path`` (a .safetensors file alone in its directory, or a directory), read from the
        safetensors headers only: {"manifest_digest", "tensors", "bytes", "files",
        "weights_path", "load_format", "error", "rank"}. ``manifest_digest`` is RolloutCore's
        manifest digest (rolloutcore.manifest, the same as the C++ one of the same files);
        ``weights_path`` is the directory to hand to reload_weights. On any problem (a missing
        path, a file that is not safetensors, ``--load-format dummy``) ``error`` says why and
        ``manifest_digest`` is "". Changes nothing, raises nothing: the RPC always answers."""
        from .manifest import ManifestError, checkpoint_manifest

        load_config = getattr(self, "load_config", None)
        load_format = str(getattr(load_config, "load_format", "auto")).lower()
        out = {"manifest_digest": "", "tensors": 0, "bytes": 0, "files": 0, "weights_path": "",
               "load_format": load_format, "error": "", "rank": int(getattr(self, "rank", 0))}
        try:
            out.update(checkpoint_manifest(path, load_format))
        except ManifestError as e:
            out["error"] = str(e)[:ERROR_BYTES_MAX]
        except OSError as e:  # a file that vanished or changed type between two looks
            out["error"] = f"{path!r}: {e.strerror}"[:ERROR_BYTES_MAX]
        except Exception as e:  # noqa: BLE001 - the RPC must answer; the type only, no content
            out["error"] = f"rc_checkpoint_manifest failed: {type(e).__name__}"
        return out


def _device_index(worker, torch) -> int:
    """The CUDA device the worker's model lives on: vLLM sets ``worker.device`` ("cuda:N") when
    it initialises the device, and its ipc receiver uses that index; else the current device."""
    device = getattr(worker, "device", None)
    index = getattr(device, "index", None)
    if getattr(device, "type", None) == "cuda" and index is not None:
        return int(index)
    return torch.cuda.current_device()
