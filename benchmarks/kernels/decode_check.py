"""The GPU correctness pass of benchmarks/kernels/bench_decode.py, run before any timing: the decode kernel
against kernels/reference.py over dtypes, block sizes, MHA and GQA heads, head sizes, NaN-poisoned
cache slots, split against unsplit, the cached-plan relaunch path, CUDA-graph replay with changing
context_lens, and the fused K/V write. Also the helpers the benchmark shares with it (random paged
cases, relative error, a process pool for compiling kernel variants)."""

from __future__ import annotations

import os

import torch

from benchmarks.kernels.decode_report import GQA_HEAD_DIMS, HEAD_DIM

def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def pool_map(fn, jobs: list, workers: int = 14) -> list:
    """fn over jobs in spawned processes (each its own CUDA context): Triton compiles on the host
    CPU, one kernel variant at a time per process, and writes its on-disk cache, which the main
    process then reads instead of compiling."""
    import concurrent.futures as cf
    import multiprocessing as mp

    if not jobs:
        return []
    with cf.ProcessPoolExecutor(min(workers, len(jobs), os.cpu_count() or 1), mp_context=mp.get_context("spawn")) as ex:
        return list(ex.map(fn, jobs))


def make_case(lens, heads, kv_heads, bs, dtype, head_dim=HEAD_DIM, extra_cols=0, dev="cuda"):
    """Scattered paged cache holding exactly the owned slots; every other slot is NaN."""
    from kernels.reference import kv_write_ref

    nb = [(n + bs - 1) // bs for n in lens]
    num_blocks = sum(nb) + 5
    shape = (num_blocks, bs, kv_heads, head_dim)
    kc = torch.full(shape, float("nan"), dtype=dtype, device=dev)
    vc = torch.full(shape, float("nan"), dtype=dtype, device=dev)
    perm = torch.randperm(num_blocks, device=dev)
    bt = torch.full((len(lens), max(nb) + extra_cols), 1 << 30, dtype=torch.int32, device=dev)
    used, slots = 0, []
    for s, (n, k) in enumerate(zip(lens, nb)):
        ids = perm[used : used + k]
        used += k
        bt[s, :k] = ids.int()
        t = torch.arange(n, device=dev)
        slots.append(ids[t // bs] * bs + t % bs)
    slots = torch.cat(slots)
    kv = torch.randn(2, len(slots), kv_heads, head_dim, device=dev, dtype=dtype)
    kv_write_ref(kv[0], kv[1], kc, vc, slots)
    q = torch.randn(len(lens), heads, head_dim, device=dev, dtype=dtype)
    return q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32, device=dev)


TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _check_combo(job) -> tuple[int, list[str]]:
    """One (dtype, block size, heads, head_dim): default and forced split counts, each launched
    twice (the second through the cached-plan fast path), then the fused K/V write."""
    from kernels.paged_decode import paged_decode
    from kernels.reference import kv_write_ref, paged_decode_ref

    dtype, bs, heads, kvh, d = job
    fails, n = [], 0
    lens = [1, bs - 1, bs, bs + 1, 1000, 3000]
    q, kc, vc, bt, ctx = make_case(lens, heads, kvh, bs, dtype, head_dim=d)
    scale = d**-0.5
    ref = paged_decode_ref(q, kc, vc, bt, ctx, scale)
    for ns in (None, 1, 4, 7):
        for rep in range(2):
            out = torch.full_like(q, float("nan"))
            paged_decode(q, kc, vc, bt, ctx, scale, num_splits=ns, out=out)
            err = rel_err(out, ref)
            n += 1
            if not err < TOL[dtype]:
                fails.append(f"decode {dtype} bs={bs} heads={heads}/{kvh} d={d} splits={ns} rep={rep}: rel {err:.2e}")
    # Fused K/V write: this step's token comes from k_new/v_new; its (NaN) slot must not be read.
    last = ctx.long() - 1
    rows = torch.arange(len(lens), device="cuda")
    slots = bt.long()[rows, last // bs] * bs + last % bs
    kv_new = torch.randn(2, len(lens), kvh, d, device="cuda", dtype=dtype)
    want_k, want_v = kc.clone(), vc.clone()
    kv_write_ref(kv_new[0], kv_new[1], want_k, want_v, slots)
    ref = paged_decode_ref(q, want_k, want_v, bt, ctx, scale)
    kc.view(-1, kvh, d)[slots] = float("nan")
    vc.view(-1, kvh, d)[slots] = float("nan")
    for ns in (None, 1, 5):
        kt, vt = kc.clone(), vc.clone()
        out = paged_decode(q, kt, vt, bt, ctx, scale, num_splits=ns, k_new=kv_new[0], v_new=kv_new[1],
                           slot_mapping=slots.int())
        err = rel_err(out, ref)
        n += 1
        if not (err < TOL[dtype] and torch.equal(kt.nan_to_num(7), want_k.nan_to_num(7))
                and torch.equal(vt.nan_to_num(7), want_v.nan_to_num(7))):
            fails.append(f"fused kv write {dtype} heads={heads}/{kvh} d={d} splits={ns}: rel {err:.2e}")
    return n, fails


def _graph_check(heads: int, kvh: int, d: int, dtype: torch.dtype) -> list[str]:
    """Capture once with num_splits chosen from shapes, replay with new context_lens."""
    from kernels.paged_decode import paged_decode
    from kernels.reference import paged_decode_ref

    q, kc, vc, bt, ctx = make_case([2048] * 4, heads, kvh, 16, dtype, head_dim=d)
    out = torch.empty_like(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        paged_decode(q, kc, vc, bt, ctx, 0.125, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        paged_decode(q, kc, vc, bt, ctx, 0.125, out=out)
    fails = []
    for trial in range(5):
        ctx.copy_(torch.randint(1, 2049, (4,), dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        g.replay()
        err = rel_err(out, paged_decode_ref(q, kc, vc, bt, ctx, 0.125))
        if not err < TOL[dtype]:
            fails.append(f"graph replay {heads}/{kvh} d={d} {trial} ctx={ctx.tolist()}: rel {err:.2e}")
    return fails


def check() -> list[str]:
    """Correctness on the GPU (compiled kernels, not the interpreter). Returns failure messages."""
    from kernels.kv_write import kv_write
    from kernels.reference import kv_write_ref

    f16, bf16 = torch.float16, torch.bfloat16
    combos = [(f16, bs, h, kvh, 64) for bs in (8, 16, 64, 256) for h, kvh in ((12, 12), (12, 4), (8, 1))]
    combos += [(bf16, bs, h, kvh, 64) for bs in (16, 256) for h, kvh in ((12, 12), (16, 2))]
    combos += [(f16, bs, 12, 12, 64) for bs in (32, 128)]
    combos += [(bf16, bs, h, 8, d) for bs in (16, 64) for h in (16, 32, 64) for d in GQA_HEAD_DIMS]  # GQA 2/4/8
    results = pool_map(_check_combo, combos)
    n = sum(r[0] for r in results)
    fails = [f for r in results for f in r[1]]
    for heads, kvh, d, dtype in ((12, 12, 64, f16), (32, 8, 128, bf16), (16, 8, 64, bf16)):
        fails += _graph_check(heads, kvh, d, dtype)
        n += 5
    # kv_write: listed slots written, all others (NaN-poisoned) bit-identical.
    for sd in (torch.int32, torch.int64):
        kc = torch.randn(64, 16, 12, 64, device="cuda", dtype=torch.float16)
        kc.view(-1)[::5] = float("nan")
        vc = kc.clone()
        k, v = torch.randn(2, 100, 12, 64, device="cuda", dtype=torch.float16)
        slots = torch.randperm(64 * 16, device="cuda")[:100].to(sd)
        slots[::3] = -1
        kr, vr = kc.clone(), vc.clone()
        kv_write_ref(k, v, kr, vr, slots)
        kv_write(k, v, kc, vc, slots)
        torch.cuda.synchronize()
        n += 1
        if not (torch.equal(kc.view(torch.int16), kr.view(torch.int16)) and torch.equal(vc.view(torch.int16), vr.view(torch.int16))):
            fails.append(f"kv_write slot dtype {sd}: cache differs")
    print(f"check: {n - len(fails)}/{n} passed", flush=True)
    for f in fails:
        print("  FAIL", f, flush=True)
    return fails
