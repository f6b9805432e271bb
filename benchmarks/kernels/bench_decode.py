"""Paged-decode benchmark (GPU): flashpage's Triton kernel against SDPA flash and an eager gather.

One process, medians of ``triton.testing.do_bench`` (L2 evicted between runs by reading 256 MB, not
by do_bench's zero-fill, whose dirty lines are written back during the timed kernel: see _bench):
  copy                   large device-to-device copy; bytes read + written (the card's ceiling)
  flashpage              kernels.paged_decode over a scattered paged cache (random block permutation)
  sdpa_flash_contiguous  torch SDPA, flash backend forced, same K/V stored [batch, kv_heads, ctx, d]
                         (enable_gqa for the GQA rows)
  eager_paged            gather pages via the block table into contiguous K/V, QK^T, softmax, .V
Shapes, block_size 16:
  MHA  batch {1,8,32,128,256} x context {128,...,16384}, 12 heads x 64, fp16 (GPT-2)
  GQA  heads 32/kv 8 and 16/kv 8, head_dim 128 and 64, bf16 (the Llama family): batch
       {1,4,16,64,256} x context {1024,...,65536}, up to GQA_MAX_BYTES of K/V
Metric: achieved TB/s = K/V bytes that must be read (2*batch*context*kv_heads*d*2) / time, and that
as a share of the copy bandwidth. Before timing, a correctness pass (reference, GQA, bf16, block
sizes, NaN-poisoned cache, split vs unsplit, CUDA-graph replay with changing context_lens, the fused
K/V write, kv_write) and, per shape, ours vs SDPA (or eager where SDPA refuses).

  python -m benchmarks.kernels.bench_decode [--out-dir benchmarks/results] [--sweep | --sweep-only] [--quick]
Writes decode_<gpu>.json and decode_<gpu>.png (with --sweep also decode_sweep_<gpu>.txt: host cost
per call, register counts, config and split-count sweeps at GQA shapes); ``report(result)`` renders
the docs/benchmarks.md section. FLASHPAGE_DECODE_MERGE=launch times the two-launch split merge instead.
Compilation (hundreds of kernel variants) runs in a pool of processes first: serially it would
take most of a device session.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

# report stays reachable as benchmarks.kernels.bench_decode.report, where make_report.py looks for it.
from benchmarks.kernels.decode_check import TOL, pool_map, rel_err, check, make_case  # noqa: E402
from benchmarks.kernels.decode_report import BLOCK_SIZE, GQA_HEAD_DIMS, HEAD_DIM, HEADS, gpu_slug, plot, report  # noqa: E402

BATCHES = (1, 8, 32, 128, 256)
CONTEXTS = (128, 512, 1024, 4096, 16384)
GQA_HEADS = ((32, 8), (16, 8))  # 32/8: Llama-3-8B, Mistral-7B (d 128), Llama-3.2-1B (d 64); 16/8: Qwen3-0.6B
GQA_BATCHES = (1, 4, 16, 64, 256)
GQA_CONTEXTS = (1024, 4096, 16384, 65536)
GQA_MAX_BYTES = 2.2e9  # the largest K/V timed: enough past 256 MB, and eager's gathered copy fits


def _shapes(quick: bool) -> list[tuple]:
    """(batch, context, heads, kv_heads, head_dim, dtype) of every timed shape, MHA rows first."""
    mha_b, mha_n = ((1, 256), (128, 4096)) if quick else (BATCHES, CONTEXTS)
    gqa_b, gqa_n = ((1, 64), (1024, 16384)) if quick else (GQA_BATCHES, GQA_CONTEXTS)
    out = [(b, n, HEADS, HEADS, HEAD_DIM, torch.float16) for b in mha_b for n in mha_n]
    for d in GQA_HEAD_DIMS:
        for h, kvh in GQA_HEADS:
            out += [(b, n, h, kvh, d, torch.bfloat16) for b in gqa_b for n in gqa_n
                    if 4 * b * n * kvh * d <= GQA_MAX_BYTES]
    return out


# ----------------------------------------------------------------------------- GPU-only below


def _bench(fn, rep: int = 100, warmup: int = 25, flush: str = "read") -> float:
    """do_bench's median, L2 evicted before every call. do_bench evicts it by zero-filling 256 MB
    (flush="zero"): that leaves the L2's dirty zeros to be written back while the timed kernel
    streams its K/V, ~10 us charged to every kernel reading 128 MB or more (H100, measured both
    ways in one run: ms and ms_zero_flush of decode_h100.json). flush="read" (the
    default, for every impl and the copy ceiling alike) evicts by reading the same buffer instead,
    so the timed call starts from a cold L2 of clean lines."""
    from triton import runtime
    from triton.testing import do_bench

    drv = runtime.driver.active
    if flush == "read":
        drv.clear_cache = lambda cache: cache.sum()  # shadows the driver's zero_() for this call
    try:
        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    finally:
        vars(drv).pop("clear_cache", None)


def _compile_job(job) -> None:
    """Compile (into Triton's on-disk cache) the variant a shape and config launch: a small case of
    the same head geometry specialises identically (strides differ only in the batch dimension)."""
    from kernels.paged_decode import paged_decode

    heads, kvh, d, dtype, cfg = job
    q, kc, vc, bt, ctx = make_case([3 * 64], heads, kvh, BLOCK_SIZE, dtype, head_dim=d)
    paged_decode(q, kc, vc, bt, ctx, 0.125, num_splits=cfg["num_splits"], _config=cfg)
    torch.cuda.synchronize()


def _variant(heads: int, kvh: int, d: int, dtype: torch.dtype, cfg: dict) -> tuple:
    """What tells compiled variants apart: the geometry, the tile config, and of the split count only
    whether there is a split and its power-of-two padding."""
    import triton

    ns = int(cfg["num_splits"])
    tile = tuple(sorted((k, x) for k, x in cfg.items() if k != "num_splits"))
    return heads, kvh, d, dtype, tile, ns > 1, triton.next_power_of_2(ns)


def build_shape(batch: int, context: int, heads: int = HEADS, kv_heads: int = HEADS, head_dim: int = HEAD_DIM,
                dt: torch.dtype = torch.float16, dev: str = "cuda"):
    """Contiguous K/V for SDPA and the same tokens scattered over a permuted paged cache."""
    nblk = context // BLOCK_SIZE
    bt = torch.randperm(batch * nblk, device=dev).view(batch, nblk).int()
    kv, caches = [], []
    for _ in range(2):
        x = torch.randn(batch, kv_heads, context, head_dim, device=dev, dtype=dt)
        c = torch.empty(batch * nblk, BLOCK_SIZE, kv_heads, head_dim, device=dev, dtype=dt)
        c[bt.view(-1).long()] = x.transpose(1, 2).reshape(batch * nblk, BLOCK_SIZE, kv_heads, head_dim)
        kv.append(x)
        caches.append(c)
    q = torch.randn(batch, heads, head_dim, device=dev, dtype=dt)
    ctx = torch.full((batch,), context, dtype=torch.int32, device=dev)
    return q, kv[0], kv[1], caches[0], caches[1], bt, ctx


def eager_paged(q, kc, vc, bt, scale):
    """Gather the pages (a copy), then attention with each kv head's query group as a matrix."""
    b, nblk = bt.shape
    _, bs, kvh, d = kc.shape
    idx = bt.long()
    k = kc[idx].view(b, nblk * bs, kvh, d)
    v = vc[idx].view(b, nblk * bs, kvh, d)
    qg = q.view(b, kvh, q.shape[1] // kvh, d)
    s = torch.matmul(qg, k.permute(0, 2, 3, 1)) * scale  # [b, kvh, group, ctx]
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.matmul(p, v.permute(0, 2, 1, 3)).reshape(b, q.shape[1], d)


def measure(shape: tuple, copy_tbps: float, rows: list, skipped: list, fails: list) -> None:
    """Time one shape: flashpage, SDPA flash on contiguous K/V, eager; append rows."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    from kernels.paged_decode import paged_decode

    b, n, heads, kvh, d, dt = shape
    q, k, v, kc, vc, bt, ctx = build_shape(b, n, heads, kvh, d, dt)
    kv_bytes = 2 * b * n * kvh * d * kc.element_size()
    cfg = {"batch": b, "context": n, "heads": heads, "kv_heads": kvh, "head_dim": d, "block_size": BLOCK_SIZE,
           "dtype": str(dt).removeprefix("torch."), "kv_bytes": kv_bytes}
    scale, qs, gqa = d**-0.5, q.unsqueeze(2), kvh != heads
    ours = paged_decode(q, kc, vc, bt, ctx, scale)
    t = {"flashpage": _bench(lambda: paged_decode(q, kc, vc, bt, ctx, scale))}
    zero_flush_ms = _bench(lambda: paged_decode(q, kc, vc, bt, ctx, scale), flush="zero")
    ref = None
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa = lambda: scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=gqa)  # noqa: E731
            ref = sdpa().squeeze(2)
            t["sdpa_flash_contiguous"] = _bench(sdpa)
    except RuntimeError as e:  # a torch whose flash backend refuses the shape
        skipped.append({"impl": "sdpa_flash_contiguous", **cfg, "why": str(e).splitlines()[0][:120]})
    free = torch.cuda.mem_get_info()[0]
    why = None
    if 1.6 * kv_bytes < free:  # gathered K and V (kv_bytes) plus matmul temporaries
        try:
            eager = eager_paged(q, kc, vc, bt, scale)
            ref = eager if ref is None else ref
            t["eager_paged"] = _bench(lambda: eager_paged(q, kc, vc, bt, scale))
            del eager
        except torch.cuda.OutOfMemoryError:
            why = f"out of memory ({free / 1e9:.1f} GB were free)"
    else:
        why = f"needs ~{1.6 * kv_bytes / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
    if why:
        skipped.append({"impl": "eager_paged", **cfg, "why": why})
        torch.cuda.empty_cache()
    err = max(rel_err(ours, ref), rel_err(paged_decode(q, kc, vc, bt, ctx, scale), ref)) if ref is not None else float("nan")
    if not err < TOL[dt]:  # the second call runs through the cached-plan path
        fails.append(f"{heads}/{kvh}x{d} b={b} n={n}: flashpage vs {'sdpa' if 'sdpa_flash_contiguous' in t else 'eager'}"
                     f" rel err {err:.2e}")
    for impl, ms in t.items():
        rows.append(dict(impl=impl, **cfg, ms=ms, tbps=kv_bytes / ms / 1e9,
                         **({"ms_zero_flush": zero_flush_ms} if impl == "flashpage" else {})))
    line = " ".join(f"{i}={kv_bytes / m / 1e9:.2f}" for i, m in t.items())
    eager = f" eager/ours={t['eager_paged'] / t['flashpage']:.1f}" if "eager_paged" in t else ""
    print(f"{heads:2d}/{kvh:2d}x{d:3d} b={b:3d} n={n:5d} {kv_bytes / 1e6:8.1f} MB {t['flashpage'] * 1e3:8.1f} us "
          f"err={err:.1e} TB/s: {line} ours%copy={100 * kv_bytes / t['flashpage'] / 1e9 / copy_tbps:.0f} "
          f"(zero-fill flush {100 * kv_bytes / zero_flush_ms / 1e9 / copy_tbps:.0f}){eager}",
          flush=True)
    del q, k, v, kc, vc, bt, ctx, qs, ref, ours
    torch.cuda.empty_cache()


def host_times(log_path: str) -> None:
    """Host (CPU) cost per call on a small shape, where it can exceed the GPU time: a loop of calls
    with no synchronisation runs at the host's pace."""
    import kernels.paged_decode as pd

    q, k, v, kc, vc, bt, ctx = build_shape(1, 1024)
    with open(log_path, "a") as f:
        for ns in (1, 8):
            cfg = dict(pd.choose_config(1, HEADS, 1, 1024, pd._num_sms(q.device)), num_splits=ns)
            for how, fn in (("paged_decode, cached plan", lambda: pd.paged_decode(q, kc, vc, bt, ctx, 0.125, num_splits=ns)),
                            ("Triton dispatch", lambda: pd._launch(q, kc, vc, bt, ctx, None, 0.125, torch.empty_like(q), cfg))):
                fn()
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(300):
                    fn()
                line = f"host us/call b=1 n=1024: {(time.perf_counter() - t) / 300 * 1e6:8.1f}  flashpage splits={ns} ({how})"
                torch.cuda.synchronize()
                print(line, flush=True)
                f.write(line + "\n")


def kernel_info(log_path: str) -> None:
    """Registers, spills and shared memory of every compiled variant launched so far (occupancy)."""
    import kernels.paged_decode as pd

    names = ("HEAD_DIM", "HEAD_DIM_PAD", "GROUP", "GROUP_PAD", "BLOCK_SIZE", "BLOCK_N", "SPLIT", "DOT_F32",
             "PREFETCH", "LANES", "FUSED_MERGE", "SPLITS_PAD", "NEW_KV", "MERGE_HEADS", "KV_FP8", "NEW_KV_TAIL")
    seen = set()
    with open(log_path, "a") as f:
        for plan in list(pd._PLANS.values()):
            d = plan.dec
            consts = dict(zip(names, plan.tail[-len(names):]))
            key = (d.n_regs, d.n_spills, d.metadata.shared, d.metadata.num_warps, getattr(d.metadata, "num_stages", "?"),
                   *(consts[k] for k in ("HEAD_DIM", "GROUP", "BLOCK_N", "PREFETCH", "LANES", "SPLIT", "SPLITS_PAD",
                                         "MERGE_HEADS")))
            if key not in seen:
                seen.add(key)
                line = (f"decode kernel: regs={key[0]} spills={key[1]} shared={key[2]} warps={key[3]} stages={key[4]}"
                        f" d={key[5]} group={key[6]} BLOCK_N={key[7]} PREFETCH={key[8]} LANES={key[9]} SPLIT={key[10]}"
                        f" SPLITS_PAD={key[11]} MERGE_HEADS={key[12]}")
                print(line, flush=True)
                f.write(line + "\n")


# GQA tuning plan: (heads, kv_heads, head_dim, batch, context), mostly K/V >= 256 MB, with a few
# smaller shapes and MHA ones (default config only) to catch regressions. Each config is tried at
# the split counts its programs-per-SM list gives, as they are and capped to a one-round merge.
_DOT = lambda bn, w, st: dict(BLOCK_N=bn, num_warps=w, num_stages=st, PREFETCH=0)  # noqa: E731
SWEEP_CFGS = {
    128: [(_DOT(64, 4, 3), (3, 4)), (_DOT(64, 4, 5), (1, 3)), (_DOT(32, 4, 5), (3,))],
    64: [(_DOT(32, 4, 5), (4, 6)), (_DOT(32, 4, 3), (4, 8)), (_DOT(64, 4, 5), (3, 6))],
}
SWEEP_SHAPES = [
    (32, 8, 128, 1, 65536), (32, 8, 128, 2, 32768), (32, 8, 128, 4, 16384), (32, 8, 128, 16, 4096),
    (32, 8, 128, 64, 1024), (16, 8, 128, 1, 65536), (16, 8, 128, 4, 16384), (16, 8, 128, 16, 4096),
    (16, 8, 128, 64, 1024), (32, 8, 128, 64, 4096), (32, 8, 128, 1, 16384), (32, 8, 128, 4, 4096),
    (32, 8, 64, 4, 65536), (32, 8, 64, 16, 16384), (32, 8, 64, 64, 4096), (32, 8, 64, 256, 1024),
    (16, 8, 64, 4, 65536), (16, 8, 64, 256, 1024), (32, 8, 64, 1, 65536), (16, 8, 64, 16, 1024),
    (12, 12, 64, 1, 16384), (12, 12, 64, 8, 4096),
]


def _sweep_points(heads, kvh, d, b, n, sms):
    from kernels.decode_config import merge_split_cap, split_count

    cap = max(16, merge_split_cap(heads // kvh, d))
    pts = []
    for cfg, per_sm in SWEEP_CFGS[d] if kvh != heads else []:
        counts = {split_count(b * kvh, n, cfg["BLOCK_N"], k * sms) for k in per_sm}
        pts += [dict(cfg, num_splits=ns) for ns in sorted(counts | {min(cap, c) for c in counts})]
    return pts


def sweep(log_path: str, budget_s: float, copy_tbps: float) -> None:
    """Configs x split counts at GQA shapes (compiled in parallel first), timed through paged_decode."""
    import kernels.paged_decode as pd
    from kernels.reference import paged_decode_ref

    sms = pd._num_sms(torch.device("cuda"))
    t0 = time.time()
    jobs = {_variant(h, kvh, d, torch.bfloat16, c): (h, kvh, d, torch.bfloat16, c)
            for h, kvh, d, b, n in SWEEP_SHAPES for c in _sweep_points(h, kvh, d, b, n, sms)}
    pool_map(_compile_job, list(jobs.values()))
    print(f"sweep: {len(jobs)} variants compiled in {time.time() - t0:.0f} s", flush=True)
    log = open(log_path, "a")
    for h, kvh, d, b, n in SWEEP_SHAPES:
        if time.time() - t0 > budget_s:
            print(f"sweep: time budget spent, skipping {h}/{kvh}x{d} b={b} n={n}", flush=True)
            continue
        q, k, v, kc, vc, bt, ctx = build_shape(b, n, h, kvh, d, torch.bfloat16)
        del k, v
        ref = paged_decode_ref(q[:1], kc, vc, bt[:1], ctx[:1], d**-0.5).float()
        kv_bytes = 4 * b * n * kvh * d
        base = pd.choose_config(b, kvh, h // kvh, n, sms, d)
        head = f"sweep {h}/{kvh}x{d} b={b} n={n} {kv_bytes / 1e6:.0f} MB default={base}"
        log.write(head + "\n")
        print(head, flush=True)
        res = []
        for cfg in _sweep_points(h, kvh, d, b, n, sms) + [None]:
            c = None if cfg is None else {k: x for k, x in cfg.items() if k != "num_splits"}
            ns = base["num_splits"] if cfg is None else cfg["num_splits"]
            f = lambda: pd.paged_decode(q, kc, vc, bt, ctx, d**-0.5, num_splits=ns, _config=c)  # noqa: E731
            err = rel_err(f()[:1], ref)
            res.append((_bench(f, rep=30, warmup=10), ns, c or "default", err))
        for i, (ms, ns, cfg, err) in enumerate(sorted(res, key=lambda r: r[0])):
            bad = "" if err < 2e-2 else "  <-- WRONG"
            line = (f"   {kv_bytes / ms / 1e9:5.2f} TB/s {100 * kv_bytes / ms / 1e9 / copy_tbps:4.0f}% {ms * 1e3:8.1f} us"
                    f" splits={ns:3d} err={err:.1e} {cfg}{bad}")
            log.write(line + "\n")
            if i < 4 or cfg == "default" or bad:  # the whole table is in the log
                print(f"{i:3d}" + line, flush=True)
        log.flush()
        del q, kc, vc, bt, ctx
        torch.cuda.empty_cache()
    log.close()
    kernel_info(log_path)
    print(f"sweep took {time.time() - t0:.0f} s", flush=True)


def main() -> int:
    import triton

    from kernels.decode_config import _num_sms, choose_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--sweep", action="store_true", help="also run the GQA tuning sweep")
    ap.add_argument("--sweep-only", action="store_true", help="copy bandwidth, then the sweep alone")
    ap.add_argument("--sweep-budget", type=float, default=200.0, help="seconds for the sweep")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "the benchmark needs a CUDA GPU"
    os.makedirs(args.out_dir, exist_ok=True)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    slug = gpu_slug(name)
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    t0 = time.time()

    fails = [] if args.no_check else check()
    nbytes = 1 << 30
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.float16)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    rows = [{"impl": "copy", "bytes": 2 * nbytes, "ms": ms, "tbps": 2 * nbytes / ms / 1e9, "flush": "read",
             "ms_zero_flush": _bench(lambda: dst.copy_(src), flush="zero")}]
    copy_tbps = rows[0]["tbps"]
    print(f"copy: {copy_tbps:.3f} TB/s ({ms:.3f} ms for {2 * nbytes / 1e9:.2f} GB read+written)", flush=True)
    del src, dst
    log_path = os.path.join(args.out_dir, f"decode_sweep_{slug}.txt")
    if args.sweep_only:
        open(log_path, "w").close()
        sweep(log_path, args.sweep_budget, copy_tbps)
        return 1 if fails else 0
    shapes = _shapes(args.quick)
    jobs = {}
    for b, n, h, kvh, d, dt in shapes:  # compile every variant the timed shapes launch, in parallel
        cfg = choose_config(b, kvh, h // kvh, n, _num_sms(torch.device("cuda")), d)
        jobs[_variant(h, kvh, d, dt, cfg)] = (h, kvh, d, dt, cfg)
    t1 = time.time()
    pool_map(_compile_job, list(jobs.values()))
    print(f"{len(jobs)} variants compiled in {time.time() - t1:.0f} s", flush=True)
    skipped = []
    for shape in shapes:
        measure(shape, copy_tbps, rows, skipped, fails)

    merge = os.environ.get("FLASHPAGE_DECODE_MERGE")
    env = f"FLASHPAGE_DECODE_MERGE={merge} " if merge else ""
    result = {"device": name, "torch": torch.__version__.split("+")[0], "triton": triton.__version__,
              "date": datetime.date.today().isoformat(),
              "command": (env + "python -m benchmarks.kernels.bench_decode " + " ".join(sys.argv[1:])).strip(),
              "rows": rows}
    if skipped:
        result["skipped"] = skipped
    with open(os.path.join(args.out_dir, f"decode_{slug}.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(args.out_dir, f"decode_{slug}.png"))
    print(report(result), flush=True)
    if args.sweep:
        open(log_path, "w").close()
        host_times(log_path)
        sweep(log_path, args.sweep_budget, copy_tbps)
    print(f"total {time.time() - t0:.0f} s", flush=True)
    for f in fails:
        print("FAIL", f, flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
