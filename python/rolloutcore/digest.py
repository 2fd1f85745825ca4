"""Weight digest "rcd1": a per-tensor and combined digest of model weights, computed where they are.

RolloutCore uses it to check that an engine holds the bytes the trainer published (issue 15). It
runs on the device that holds the tensors: one int8 matrix product per large tensor and a handful
of batched launches for everything else, ~10 ms for 16 GB on one H200 (bench/gpu/digest/). A
pure-torch CPU path gives the same result bit for bit (exact integer arithmetic, see
"Exactness"). Device memory needed while it runs: about 1/64 of the bytes digested.

Definition (the digest of one tensor ``t``; C = 4096, N = 16, L = 6)
------------------------------------------------------------------------
1. ``B_0`` = the bytes of ``t``'s logical contents in row-major (C) order, each element in its
   in-memory encoding (little endian). A non-contiguous tensor (a transpose, a slice) is digested
   as ``t.contiguous()`` would lay it out, so a view and a copy of the same values agree.
   ``n`` = len(B_0); at most C * (C/(4N))**(L-1) = 2**42 bytes (4 TiB).
2. For level l = 1..L: pad ``B_{l-1}`` with zero bytes to ``R`` = max(1, ceil(len/C)) rows of C
   bytes, read as a matrix ``X`` (R x C) of signed bytes (int8, two's complement), and compute
   ``Y = X @ K_l^T`` (R x N) over the integers; ``B_l`` = Y's entries as little-endian int32,
   row-major. |Y| <= C * 128 * 128 = 2**26, so int32 holds Y exactly. Each level shrinks the data
   C/(4N) = 64 times, so ``B_L`` is one row: 4N = 64 bytes.
3. ``K_l`` (N x C, int8) is fixed: the first N*C bytes of SHAKE256 of the ASCII label
   ``rolloutcore.digest/rcd1:4096:16/key/<l>`` (l in decimal), row-major, as signed bytes.
4. digest(t) = BLAKE2b-128(person "rc-digest-tens") of ``"rcd1|<dtype>|<shape>|<n>"`` + ``\\0``
   + ``B_L``, as 32 hex digits. dtype is torch's name without "torch." ("bfloat16"), shape is
   the sizes joined by "," ("" for a 0-d tensor).

The combined digest of a set of named tensors is BLAKE2b-128(person "rc-digest-comb") of
``"rcd1|<count>|"`` followed, for each name in sorted order (Unicode code points), by the name's
UTF-8 length (uint32 LE), the name, and the tensor's 16 digest bytes; it does not depend on the
order in which the tensors were visited.

Collision bound (non-adversarial integrity)
-------------------------------------------
Family: each level is the linear map x -> x K^T over the integers, with a key matrix of
independent uniform bytes (a multilinear hash on signed bytes, N lanes). For two *different*
byte strings of the same length, chosen independently of the keys, the chance that a level maps
them to the same output is at most 256**-N = 2**-128: they differ at some byte i of some row,
with difference d != 0 (|d| <= 255); in each lane j the output difference is
d * K[j,i] + (terms without K[j,i]), which is zero for at most one of the 256 values of K[j,i];
the N lanes use disjoint key bytes, so the events are independent. Over L levels (union bound,
independent keys per level, injective int32 encoding), two different contents of the same
dtype, shape and length give the same ``B_L`` with probability <= L * 2**-128 = 6 * 2**-128, and
the final BLAKE2b-128 adds ~2**-128 (modelled as a random function): <= 7 * 2**-128 ~ 2.1e-38
per tensor. Tensors that differ in dtype, shape or length differ in the header: only the BLAKE2b
truncation can make them collide (~2**-128). The combined digest differs whenever one tensor's
digest (or the name set) differs, but for a further ~2**-128.

The bound is over the choice of keys. The keys are fixed (derived from a public label, like a
CRC's fixed polynomial), so it applies to errors that do not depend on the key values: flipped
bits in memory or transfer, a truncated, shifted, stale, zeroed, misordered or wrongly sharded
tensor, a restarted engine that loaded other weights. A single changed byte (a flipped bit)
always changes ``B_1`` (no key column is all zero; the tests check it).

This is NOT a cryptographic hash and must not be used to detect deliberate tampering: the keys
are public and the map is linear, so anyone can compute a non-zero byte difference in the kernel
of K and add it without changing the digest. That is acceptable here: the trainer is trusted,
and whoever can write the engine's GPU memory can change anything it reports anyway; the digest
exists to catch accidents in RolloutCore and the engines (partial or misdirected updates,
corruption, restarts), at a cost small enough to run on every update.

Exactness: all products and sums are integers below 2**26 in magnitude, so the GPU path
(``torch._int_mm``, int32 accumulation) and the CPU path (float64 matrix product: integers below
2**53 are exact in any summation order) give identical results on any device and run.
"""
from __future__ import annotations

import hashlib
import struct
import sys
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

ALGORITHM = "rcd1"
_MIN_MM_ROWS = 17      # torch._int_mm on CUDA wants more than 16 rows
_CPU_CHUNK_ROWS = 2048  # float64 rows per CPU matrix product (2048 x 4096 x 8 B = 64 MiB)
_PERSON_TENSOR = b"rc-digest-tens"
_PERSON_COMBINED = b"rc-digest-comb"


@dataclass(frozen=True)
class Spec:
    """The digest's parameters. ``RCD1`` is the one RolloutCore uses; others exist for benchmarks."""
    name: str = ALGORITHM
    row_bytes: int = 4096  # C
    lanes: int = 16        # N
    levels: int = 6        # L

    def __post_init__(self):
        if self.lanes % 8 or self.row_bytes % (4 * self.lanes) or self.row_bytes % 8:
            raise ValueError("digest spec: lanes must be a multiple of 8 and 4*lanes divide row_bytes")
        if self.row_bytes * 128 * 128 >= 2 ** 31:
            raise ValueError("digest spec: row_bytes too large for exact int32 sums")
        if self.row_bytes // (4 * self.lanes) < 2:
            raise ValueError("digest spec: each level must shrink the data")

    @property
    def shrink(self) -> int:
        """Output rows of one level that make one input row of the next."""
        return self.row_bytes // (4 * self.lanes)

    @property
    def max_bytes(self) -> int:
        return self.row_bytes * self.shrink ** (self.levels - 1)

    @property
    def final_bytes(self) -> int:
        return 4 * self.lanes

    def key_label(self, level: int) -> bytes:
        return f"rolloutcore.digest/{self.name}:{self.row_bytes}:{self.lanes}/key/{level}".encode()


RCD1 = Spec()

if sys.byteorder != "little":  # the definition is in little-endian bytes; so is every GPU
    raise ImportError("rolloutcore.digest assumes a little-endian host")


def _torch():
    import torch  # imported lazily: the rest of rolloutcore needs only the standard library
    return torch


_KEYS: Dict[Tuple[Spec, str], list] = {}


def key_matrices(spec: Spec = RCD1, device="cpu") -> list:
    """The L key matrices (N x C, int8, contiguous) on ``device``; computed once per device."""
    torch = _torch()
    dev = torch.device(device)
    cache_key = (spec, str(dev))
    keys = _KEYS.get(cache_key)
    if keys is None:
        keys = []
        for level in range(1, spec.levels + 1):
            raw = hashlib.shake_256(spec.key_label(level)).digest(spec.lanes * spec.row_bytes)
            k = torch.frombuffer(bytearray(raw), dtype=torch.int8).view(spec.lanes, spec.row_bytes)
            keys.append(k.to(dev).contiguous())
        _KEYS[cache_key] = keys
    return keys


def flat_bytes(t):
    """The tensor's logical contents in row-major order as a 1-D int8 tensor (a view if possible)."""
    torch = _torch()
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.int8, device=t.device)
    return t.reshape(-1).view(torch.int8)


def _header(spec: Spec, t, nbytes: int) -> bytes:
    dtype = str(t.dtype).replace("torch.", "")
    shape = ",".join(str(int(s)) for s in t.shape)
    return f"{spec.name}|{dtype}|{shape}|{nbytes}".encode() + b"\0"


def _finish(spec: Spec, header: bytes, final: bytes) -> str:
    assert len(final) == spec.final_bytes
    return hashlib.blake2b(header + final, digest_size=16, person=_PERSON_TENSOR).hexdigest()


def combine(digests: Dict[str, str], spec: Spec = RCD1) -> str:
    """The combined digest of named per-tensor digests (independent of the dict's order)."""
    h = hashlib.blake2b(digest_size=16, person=_PERSON_COMBINED)
    h.update(f"{spec.name}|{len(digests)}|".encode())
    for name in sorted(digests):
        raw = name.encode("utf-8")
        h.update(struct.pack("<I", len(raw)) + raw + bytes.fromhex(digests[name]))
    return h.hexdigest()


# --- the integer matrix product, one per device kind ---------------------------------------------

def _mm_cpu(x, key, out):
    """out[M, N] (int32) = x[M, C] (int8) @ key[N, C]^T, exactly, through float64 (see Exactness)."""
    torch = _torch()
    kt = key.t().to(torch.float64)
    for r0 in range(0, x.shape[0], _CPU_CHUNK_ROWS):
        r1 = min(x.shape[0], r0 + _CPU_CHUNK_ROWS)
        out[r0:r1] = torch.mm(x[r0:r1].to(torch.float64), kt).to(torch.int32)
    return out


def _mm_cuda(x, key, out):
    torch = _torch()
    if x.shape[0] < _MIN_MM_ROWS:  # pad with zero rows; their outputs are dropped
        pad = torch.zeros(_MIN_MM_ROWS - x.shape[0], x.shape[1], dtype=torch.int8, device=x.device)
        out.copy_(torch._int_mm(torch.cat([x, pad]), key.t())[: x.shape[0]])
        return out
    return torch._int_mm(x, key.t(), out=out)  # key.t() is column-major, as cuBLASLt wants


def _mm(x, key, out, mm=None):
    if mm is not None:
        return mm(x, key, out)
    return _mm_cuda(x, key, out) if x.is_cuda else _mm_cpu(x, key, out)


# --- the reference: the definition, one tensor at a time, on the CPU -----------------------------

def reference_digest(t, spec: Spec = RCD1) -> str:
    """digest(t) computed literally per the definition on the CPU (slow; for tests and checks)."""
    torch = _torch()
    data = flat_bytes(t).cpu()
    n = data.numel()
    if n > spec.max_bytes:
        raise ValueError(f"digest: tensor of {n} bytes is larger than {spec.max_bytes}")
    for key in key_matrices(spec, "cpu"):
        rows = max(1, -(-data.numel() // spec.row_bytes))
        x = torch.zeros(rows * spec.row_bytes, dtype=torch.int8)
        x[: data.numel()] = data
        y = torch.empty(rows, spec.lanes, dtype=torch.int32)
        _mm_cpu(x.view(rows, spec.row_bytes), key, y)
        data = y.reshape(-1).view(torch.int8)
    final = bytes(data.view(torch.uint8).tolist())
    return _finish(spec, _header(spec, t, n), final)


# --- the batched computation: every tensor of one device in a few launches -----------------------

def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _Plan:
    """Row layout of every level for a list of byte lengths, and the scatter indices it needs.

    Level 1 writes tensor i's R_i output rows at offset O_i of a zeroed buffer whose span per
    tensor is R_i rounded up to ``shrink`` rows; the zero rows are exactly the next level's
    padding, so that buffer read as bytes is the next level's input for all tensors at once.
    """

    def __init__(self, spec: Spec, sizes: Sequence[int], device):
        torch = _torch()
        C, S = spec.row_bytes, spec.shrink
        self.sizes = list(sizes)
        self.direct: List[Tuple[int, int, int]] = []   # (tensor, full rows, output row offset)
        self.staged: List[Tuple[int, int, int]] = []   # (tensor, byte start, byte count)
        stage_dest: List[int] = []
        rows = [max(1, _ceil_div(n, C)) for n in sizes]
        span = [_ceil_div(r, S) * S for r in rows]
        off = 0
        for i, n in enumerate(sizes):
            full = n // C
            if full >= _MIN_MM_ROWS:
                self.direct.append((i, full, off))
                if n > full * C:
                    self.staged.append((i, full * C, n - full * C))
                    stage_dest.append(off + full)
            else:
                self.staged.append((i, 0, n))
                stage_dest.extend(range(off, off + rows[i]))
            off += span[i]
        self.level1_rows = off
        self.stage_rows = len(stage_dest)
        self.stage_dest = torch.tensor(stage_dest, dtype=torch.int64).to(device)
        # Levels 2..L: input rows per tensor = previous span / S, contiguous in the product.
        self.levels: List[Tuple[int, Optional[object]]] = []  # (output buffer rows, scatter index)
        prev_span = span
        for level in range(2, spec.levels + 1):
            rows = [p // S for p in prev_span]
            if level == spec.levels:
                assert all(r == 1 for r in rows), "size bound violated"
                self.levels.append((len(rows), None))
                break
            span = [_ceil_div(r, S) * S for r in rows]
            dest, o = [], 0
            for r, s in zip(rows, span):
                dest.extend(range(o, o + r))
                o += s
            self.levels.append((o, torch.tensor(dest, dtype=torch.int64).to(device)))
            prev_span = span


_PLANS: Dict[tuple, _Plan] = {}


def _plan(spec: Spec, sizes: Sequence[int], device) -> _Plan:
    key = (spec, str(device), tuple(sizes))
    p = _PLANS.get(key)
    if p is None:
        if len(_PLANS) > 8:
            _PLANS.clear()
        p = _PLANS[key] = _Plan(spec, sizes, device)
    return p


def _final_rows(flats: list, spec: Spec, device, mm=None):
    """B_L of each flat int8 tensor (all on ``device``) as an int32 tensor [len(flats), N]."""
    torch = _torch()
    C, N = spec.row_bytes, spec.lanes
    sizes = [f.numel() for f in flats]
    for n in sizes:
        if n > spec.max_bytes:
            raise ValueError(f"digest: tensor of {n} bytes is larger than {spec.max_bytes}")
    plan = _plan(spec, sizes, device)
    keys = key_matrices(spec, device)
    y = torch.zeros(plan.level1_rows, N, dtype=torch.int32, device=device)
    if mm is None and device.type == "cuda":  # the bulk of the work: keep Python out of the way
        int_mm, key_t = torch._int_mm, keys[0].t()
        for i, full, off in plan.direct:  # full >= _MIN_MM_ROWS here
            int_mm(flats[i][: full * C].view(full, C), key_t, out=y[off: off + full])
    else:
        for i, full, off in plan.direct:
            _mm(flats[i][: full * C].view(full, C), keys[0], y[off: off + full], mm)
    if plan.staged:
        zeros = torch.zeros(C, dtype=torch.int8, device=device)
        pieces = []
        for i, start, count in plan.staged:
            pieces.append(flats[i][start: start + count])
            pad = _ceil_div(count, C) * C - count if count else C
            if pad:
                pieces.append(zeros[:pad])
        x = torch.cat(pieces).view(-1, C)
        z = torch.empty(x.shape[0], N, dtype=torch.int32, device=device)
        _mm(x, keys[0], z, mm)
        y.index_copy_(0, plan.stage_dest, z)
    for key, (out_rows, dest) in zip(keys[1:], plan.levels):
        x = y.view(torch.int8).view(-1, C)
        z = torch.empty(x.shape[0], N, dtype=torch.int32, device=device)
        _mm(x, key, z, mm)
        if dest is None:
            return z
        y = torch.zeros(out_rows, N, dtype=torch.int32, device=device)
        y.index_copy_(0, dest, z)
    return y  # only when L == 1


def tensor_digests(tensors: Sequence, spec: Spec = RCD1, mm=None) -> List[str]:
    """digest(t) of each tensor, computed on the device that holds it (batched per device)."""
    torch = _torch()
    out: List[Optional[str]] = [None] * len(tensors)
    by_device: Dict[str, List[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(str(t.device), []).append(i)
    with torch.inference_mode():
        for dev, idx in by_device.items():
            flats = [flat_bytes(tensors[i]) for i in idx]
            final = _final_rows(flats, spec, torch.device(dev), mm).cpu()
            raw, w = bytes(final.view(torch.uint8).reshape(-1).tolist()), spec.final_bytes
            for j, i in enumerate(idx):
                out[i] = _finish(spec, _header(spec, tensors[i], flats[j].numel()),
                                 raw[j * w:(j + 1) * w])
    return out  # type: ignore[return-value]


def digest(t, spec: Spec = RCD1) -> str:
    return tensor_digests([t], spec)[0]


def named_digest(named: Iterable[Tuple[str, object]], spec: Spec = RCD1, mm=None) -> dict:
    """{"algorithm", "tensors": {name: hex}, "combined": hex, "bytes": n, "elapsed_ms": t}.

    Waits for all queued work on the tensors' GPUs first (an update still being copied in must
    land before it is digested); elapsed_ms covers that wait and the whole computation.
    """
    torch = _torch()
    t0 = time.perf_counter()
    items = list(named)
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise ValueError("digest: duplicate tensor names")
    tensors = [t for _, t in items]
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    for d in devices:
        torch.cuda.synchronize(d)
    hexes = tensor_digests(tensors, spec, mm)
    per = dict(zip(names, hexes))
    return {"algorithm": spec.name, "tensors": per, "combined": combine(per, spec),
            "bytes": sum(t.numel() * t.element_size() for t in tensors),
            "elapsed_ms": round((time.perf_counter() - t0) * 1e3, 3)}
