#!/usr/bin/env python3
"""Times the rcd1 weight digest on a Qwen3-8B-shaped set of bf16 tensors (~16.4 GB) on one GPU.

Side by side in one run: the int64-sum bandwidth floor (one pass over the same bytes), a naive
torch mixing digest (position multipliers from `arange`, int64 temporaries), rcd1 as shipped
(torch._int_mm), and variants (another row width; the same product as a Triton kernel, when
Triton imports). Then checks the GPU digest against the CPU reference on a sample of tensors,
including odd sizes, a non-contiguous view, an empty and a 0-d tensor.

    python3 bench/gpu/digest/digest_bench.py [--reps 15] [--out DIR]

Prints a table; writes DIR/digest_bench.json (the current directory by default).
"""
import argparse
import cProfile
import io
import json
import pathlib
import pstats
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "python"))

import torch  # noqa: E402

from rolloutcore import digest as D  # noqa: E402


def qwen3_8b_shapes():
    hidden, inter, layers, vocab, q_heads, kv_heads, head_dim = 4096, 12288, 36, 151936, 32, 8, 128
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (q_heads * head_dim, hidden)),
                (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
                (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
                (p + "self_attn.o_proj.weight", (hidden, q_heads * head_dim)),
                (p + "self_attn.q_norm.weight", (head_dim,)),
                (p + "self_attn.k_norm.weight", (head_dim,)),
                (p + "mlp.gate_proj.weight", (inter, hidden)),
                (p + "mlp.up_proj.weight", (inter, hidden)),
                (p + "mlp.down_proj.weight", (hidden, inter)),
                (p + "input_layernorm.weight", (hidden,)),
                (p + "post_attention_layernorm.weight", (hidden,))]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]  # not tied
    return out


def make_params(device, shrink=1):
    """One allocation, every tensor a view into it (256-byte aligned), filled from torch.randn.
    shrink > 1 divides the large dimensions (a quick functional run, e.g. on a CPU)."""
    shapes = [(n, tuple(d // shrink if d > 1024 else d for d in s)) for n, s in qwen3_8b_shapes()]
    numels = [1 for _ in shapes]
    for j, (_, s) in enumerate(shapes):
        for d in s:
            numels[j] *= d
    total = sum(numels)
    flat = torch.empty(total, dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device=device).manual_seed(15)
    step = 1 << 28
    for a in range(0, total, step):
        b = min(total, a + step)
        flat[a:b] = torch.randn(b - a, generator=gen, device=device, dtype=torch.float32)
    params, off = [], 0
    for (name, s), n in zip(shapes, numels):
        params.append((name, flat[off: off + n].view(s)))
        off += n
    return flat, params


def timed(fn, reps, warm):
    """Wall time of fn() (each ends in a host read, so it includes the wait) and CUDA event time."""
    cuda = torch.cuda.is_available()
    for _ in range(warm):
        fn()
    walls, gpus, results = [], [], []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        t0 = time.perf_counter()
        r = fn()
        if cuda:
            e.record()
            torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
        gpus.append(s.elapsed_time(e) if cuda else float("nan"))
        results.append(r)
    return {"median_ms": statistics.median(walls), "min_ms": min(walls), "max_ms": max(walls),
            "median_event_ms": statistics.median(gpus), "reps": reps}, results


def naive_digest(tensors):
    """The formulation to beat: per-position multipliers from arange, int64 temporaries."""
    mix = 0x9E3779B97F4A7C15 - (1 << 64)
    hs = []
    for t in tensors:
        w = t.reshape(-1).view(torch.int16).to(torch.int64)
        pos = torch.arange(w.numel(), device=t.device, dtype=torch.int64)
        hs.append(((w ^ (pos * mix)) * (2 * pos + 1)).sum())
    return torch.stack(hs).sum().item()


def triton_mm_factory():
    """out = x @ key^T (int8 in, int32 out, exact) as a Triton kernel; split over C when the
    tensor has few rows (int32 atomic adds are exact, so the result does not depend on order)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, k_ptr, y_ptr, M, C, N: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
               SPLIT: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        rmask = rows < M
        lanes = tl.arange(0, N)
        cols = tl.arange(0, BK)
        part = C // SPLIT
        acc = tl.zeros((BM, N), dtype=tl.int32)
        xrow = x_ptr + rows.to(tl.int64)[:, None] * C
        for k0 in range(pid_k * part, (pid_k + 1) * part, BK):
            a = tl.load(xrow + (k0 + cols)[None, :], mask=rmask[:, None], other=0)
            b = tl.load(k_ptr + lanes[None, :] * C + (k0 + cols)[:, None])
            acc += tl.dot(a, b, out_dtype=tl.int32)
        yp = y_ptr + rows.to(tl.int64)[:, None] * N + lanes[None, :]
        if SPLIT == 1:
            tl.store(yp, acc, mask=rmask[:, None])
        else:
            tl.atomic_add(yp, acc, mask=rmask[:, None])

    BM, BK, target = 64, 256, 2 * 132

    def mm(x, key, out):
        M, C = x.shape
        nb = triton.cdiv(M, BM)
        split = 1
        while nb * split < target and split * 2 * BK <= C and C % (split * 2 * BK) == 0:
            split *= 2
        if split > 1:
            out.zero_()
        kernel[(nb, split)](x, key, out, M, C, N=key.shape[0], BM=BM, BK=BK, SPLIT=split,
                            num_warps=4, num_stages=4)
        return out

    return mm, triton.__version__


def graph_runner(tensors, dev):
    """Captures rcd1's device work for these tensors once; the returned function replays it."""
    flats = [D.flat_bytes(t) for t in tensors]
    D._final_rows(flats, D.RCD1, dev)  # plan, keys and cuBLAS state ready before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = D._final_rows(flats, D.RCD1, dev)

    def run():
        graph.replay()
        return out.cpu()
    return run


def check_sample(params, device, mm_variants):
    """GPU digests (each product backend) == CPU reference on a sample, odd cases included."""
    C = D.RCD1.row_bytes
    by = dict(params)
    sample = [(n, by[n]) for n in ("model.layers.0.self_attn.q_norm.weight",
                                   "model.layers.0.input_layernorm.weight",
                                   "model.layers.0.self_attn.k_proj.weight",
                                   "model.layers.0.self_attn.q_proj.weight",
                                   "model.layers.0.mlp.down_proj.weight",
                                   "model.embed_tokens.weight")]
    g = torch.Generator(device=device).manual_seed(7)
    odd = [("transposed k_proj (non-contiguous)", by["model.layers.1.self_attn.k_proj.weight"].t()),
           ("int8, 40 rows + 3 bytes",
            torch.randint(-128, 128, (C * 40 + 3,), generator=g, device=device, dtype=torch.int8)),
           ("float32 x 1000", torch.randn(1000, generator=g, device=device)),
           ("float16 [17, C/2 + 1]", torch.randn(17, C // 2 + 1, generator=g, device=device).half()),
           ("empty", torch.empty(0, 4, device=device)),
           ("0-d", torch.tensor(1.5, device=device))]
    if hasattr(torch, "float8_e4m3fn"):
        odd.append(("float8_e4m3fn x (C*17+100)",
                    torch.randn(C * 17 + 100, generator=g, device=device).to(torch.float8_e4m3fn)))
    tensors = sample + odd
    t0 = time.perf_counter()
    ref = [D.reference_digest(t) for _, t in tensors]
    ref_s = time.perf_counter() - t0
    out = {"cpu_reference_s": round(ref_s, 2), "tensors": [n for n, _ in tensors], "backends": {}}
    for name, mm in mm_variants.items():
        got = D.tensor_digests([t for _, t in tensors], mm=mm)
        out["backends"][name] = {"equal": got == ref,
                                 "mismatch": [n for (n, _), a, b in zip(tensors, got, ref) if a != b]}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--naive-reps", type=int, default=5)
    ap.add_argument("--out", default=".")
    ap.add_argument("--no-variants", action="store_true", help="time rcd1 as shipped only")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shrink", type=int, default=1, help="divide large dimensions (smoke runs)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    info = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
            "torch": torch.__version__, "cuda": torch.version.cuda, "shrink": args.shrink}
    flat, params = make_params(dev, args.shrink)
    tensors = [t for _, t in params]
    nbytes = flat.numel() * flat.element_size()
    info.update(tensors=len(params), bytes=nbytes)
    print(json.dumps(info), flush=True)
    rows, errors = {}, {}

    rows["floor: int64 sum, one pass over the buffer"], _ = timed(
        lambda: flat.view(torch.int64).sum().item(), args.reps, 3)
    rows["floor: int64 sum per tensor"], _ = timed(
        lambda: torch.stack([t.view(torch.int64).sum() for t in tensors]).sum().item(), args.reps, 3)
    rows["naive: arange multipliers, int64 temporaries"], _ = timed(
        lambda: naive_digest(tensors), args.naive_reps, 1)

    stat, res = timed(lambda: D.named_digest(params), args.reps, 3)
    stat["elapsed_ms_reported_median"] = statistics.median(r["elapsed_ms"] for r in res)
    stat["deterministic"] = len({r["combined"] for r in res}) == 1
    stat["combined"] = res[0]["combined"]
    if dev.type == "cuda":  # extra device memory one digest needs (its temporaries)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        D.named_digest(params)
        stat["transient_bytes"] = torch.cuda.max_memory_allocated(dev) - base
    spec = D.RCD1
    shipped = f"rcd1 (C={spec.row_bytes}, N={spec.lanes}, L={spec.levels}), torch._int_mm"
    rows[shipped] = stat

    keys = D.key_matrices(D.RCD1, dev)
    C = spec.row_bytes
    flats = [D.flat_bytes(t) for t in tensors]
    direct = [f[: f.numel() // C * C].view(-1, C) for f in flats if f.numel() >= 17 * C]
    outs = [torch.empty(x.shape[0], spec.lanes, dtype=torch.int32, device=dev) for x in direct]
    rows["part of rcd1: the level-1 products of the large tensors"], _ = timed(
        lambda: [D._mm(x, keys[0], o) for x, o in zip(direct, outs)][-1][0, 0].item(), args.reps, 3)
    rows["part of rcd1: the level-1 products of the large tensors"]["note"] = \
        "through the generic _mm wrapper (the shipped loop calls torch._int_mm directly)"
    outs.clear()

    notes = {}
    if dev.type == "cuda":
        try:  # what replaying the whole launch sequence as one CUDA graph would give
            run = graph_runner(tensors, dev)
            eager = D._final_rows([D.flat_bytes(t) for t in tensors], spec, dev).cpu()
            stat, res = timed(run, args.reps, 3)
            stat["same_as_eager"] = all(torch.equal(r, eager) for r in res)
            rows["rcd1 products replayed as one CUDA graph (no finishing)"] = stat
        except Exception as e:
            errors["cuda graph"] = repr(e)[:1000]
    prof = cProfile.Profile()  # where one call spends its host time
    prof.enable()
    D.named_digest(params)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    notes["profile_tottime_top12"] = text.getvalue()

    mm_variants = {"int_mm": None}
    if not args.no_variants:
        alt = D.Spec(name="alt", row_bytes=16384, lanes=16, levels=4)
        try:
            rows["variant C=16384 L=4 (64 MB transient), torch._int_mm"], _ = timed(
                lambda: D.tensor_digests(tensors, alt), args.reps, 3)
        except Exception as e:  # a variant failing must not lose the rest of the run
            errors["variant C=16384"] = repr(e)[:500]
        try:
            tmm, tver = triton_mm_factory()
            info["triton"] = tver
            stat, res = timed(lambda: D.tensor_digests(tensors, mm=tmm), args.reps, 3)
            stat["same_as_int_mm"] = D.combine(dict(zip([n for n, _ in params], res[0]))) == \
                rows[shipped]["combined"]
            rows["rcd1, Triton kernel for the product"] = stat
            mm_variants["triton"] = tmm
        except Exception as e:
            errors["triton"] = repr(e)[:2000]

    check = check_sample(params, dev, mm_variants)
    floor = rows["floor: int64 sum, one pass over the buffer"]["median_ms"]
    print(f"\n{'what':58} {'median ms':>10} {'min':>8} {'max':>8} {'event ms':>9} {'x floor':>8}")
    for name, r in rows.items():
        print(f"{name:58} {r['median_ms']:10.2f} {r['min_ms']:8.2f} {r['max_ms']:8.2f} "
              f"{r['median_event_ms']:9.2f} {r['median_ms'] / floor:8.2f}")
    print("\ncheck against the CPU reference:", json.dumps(check))
    if errors:
        print("errors:", json.dumps(errors))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "digest_bench.json").write_text(json.dumps(
        {"info": info, "rows": rows, "check": check, "errors": errors, "notes": notes}, indent=1))
    print("\nhost profile of one call (cProfile, tottime):\n" +
          "\n".join(notes["profile_tottime_top12"].splitlines()[:30]))
    ok = all(b["equal"] for b in check["backends"].values())
    print("CHECK", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
