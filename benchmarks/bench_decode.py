"""Paged-decode benchmark (GPU): flashpage's Triton kernel against SDPA flash and an eager gather.

One process, medians of ``triton.testing.do_bench`` (L2 flushed between runs):
  copy                   large device-to-device copy; bytes read + written (the card's ceiling)
  flashpage              kernels.paged_decode over a scattered paged cache (random block permutation)
  sdpa_flash_contiguous  torch SDPA, flash backend forced, same K/V stored [batch, heads, ctx, d]
  eager_paged            gather pages via the block table into contiguous K/V, QK^T, softmax, .V
Shapes: batch {1,8,32,128,256} x context {128,...,16384}, 12 heads x 64, block_size 16, fp16.
Metric: achieved TB/s = K/V bytes that must be read (2*batch*context*heads*d*2) / time.
Before timing, a correctness pass (reference, GQA, bf16, block sizes, NaN-poisoned cache, split vs
unsplit, CUDA-graph replay with changing context_lens, kv_write) and, per shape, ours vs SDPA.

  python benchmarks/bench_decode.py [--out-dir benchmarks/results] [--sweep] [--quick]
Writes decode_<gpu>.json and decode_<gpu>.png (with --sweep also decode_sweep_<gpu>.txt: host cost
per call, register counts, config and split-count sweeps); ``report(result)`` renders the README
section. FLASHPAGE_DECODE_MERGE=launch times the two-launch split merge instead of the fused one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# report stays reachable as benchmarks.bench_decode.report, where make_report.py looks for it.
from benchmarks.decode_report import BLOCK_SIZE, HEAD_DIM, HEADS, gpu_slug, plot, report  # noqa: E402

BATCHES = (1, 8, 32, 128, 256)
CONTEXTS = (128, 512, 1024, 4096, 16384)


# ----------------------------------------------------------------------------- GPU-only below


def _bench(fn, rep: int = 100) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_case(lens, heads, kv_heads, bs, dtype, extra_cols=0, dev="cuda"):
    """Scattered paged cache holding exactly the owned slots; every other slot is NaN."""
    from kernels.reference import kv_write_ref

    nb = [(n + bs - 1) // bs for n in lens]
    num_blocks = sum(nb) + 5
    shape = (num_blocks, bs, kv_heads, HEAD_DIM)
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
    kv = torch.randn(2, len(slots), kv_heads, HEAD_DIM, device=dev, dtype=dtype)
    kv_write_ref(kv[0], kv[1], kc, vc, slots)
    q = torch.randn(len(lens), heads, HEAD_DIM, device=dev, dtype=dtype)
    return q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32, device=dev)


def check() -> list[str]:
    """Correctness on the GPU (compiled kernels, not the interpreter). Returns failure messages."""
    from kernels.kv_write import kv_write
    from kernels.paged_decode import paged_decode
    from kernels.reference import kv_write_ref, paged_decode_ref

    fails, n = [], 0
    tol = {torch.float16: 5e-3, torch.bfloat16: 2e-2}
    combos = [(torch.float16, bs, h) for bs in (8, 16, 64, 256) for h in ((12, 12), (12, 4), (8, 1))]
    combos += [(torch.bfloat16, bs, h) for bs in (16, 256) for h in ((12, 12), (16, 2))]
    combos += [(torch.float16, bs, (12, 12)) for bs in (32, 128)]
    for dtype, bs, (heads, kvh) in combos:
        lens = [1, bs - 1, bs, bs + 1, 1000, 3000]
        q, kc, vc, bt, ctx = make_case(lens, heads, kvh, bs, dtype)
        ref = paged_decode_ref(q, kc, vc, bt, ctx, 0.125)
        for ns in (None, 1, 4, 7):
            for rep in range(2):  # the second launch goes through the cached-kernel fast path
                out = torch.full_like(q, float("nan"))
                paged_decode(q, kc, vc, bt, ctx, 0.125, num_splits=ns, out=out)
                err = _rel(out, ref)
                n += 1
                if not err < tol[dtype]:
                    fails.append(f"decode {dtype} bs={bs} heads={heads}/{kvh} splits={ns} rep={rep}: rel {err:.2e}")
    # CUDA graph: capture once with num_splits chosen from shapes, replay with new context_lens.
    q, kc, vc, bt, ctx = make_case([2048] * 4, 12, 12, 16, torch.float16)
    out = torch.empty_like(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        paged_decode(q, kc, vc, bt, ctx, 0.125, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        paged_decode(q, kc, vc, bt, ctx, 0.125, out=out)
    for trial in range(5):
        ctx.copy_(torch.randint(1, 2049, (4,), dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        g.replay()
        err = _rel(out, paged_decode_ref(q, kc, vc, bt, ctx, 0.125))
        n += 1
        if not err < 5e-3:
            fails.append(f"graph replay {trial} ctx={ctx.tolist()}: rel {err:.2e}")
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


def build_shape(batch: int, context: int, dev: str = "cuda"):
    """Contiguous K/V for SDPA and the same tokens scattered over a permuted paged cache."""
    dt = torch.float16
    nblk = context // BLOCK_SIZE
    bt = torch.randperm(batch * nblk, device=dev).view(batch, nblk).int()
    kv, caches = [], []
    for _ in range(2):
        x = torch.randn(batch, HEADS, context, HEAD_DIM, device=dev, dtype=dt)
        c = torch.empty(batch * nblk, BLOCK_SIZE, HEADS, HEAD_DIM, device=dev, dtype=dt)
        c[bt.view(-1).long()] = x.transpose(1, 2).reshape(batch * nblk, BLOCK_SIZE, HEADS, HEAD_DIM)
        kv.append(x)
        caches.append(c)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=dev, dtype=dt)
    ctx = torch.full((batch,), context, dtype=torch.int32, device=dev)
    return q, kv[0], kv[1], caches[0], caches[1], bt, ctx


def eager_paged(q, kc, vc, bt, scale):
    b, nblk = bt.shape
    idx = bt.long()
    k = kc[idx].view(b, nblk * BLOCK_SIZE, HEADS, HEAD_DIM)  # gather the pages (a copy)
    v = vc[idx].view(b, nblk * BLOCK_SIZE, HEADS, HEAD_DIM)
    s = torch.matmul(q.unsqueeze(2), k.permute(0, 2, 3, 1)) * scale  # [b, h, 1, ctx]
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.matmul(p, v.permute(0, 2, 1, 3)).squeeze(2)


def host_times(log_path: str) -> None:
    """Host (CPU) cost per call on a small shape, where it can exceed the GPU time: a loop of calls
    with no synchronisation runs at the host's pace. Also the compiled kernels' register counts."""
    import kernels.paged_decode as pd
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    q, k, v, kc, vc, bt, ctx = build_shape(1, 1024)
    cache = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")

    def per_call_us(fn, n: int = 300) -> float:
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t
        torch.cuda.synchronize()
        return dt / n * 1e6

    res = {}
    for ns in (1, 8):
        cfg = pd.choose_config(1, HEADS, 1, 1024, pd._num_sms(q.device))
        cfg["num_splits"] = ns
        res[f"flashpage splits={ns} (paged_decode, cached plan)"] = per_call_us(
            lambda: pd.paged_decode(q, kc, vc, bt, ctx, 0.125, num_splits=ns))
        res[f"flashpage splits={ns} (Triton dispatch)"] = per_call_us(
            lambda: pd._launch(q, kc, vc, bt, ctx, None, 0.125, torch.empty_like(q), cfg))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        res["sdpa_flash"] = per_call_us(lambda: scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=0.125))
    res["eager_paged"] = per_call_us(lambda: eager_paged(q, kc, vc, bt, 0.125), n=100)
    res["do_bench L2 flush (cache.zero_), host"] = per_call_us(lambda: cache.zero_(), n=20)
    res["do_bench L2 flush (cache.zero_), GPU"] = _bench(lambda: cache.zero_()) * 1e3
    lines = [f"host us/call b=1 n=1024: {us:8.1f}  {name}" for name, us in res.items()]
    seen = set()
    for plan in list(pd._PLANS.values()):
        d = plan.dec
        info = (d.n_regs, d.n_spills, d.metadata.shared, d.metadata.num_warps, plan.tail[-10:])
        if info not in seen:
            seen.add(info)
            lines.append(f"decode kernel: regs={info[0]} spills={info[1]} shared={info[2]} warps={info[3]} "
                         f"consts={info[4]}")
    with open(log_path, "a") as f:
        for line in lines:
            print(line, flush=True)
            f.write(line + "\n")


def sweep(log_path: str, budget_s: float) -> None:
    """Configs and split counts around choose_config's picks, timed through paged_decode."""
    import kernels.paged_decode as pd
    from kernels.reference import paged_decode_ref

    lane = lambda bn, w: dict(BLOCK_N=bn, num_warps=w, num_stages=1, PREFETCH=2)  # noqa: E731
    dot = lambda bn, st: dict(BLOCK_N=bn, num_warps=4, num_stages=st, DOT=True)  # noqa: E731
    plan = [
        ((1, 16384), [lane(32, 4), lane(32, 2), lane(64, 8), dot(64, 4)], (44, 64, 88, 128)),
        ((1, 4096), [lane(32, 4), lane(64, 8)], (16, 32, 64)),
        ((8, 16384), [lane(32, 4), dot(64, 4)], (6, 8, 11, 16, 22)),
        ((8, 4096), [lane(32, 4)], (5, 8, 11, 16)),
        ((32, 4096), [lane(32, 4)], (1, 2, 3, 4)),
        ((32, 1024), [lane(32, 4)], (1, 2, 4)),
        ((1, 128), [lane(32, 4), lane(64, 4), lane(128, 4), lane(128, 8)], (1, 2, 4)),
        ((8, 128), [lane(32, 4), lane(128, 4)], (1, 2)),
        ((32, 128), [lane(32, 4), lane(128, 4)], (1,)),
        ((1, 512), [lane(32, 4), lane(128, 4)], (1, 2, 4, 8)),
    ]
    t0 = time.time()
    log = open(log_path, "a")
    for (b, n), cfgs, splits in plan:
        if time.time() - t0 > budget_s:
            print(f"sweep: time budget spent, skipping b={b} n={n}", flush=True)
            continue
        q, k, v, kc, vc, bt, ctx = build_shape(b, n)
        ref = paged_decode_ref(q[:2], kc, vc, bt[:2], ctx[:2], 0.125).float()
        kv_bytes = 2 * b * n * HEADS * HEAD_DIM * 2
        base = pd.choose_config(b, HEADS, 1, n, pd._num_sms(q.device))
        log.write(f"sweep b={b} n={n} default={base}\n")
        print(f"sweep b={b} n={n} default={base}", flush=True)
        res = []
        for cfg in cfgs:
            for ns in splits:
                f = lambda: pd.paged_decode(q, kc, vc, bt, ctx, 0.125, num_splits=ns, _config=cfg)  # noqa: E731
                err = _rel(f()[:2], ref)
                ms = _bench(f, rep=40)
                res.append((ms, ns, cfg, err))
        ms = _bench(lambda: pd.paged_decode(q, kc, vc, bt, ctx, 0.125), rep=40)
        res.append((ms, base["num_splits"], "default", 0.0))
        for ms, ns, cfg, err in sorted(res, key=lambda r: r[0]):
            bad = "" if err < 5e-3 else "  <-- WRONG"
            line = f"   {kv_bytes / ms / 1e9:6.2f} TB/s {ms * 1e3:8.1f} us splits={ns:3d} err={err:.1e} {cfg}{bad}"
            log.write(line + "\n")
            print(line, flush=True)
        log.flush()
        del q, k, v, kc, vc, bt, ctx
        torch.cuda.empty_cache()
    log.close()
    print(f"sweep took {time.time() - t0:.0f} s", flush=True)


def main() -> int:
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    from kernels.paged_decode import paged_decode

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--sweep", action="store_true", help="also run the tuning sweeps (printed)")
    ap.add_argument("--sweep-budget", type=float, default=150.0, help="seconds for the sweep")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "the benchmark needs a CUDA GPU"
    os.makedirs(args.out_dir, exist_ok=True)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}", flush=True)

    fails = [] if args.no_check else check()
    batches, contexts = ((1, 8, 256), (128, 16384)) if args.quick else (BATCHES, CONTEXTS)
    nbytes = 1 << 30
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.float16)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    rows = [{"impl": "copy", "bytes": 2 * nbytes, "ms": ms, "tbps": 2 * nbytes / ms / 1e9}]
    copy_tbps = rows[0]["tbps"]
    print(f"copy: {copy_tbps:.3f} TB/s ({ms:.3f} ms for {2 * nbytes / 1e9:.2f} GB read+written)", flush=True)
    del src, dst
    skipped = []
    scale = HEAD_DIM**-0.5
    for b in batches:
        for n in contexts:
            q, k, v, kc, vc, bt, ctx = build_shape(b, n)
            kv_bytes = 2 * b * n * HEADS * HEAD_DIM * 2
            cfg = {"batch": b, "context": n, "heads": HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE,
                   "kv_bytes": kv_bytes}
            qs = q.unsqueeze(2)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                ref = scaled_dot_product_attention(qs, k, v, scale=scale).squeeze(2)
                err = _rel(paged_decode(q, kc, vc, bt, ctx, scale), ref)
                if not err < 5e-3:
                    fails.append(f"b={b} n={n}: flashpage vs sdpa rel err {err:.2e}")
                t = {
                    "flashpage": _bench(lambda: paged_decode(q, kc, vc, bt, ctx, scale)),
                    "sdpa_flash_contiguous": _bench(lambda: scaled_dot_product_attention(qs, k, v, scale=scale)),
                }
                err = max(err, _rel(paged_decode(q, kc, vc, bt, ctx, scale), ref))  # the cached-plan path
                if not err < 5e-3:
                    fails.append(f"b={b} n={n}: flashpage (cached plan) vs sdpa rel err {err:.2e}")
            free = torch.cuda.mem_get_info()[0]
            why = None
            if 1.6 * kv_bytes < free:  # gathered K and V (kv_bytes) plus matmul temporaries
                try:
                    t["eager_paged"] = _bench(lambda: eager_paged(q, kc, vc, bt, scale))
                except torch.cuda.OutOfMemoryError:
                    why = f"out of memory ({free / 1e9:.1f} GB were free)"
            else:
                why = f"needs ~{1.6 * kv_bytes / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
            if why:
                skipped.append({"impl": "eager_paged", "batch": b, "context": n, "why": why})
                torch.cuda.empty_cache()
            for impl, ms in t.items():
                rows.append(dict(impl=impl, **cfg, ms=ms, tbps=kv_bytes / ms / 1e9))
            line = " ".join(f"{i}={kv_bytes / m / 1e9:.2f}" for i, m in t.items())
            print(f"b={b:3d} n={n:5d} {kv_bytes / 1e6:8.1f} MB err={err:.1e} TB/s: {line} "
                  f"ours%copy={100 * kv_bytes / t['flashpage'] / 1e9 / copy_tbps:.0f} "
                  f"ours/sdpa={t['sdpa_flash_contiguous'] / t['flashpage']:.2f}", flush=True)
            del q, k, v, kc, vc, bt, ctx, qs, ref
            torch.cuda.empty_cache()

    merge = os.environ.get("FLASHPAGE_DECODE_MERGE")
    env = f"FLASHPAGE_DECODE_MERGE={merge} " if merge else ""
    result = {"device": name, "torch": torch.__version__.split("+")[0], "triton": triton.__version__,
              "date": datetime.date.today().isoformat(),
              "command": (env + "python benchmarks/bench_decode.py " + " ".join(sys.argv[1:])).strip(),
              "rows": rows}
    if skipped:
        result["skipped"] = skipped
    slug = gpu_slug(name)
    with open(os.path.join(args.out_dir, f"decode_{slug}.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(args.out_dir, f"decode_{slug}.png"))
    print(report(result), flush=True)
    if args.sweep:
        log_path = os.path.join(args.out_dir, f"decode_sweep_{slug}.txt")
        open(log_path, "w").close()
        host_times(log_path)
        sweep(log_path, args.sweep_budget)
    for f in fails:
        print("FAIL", f, flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
