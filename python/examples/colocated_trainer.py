"""A colocated trainer loop: the trainer and vLLM share one GPU, and RolloutCore decides which
of them holds it. vLLM 0.25.1 with its `ipc` weight transfer and sleep mode:

    VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 PYTHONPATH=<rolloutcore>/python \\
      vllm serve MODEL_DIR --served-model-name m --port 8000 --enable-sleep-mode \\
        --weight-transfer-config '{"backend":"ipc"}' --gpu-memory-utilization 0.35 \\
        --worker-extension-cls rolloutcore.vllm_ext.RolloutCoreWorkerExtension &
    rolloutcore serve --engine-url http://127.0.0.1:8000 --transfer ipc --journal /tmp/rc/journal \\
        --initial-manifest DIGEST --initial-label rc-0 --auth-token secret --port 8100 &
    python3 examples/colocated_trainer.py --url http://127.0.0.1:8100 --token secret \\
        --checkpoint MODEL_DIR/model.safetensors --steps 3

DIGEST is the checkpoint's manifest digest (`python3 -c "from rolloutcore.manifest import *;
print(manifest_digest(read_safetensors_manifest('MODEL_DIR/model.safetensors')))"`). The
policy here is the checkpoint's tensors themselves, under vLLM's checkpoint names, so they
are exported as they are; a real trainer exports its model with `name_map=` or (name, tensor)
pairs under the engine's names. The loss is a placeholder.
"""
import argparse
import concurrent.futures
import json
import os
import tempfile
import time
import urllib.request

import rolloutcore
from rolloutcore.manifest import read_safetensors_manifest


def rollout(url: str, prompt: str) -> dict:
    """One rollout through RolloutCore's proxy: it binds the rollout to the committed version."""
    req = urllib.request.Request(url + "/v1/completions", method="POST",
                                 data=json.dumps({"model": "m", "prompt": prompt,
                                                  "max_tokens": 32}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return {"version": resp.headers["X-RolloutCore-Version"], "body": json.loads(resp.read())}


def load_policy(torch, path: str) -> dict:
    """The checkpoint's tensors on this GPU in the file's order, which is the manifest's order:
    the export then declares the same manifest digest as the checkpoint."""
    from safetensors import safe_open
    order = [name for name, *_ in read_safetensors_manifest(path)]
    with safe_open(path, "pt", device="cuda:0") as f:
        return {name: f.get_tensor(name).requires_grad_(True) for name in order}


def train_step(torch, policy: dict, lr: float) -> None:
    params = list(policy.values())
    loss = sum((p * p).sum() for p in params) * 0.5  # stands in for the RL loss (a decay)
    loss.backward()
    with torch.no_grad():
        for p in params:
            p.add_(p.grad, alpha=-lr)  # in place: the parameters stay where they are
            p.grad = None
    # Gradients and activations are gone; hand their cached blocks back to the driver, since
    # the engine's wake-up needs its weights and KV cache mapped again on this GPU.
    torch.cuda.empty_cache()


def update_until_known(rc, label, ident, source, update_id, attempts=60, wait_s=5.0):
    """update() until its outcome is known. When the executor stops before the outcome was
    durable (OutcomeUnknown, or no answer at all), ask again under the SAME id once it is back:
    it answers what was recorded, or runs the update if nothing was. The caller keeps the
    exported tensors alive meanwhile, since a run that resumes may still read them."""
    for attempt in range(attempts):
        try:
            return rc.update(label, ident, source, update_id=update_id)
        except (rolloutcore.OutcomeUnknown, rolloutcore.Unavailable, OSError):
            if attempt + 1 == attempts:
                raise
            time.sleep(wait_s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8100")
    ap.add_argument("--token", default=None)
    ap.add_argument("--checkpoint", required=True, help="the .safetensors the engine started on")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sleep-level", type=int, choices=(1, 2), default=1)
    ap.add_argument("--lr", type=float, default=1e-2)
    args = ap.parse_args()
    import torch

    rc = rolloutcore.Client(args.url, args.token)
    policy = load_policy(torch, args.checkpoint)
    handles = os.path.join(tempfile.mkdtemp(prefix="rc-colocated-"), "handles.json")
    for step in range(1, args.steps + 1):
        # 1. Rollouts while the engine is READY. Through the proxy, each is bound to the
        #    committed version, and the sleep below waits for every one in flight to finish.
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            batch = list(pool.map(lambda i: rollout(args.url, f"prompt {i}"), range(8)))
        print(f"step {step}: rollouts under {sorted({b['version'] for b in batch})}")

        # 2. Sleep BEFORE the trainer allocates: RolloutCore drains (no rollout is cut, none is
        #    admitted), then vLLM frees its KV cache and weights. vLLM measures what it freed
        #    and fails if this GPU's free memory shrank meanwhile, so nothing trains until the
        #    answer is here. Level 1 keeps the weights in host RAM (wake() could undo the step);
        #    level 2 frees that RAM too, and only an update covering every tensor wakes it.
        slept = rc.sleep(args.sleep_level)
        print(f"step {step}: engine sleeps, freed {slept.get('freed_bytes')} bytes")

        # 3. Train on the memory the engine gave back.
        train_step(torch, policy, args.lr)

        # 4. Export the new weights in place (no copy) and hand them to RolloutCore. The export
        #    must outlive the update call: vLLM reads the tensors until /finish_weight_update,
        #    and RolloutCore answers only after that, once the version is proven (label and
        #    weight digest) and the KV cache is awake again. Leaving the `with` releases them.
        with rolloutcore.export_vllm_ipc(policy, handles) as export:
            ident = rolloutcore.Identity(manifest_digest=export.manifest_digest,
                                         checkpoint=f"colocated/step-{step}", run="example",
                                         step=step)
            try:
                result = update_until_known(rc, f"rc-{step}", ident, export.source_uri,
                                            f"colocated-{step}")
            except rolloutcore.UpdateFailed as e:
                # refused: proven before anything changed, the engine still sleeps on the old
                # version; tainted: it serves nothing until restored (Client.restore).
                print(f"step {step}: {e.outcome}: {e.reason}")
                if e.outcome == "refused" and args.sleep_level == 1:
                    rc.wake()  # serve the old version again
                raise
        print(f"step {step}: {result['outcome']} -> {result['state']['committed']['label']} "
              f"(update {result['timings']['total_us'] / 1e6:.2f} s)")
        # 5. The next loop's rollouts run on the new version; the trainer's tensors stay in
        #    GPU memory beside the engine (colocated: both fit, neither is copied).


if __name__ == "__main__":
    main()
