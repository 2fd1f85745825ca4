#!/usr/bin/env python3
"""A trainer stand-in for the `ipc:` weight source: allocates one flat device buffer on --device,
fills tensor i with the seeded generator the receiver double verifies against
(receiver_double.expected_bytes), exports it with torch's CUDA IPC (storage._share_cuda_(): the
64-byte cudaIpcMemHandle_t of the allocator block plus the storage's offset in it) and writes the
handle file the sender reads (effects/nccl/weight_source.h: {"version": 1, "tensors": [{name,
dtype, shape, ipc_handle_b64, allocation_bytes, offset, device}]}). It then stays alive (the
memory must outlive the transfer) until SIGTERM.
"""
import argparse, base64, json, os, signal, time

import torch

def expected_bytes(seed, i, nbytes, device):
    nwords = (nbytes + 3) // 4
    j = torch.arange(nwords, dtype=torch.int64, device=device)
    w = (j * 2654435761 + ((i + 1) * 2246822519 + seed)) & 0xFFFFFFFF
    w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
    return w.view(torch.uint8)[:nbytes]

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest", required=True)  # [{"name", "dtype", "shape"}] in transfer order
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--pid-file")
    a = ap.parse_args()
    torch.cuda.set_device(a.device)
    with open(a.manifest) as f:
        tensors = json.load(f)
    sizes = [int(torch.Size(t["shape"]).numel()) * torch.empty(0, dtype=getattr(torch, t["dtype"])).element_size()
             for t in tensors]
    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=a.device)
    off = 0
    for i, n in enumerate(sizes):
        flat[off:off + n] = expected_bytes(a.seed, i, n, a.device)
        off += n
    torch.cuda.synchronize(a.device)
    dev, handle, size_bytes, offset_bytes = flat.untyped_storage()._share_cuda_()[:4]
    # torch >= 2.5 frames the handle: [version byte][type byte: b"c" = cudaMalloc block][64-byte
    # cudaIpcMemHandle_t] (b"e" = expandable segment, which cudaIpcOpenMemHandle cannot open).
    if len(handle) == 66:
        if handle[1:2] != b"c": raise SystemExit(f"not a cudaMalloc block (type {handle[1:2]!r}): unset expandable_segments")
        handle = handle[2:]
    if len(handle) != 64: raise SystemExit(f"unexpected IPC handle length {len(handle)}")
    entries, off = [], 0
    for t, n in zip(tensors, sizes):
        entries.append({"name": t["name"], "dtype": t["dtype"], "shape": t["shape"],
                        "ipc_handle_b64": base64.b64encode(handle).decode(),
                        "allocation_bytes": offset_bytes + size_bytes, "offset": offset_bytes + off,
                        "device": a.device})
        off += n
    if a.pid_file:
        with open(a.pid_file, "w") as f:
            f.write(str(os.getpid()))
    with open(a.out + ".tmp", "w") as f:
        json.dump({"version": 1, "tensors": entries}, f)
    os.replace(a.out + ".tmp", a.out)
    print(f"ipc_export: {len(entries)} tensors, {off} bytes, block offset {offset_bytes}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        time.sleep(1)

if __name__ == "__main__":
    main()
