"""A minimal trainer loop against `rolloutcore serve` (GPU-free: synthetic weights).

    rolloutcore serve --engine-url http://127.0.0.1:8000 --journal /tmp/rc/journal \
        --initial-source synthetic:4x64 --auth-token secret --port 8100 &
    python3 examples/trainer_loop.py --url http://127.0.0.1:8100 --token secret --steps 3

Rollout clients point their OpenAI client at http://127.0.0.1:8100/v1 instead of vLLM.
With real weights, use export_cuda_ipc_handles(model, path) and source="ipc:..." instead.
"""
import argparse
import json
import urllib.request

import rolloutcore


def rollout(url: str, prompt: str) -> dict:
    req = urllib.request.Request(url + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": prompt, "max_tokens": 8}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return {"version": resp.headers["X-RolloutCore-Version"], "body": json.loads(resp.read())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8100")
    ap.add_argument("--token", default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--source", default="synthetic:4x64")
    args = ap.parse_args()
    rc = rolloutcore.Client(args.url, args.token)
    digest = rc.manifest_digest(args.source)
    for step in range(1, args.steps + 1):
        batch = [rollout(args.url, f"prompt {i}") for i in range(4)]
        print(f"step {step}: rollouts under {sorted({b['version'] for b in batch})}")
        # ... compute the loss on `batch`, optimizer.step() ...
        ident = rolloutcore.Identity(manifest_digest=digest, checkpoint=f"step-{step}",
                                     run="example", step=step)
        # A synthetic source's seed names its values: each step sends other weights (one
        # manifest), so the engine's weight digest proves each update landed.
        source = f"{args.source}:{step}"
        result = rc.update(f"rc-{step}", ident, source, update_id=f"example-{step}")
        print(f"step {step}: {result['outcome']} -> {result['state']['committed']['label']} "
              f"(update {result['timings']['total_us'] / 1000:.1f} ms)")


if __name__ == "__main__":
    main()
