"""The rcd1 weight digest (rolloutcore.digest) on the CPU, and on a GPU when there is one."""
import hashlib
import operator
import struct

import pytest

torch = pytest.importorskip("torch")

from rolloutcore import digest as D  # noqa: E402
from rolloutcore.vllm_ext import RolloutCoreWorkerExtension  # noqa: E402

C = D.RCD1.row_bytes
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2] if hasattr(torch, "float8_e4m3fn") else []


def spec_digest_py(data: bytes, dtype: str, shape: str) -> str:
    """The module docstring's definition in plain Python (no torch), for small inputs."""
    n, lanes = len(data), 16
    for level in range(1, 7):
        key = hashlib.shake_256(f"rolloutcore.digest/rcd1:4096:16/key/{level}".encode()).digest(
            lanes * 4096)
        krows = [struct.unpack("4096b", key[j * 4096:(j + 1) * 4096]) for j in range(lanes)]
        rows = max(1, -(-len(data) // 4096))
        padded = data + bytes(rows * 4096 - len(data))
        out = bytearray()
        for r in range(rows):
            x = struct.unpack("4096b", padded[r * 4096:(r + 1) * 4096])
            for k in krows:
                out += struct.pack("<i", sum(map(operator.mul, x, k)))
        data = bytes(out)
    assert len(data) == 64
    header = f"rcd1|{dtype}|{shape}|{n}".encode() + b"\0"
    return hashlib.blake2b(header + data, digest_size=16, person=b"rc-digest-tens").hexdigest()


def raw(t) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def weights(rows=64, cols=4096, seed=1, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g).to(dtype)


def test_definition_matches_plain_python_spec():
    # Proves the torch code computes exactly the documented definition (key derivation, signed
    # bytes, zero padding, little-endian int32, header) on odd, multi-row and empty inputs; would
    # catch an implementation that drifted from the docstring, i.e. digests nobody can recompute.
    g = torch.Generator().manual_seed(3)
    cases = [torch.randint(-128, 128, (3 * C + 5,), generator=g, dtype=torch.int8),
             torch.randn(7, 3, generator=g).to(torch.bfloat16),
             torch.empty(0, 2),
             torch.tensor(2.5)]
    for t in cases:
        want = spec_digest_py(raw(t), str(t.dtype).replace("torch.", ""),
                              ",".join(str(s) for s in t.shape))
        assert D.reference_digest(t) == want
        assert D.digest(t) == want


KNOWN_ARANGE = "ce87141c3c2a984a4163e1d268ca73b6"    # rcd1 of arange(10000, int32) as [100, 100]
KNOWN_COMBINED = "82cef87fb1e6d01604075798d60cb265"  # rcd1 combined of the two tensors below


def test_known_answers_do_not_change():
    # Proves the definition is frozen: fixed inputs give the digests recorded when rcd1 was
    # defined; would catch any change to the algorithm that would make digests journaled by an
    # older version incomparable (a change needs a new algorithm name instead).
    t = torch.arange(10000, dtype=torch.int32).reshape(100, 100)
    assert D.digest(t) == KNOWN_ARANGE
    assert D.named_digest([("a", t), ("b", torch.zeros(3, dtype=torch.bfloat16))])["combined"] \
        == KNOWN_COMBINED


def test_deterministic_across_calls_and_copies():
    # Proves the same bytes give the same digest every time, from a separate copy and in another
    # batch; would catch dependence on addresses, allocation, batch composition or run order.
    w = weights()
    first = D.digest(w)
    assert D.digest(w) == first
    assert D.digest(w.clone()) == first
    assert D.tensor_digests([torch.ones(5), w, weights(seed=2)])[1] == first


def test_every_kind_of_damage_changes_the_digest():
    # Proves a flipped bit (first, middle, last byte), swapped elements, a zeroed block, a shift
    # by one element, truncation and appended zero bytes all change the digest, and that no two
    # damages collide; would catch a digest blind to position, to content, or to length.
    w = weights(rows=80)  # 80 rows of 8 KiB: more than one level-1 row per tensor row
    flat = w.reshape(-1)
    damaged = {"original": w}

    def flip(byte_index, bit):
        b = w.clone().reshape(-1).view(torch.uint8)
        b[byte_index] ^= 1 << bit
        return b.view(torch.bfloat16).view(w.shape)

    n = w.numel() * 2
    damaged["bit 0 of byte 0"] = flip(0, 0)
    damaged["bit 7 of the middle byte"] = flip(n // 2, 7)
    damaged["bit 3 of the last byte"] = flip(n - 1, 3)
    s = flat.clone()
    i, j = 10, 123457
    assert s[i] != s[j]
    s[i], s[j] = flat[j], flat[i]
    damaged["two elements swapped"] = s.view(w.shape)
    z = w.clone()
    z[20:24, 1000:3000] = 0
    damaged["zeroed block"] = z
    damaged["shifted by one element"] = torch.roll(flat, 1).view(w.shape)
    damaged["last row dropped"] = w[:-1]
    damaged["first element dropped"] = flat[1:]
    u8 = w.reshape(-1).view(torch.uint8)
    damaged["as bytes"] = u8
    damaged["as bytes plus a zero byte"] = torch.cat([u8, torch.zeros(1, dtype=torch.uint8)])
    digests = dict(zip(damaged, D.tensor_digests(list(damaged.values()))))
    assert len(set(digests.values())) == len(digests), digests


def test_no_key_column_is_zero_so_one_changed_byte_always_changes_level_one():
    # Proves every byte position has a non-zero key column at every level, so a single changed
    # byte (a flipped bit) always changes that level's output; would catch a key derivation that
    # leaves a position unhashed (the random-key bound would then fail deterministically there).
    for key in D.key_matrices():
        assert key.shape == (D.RCD1.lanes, C)
        assert bool((key != 0).any(dim=0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8,
                                   torch.uint8, torch.bool] + FP8)
def test_dtypes_batched_equals_reference(dtype):
    # Proves every weight dtype (fp8 where torch has it) is digested from its raw bytes, batched
    # and reference paths agreeing, with the dtype in the digest; would catch a dtype that fails
    # to view as bytes or two dtypes with the same bits sharing a digest.
    g = torch.Generator().manual_seed(5)
    t = (torch.randn(37, 1031, generator=g) * 4).to(dtype)
    assert D.tensor_digests([t])[0] == D.reference_digest(t)
    other = torch.int16 if t.element_size() == 2 else torch.int32 if t.element_size() == 4 else None
    if other is not None:
        assert D.digest(t.view(other)) != D.digest(t)


def test_empty_and_zero_d_tensors():
    # Proves empty tensors and 0-d scalars digest (one zero row) and differ by shape and value;
    # would catch a crash on empty parameters or empty tensors of different shapes colliding.
    ds = D.tensor_digests([torch.empty(0), torch.empty(0, 4), torch.empty(4, 0), torch.tensor(1.0),
                           torch.tensor(2.0), torch.zeros(1)])
    assert len(set(ds)) == 6
    assert ds[0] == D.reference_digest(torch.empty(0))
    assert ds[3] == D.reference_digest(torch.tensor(1.0))


def test_non_contiguous_tensor_digests_its_row_major_contents():
    # Proves a transposed or strided view is digested as its logical row-major contents (equal to
    # the contiguous copy, not to the underlying storage); would catch hashing storage order,
    # which would make an engine's layout choice look like a weight mismatch or hide one.
    w = weights(rows=96, cols=200, dtype=torch.float32)
    for view in (w.t(), w[:, ::3], w[10:50:2, 7:]):
        assert not view.is_contiguous()
        assert D.digest(view) == D.digest(view.contiguous()) == D.reference_digest(view)
    assert D.digest(w.t()) != D.digest(w)


def test_batched_layout_matches_reference_at_every_boundary():
    # Proves the batched path (direct products, staged tails and small tensors, scatter between
    # levels) equals the per-tensor reference for sizes at every row, 17-row and 64-row boundary,
    # alone and all in one batch; would catch an off-by-one in the padding or the row offsets.
    g = torch.Generator().manual_seed(9)
    sizes = [0, 1, C - 1, C, C + 1, 16 * C, 17 * C - 1, 17 * C, 17 * C + 1, 64 * C - 3, 64 * C,
             64 * C + 1, 65 * C + 7, 130 * C]
    ts = [torch.randint(-128, 128, (n,), generator=g, dtype=torch.int8) for n in sizes]
    ref = [D.reference_digest(t) for t in ts]
    assert D.tensor_digests(ts) == ref
    assert D.tensor_digests(ts[::-1]) == ref[::-1]
    assert [D.digest(t) for t in ts[:4]] == ref[:4]


def test_size_limit_and_small_spec():
    # Proves a tensor larger than the spec's limit is refused rather than digested wrongly and
    # that the batched code honours other parameters (here C=256, N=8, L=2); would catch the
    # last level silently producing more than one row.
    spec = D.Spec(name="tiny", row_bytes=256, lanes=8, levels=2)
    assert spec.max_bytes == 2048
    ok = torch.arange(2048, dtype=torch.uint8)
    assert D.tensor_digests([ok], spec) == [D.reference_digest(ok, spec)]
    with pytest.raises(ValueError):
        D.tensor_digests([torch.zeros(2049, dtype=torch.uint8)], spec)
    with pytest.raises(ValueError):
        D.Spec(row_bytes=1 << 17)  # int32 sums would no longer be exact


def test_named_digest_is_order_independent_and_name_sensitive():
    # Proves the combined digest depends on the set of (name, digest) pairs only, changes with a
    # renamed or changed tensor, and that bytes counts every tensor; would catch a combined digest
    # that depends on named_parameters() order or ignores names.
    items = [("b.weight", weights(rows=3)), ("a.weight", weights(rows=5, seed=4)),
             ("c.bias", torch.ones(7))]
    one = D.named_digest(items)
    assert set(one) >= {"tensors", "combined", "bytes", "elapsed_ms", "algorithm"}
    assert one["combined"] == D.named_digest(items[::-1])["combined"]
    assert one["combined"] == D.combine(one["tensors"])
    assert one["bytes"] == (3 + 5) * 4096 * 2 + 7 * 4
    renamed = [("x.weight", items[0][1])] + items[1:]
    assert D.named_digest(renamed)["combined"] != one["combined"]
    changed = items[:2] + [("c.bias", torch.ones(7) * 2)]
    again = D.named_digest(changed)
    assert again["combined"] != one["combined"]
    assert again["tensors"]["a.weight"] == one["tensors"]["a.weight"]
    with pytest.raises(ValueError):
        D.named_digest(items + [items[0]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpu_equals_cpu():
    # Proves the GPU path (torch._int_mm, batched) gives the CPU reference's digests bit for bit,
    # small and multi-level tensors, odd sizes and a non-contiguous view included; would catch an
    # inexact or layout-dependent GPU product.
    g = torch.Generator().manual_seed(11)
    cpu = [weights(rows=2048), weights(rows=3),
           torch.randint(-128, 128, (40 * C + 3,), generator=g, dtype=torch.int8),
           torch.empty(0), torch.randn(300, 77, generator=g).t()]
    gpu = [t.cuda() for t in cpu]
    assert D.tensor_digests(gpu) == [D.reference_digest(t) for t in cpu]


class _Runner:
    def __init__(self, model, wrapped=False):
        if wrapped:
            self.get_model = lambda: model
        else:
            self.model = model


class _Worker(RolloutCoreWorkerExtension):
    def __init__(self, runner, rank=0):
        self.model_runner = runner
        self.rank = rank


def test_worker_extension_digests_the_model_parameters():
    # Proves rc_weight_digest returns one digest per named parameter, the combined digest of
    # them, the byte count and timing, through get_model() or .model; would catch the extension
    # digesting something other than the worker's parameters, or failing without a model.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.LayerNorm(32)).to(torch.bfloat16)
    got = _Worker(_Runner(model), rank=1).rc_weight_digest()
    names = [n for n, _ in model.named_parameters()]
    assert sorted(got["tensors"]) == sorted(names)
    assert got["tensors"]["0.weight"] == D.reference_digest(model[0].weight)
    assert got["combined"] == D.combine(got["tensors"])
    assert got["bytes"] == sum(p.numel() * 2 for p in model.parameters())
    assert got["rank"] == 1 and got["algorithm"] == "rcd1" and got["elapsed_ms"] >= 0
    assert _Worker(_Runner(model, wrapped=True)).rc_weight_digest()["combined"] == got["combined"]
    with torch.no_grad():
        model[1].bias[3] += 1
    assert _Worker(_Runner(model)).rc_weight_digest()["combined"] != got["combined"]
    with pytest.raises(RuntimeError):
        _Worker(None).rc_weight_digest()
