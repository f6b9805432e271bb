"""FP8 KV cache on the GPU: the decode kernel's bandwidth and the engine's throughput, both cache dtypes in
one run (--kv-cache-dtype auto vs fp8).

decode   kernels.paged_decode over the same scattered paged K/V stored 16-bit (fp16 for GPT-2's MHA
         shape, bf16 for the Llama family's GQA ones) and fp8 e4m3 (per-head scales): medians of
         triton.testing.do_bench with the L2 evicted (bench_decode._bench), TB/s counted in the bytes
         each cache holds (fp8: one a value), as a share of the copy bandwidth, and fp8's speed-up over
         the 16-bit kernel. Goal where the 16-bit K/V is >= 256 MB: >= 85% of copy in fp8 bytes, i.e.
         >= 1.7x. Each fp8 row is checked against the reference over the dequantized cache.
         --fused-write: both kernels with this step's K/V written in-kernel and attended inside its
         tile (NEW_KV_TAIL off: the engine's launch until 2026-11-27; NEW_KV compiles to another
         loop: benchmarks/kernels/decode_ir.py --new-kv); --new-kv-tail (with --fused-write): those
         launches with NEW_KV_TAIL on too (the step's token after the loop, the engine's launch
         since: decode_ir.py --new-kv --tail).
sweep    (--sweep) fp8 tile configs x split counts at GQA and MHA shapes, against decode_config's pick.
engine   the Llama-3.1-8B shape (benchmarks/shared/checkpoint.py; random bf16 weights, made on the GPU from its
         config.json with --load-format dummy unless --load-format auto), through LLMEngine with
         Triton attention and CUDA graphs, once per cache dtype: --concurrency (default: as many
         requests of --prompt-len random tokens + --output-len outputs as the cache holds at once)
         submitted together: output tokens a second and the most sequences resident at once; then
         batch-1 TPOT after a --tpot-context-token prompt (median gap between tokens).

The engine workload is `workload()` (seeded random token ids, ignore_eos): the peer harness (vLLM with
--kv-cache-dtype fp8) can serve the same checkpoint (--load-format auto --checkpoint DIR writes its
weights there, and reuses them when they exist) and the same prompts.

  python -m benchmarks.kernels.bench_fp8_kv --out-dir benchmarks/results [--sections decode engine] [--sweep]
      [--fused-write [--new-kv-tail]] [--checkpoint /tmp/llama8b]

Writes fp8_kv_<gpu>.json (rows of impl paged_decode, paged_decode fp8 sweep and engine); report(result)
renders the tables, whatever columns a file's rows carry: files written before 2026-11-27's removal
of the fp8 kernel's FP8_CAST option also have row["casts"] and, under row["tail"], each cast's
ms_fp8_<cast> / copy_share_fp8_<cast> (the default cast's keys are still ms_fp8_cast and
copy_share_fp8_cast).
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from benchmarks.shared.common import gpu_run_info, write_result

DECODE_SHAPES = [  # (batch, context, heads, kv_heads, head_dim): 16-bit K/V of 256 MB to 6.4 GB, then smaller
    (32, 16384, 12, 12, 64), (128, 4096, 12, 12, 64), (256, 1024, 12, 12, 64), (8, 16384, 12, 12, 64),
    (1, 65536, 32, 8, 128), (4, 16384, 32, 8, 128), (16, 4096, 32, 8, 128), (64, 1024, 32, 8, 128),
    (16, 16384, 32, 8, 128), (64, 4096, 32, 8, 128), (256, 1024, 32, 8, 128), (1, 65536, 16, 8, 128),
    (16, 4096, 16, 8, 128), (4, 65536, 32, 8, 64), (16, 16384, 32, 8, 64), (64, 4096, 32, 8, 64),
    (256, 1024, 32, 8, 64), (16, 16384, 16, 8, 64),
    (1, 4096, 32, 8, 128), (8, 2048, 32, 8, 128), (32, 1024, 12, 12, 64),
]
SWEEP_SHAPES = [(1, 65536, 32, 8, 128), (16, 4096, 32, 8, 128), (64, 4096, 32, 8, 128), (4, 65536, 32, 8, 64),
                (64, 4096, 32, 8, 64), (32, 16384, 12, 12, 64), (256, 1024, 12, 12, 64)]
FP8 = torch.float8_e4m3fn


def fp8_copy(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache as fp8 e4m3 with per-head scales (each head's largest |value| / 448)."""
    from kernels.reference import fp8_quantize_ref

    scale = (cache.float().abs().amax(dim=(0, 1, 3)) / 448).clamp(min=1e-6).contiguous()
    return fp8_quantize_ref(cache, scale, FP8), scale


def _sweep_cfgs(group: int, d: int) -> list[dict]:
    dots = [dict(BLOCK_N=bn, num_warps=w, num_stages=st, PREFETCH=0) for bn in (64, 128) for w in (4, 8)
            for st in (3, 5)]
    if group == 1:  # the lane-wise path (fp32 math), and the tensor-core path with one real row
        return [dict(BLOCK_N=bn, num_warps=w, num_stages=1, PREFETCH=pf) for bn in (32, 64) for w in (4, 8)
                for pf in (0, 2)] + [dict(c, DOT=True) for c in dots]
    return dots + ([dict(BLOCK_N=32, num_warps=4, num_stages=5, PREFETCH=0)] if d <= 64 else [])


def _compile_job(job) -> None:
    """Compile (into Triton's on-disk cache) one fp8 variant on a small case of the same geometry."""
    from benchmarks.kernels.decode_check import make_case
    from kernels.paged_decode import paged_decode

    heads, kvh, d, cfg, ns = job
    q, kc, vc, bt, ctx = make_case([3 * 128], heads, kvh, 16, torch.bfloat16, head_dim=d)
    (k8, ks), (v8, vs) = fp8_copy(kc.nan_to_num(0)), fp8_copy(vc.nan_to_num(0))
    paged_decode(q, k8, v8, bt, ctx, 0.125, num_splits=ns, k_scale=ks, v_scale=vs, _config=cfg)
    torch.cuda.synchronize()


def decode_rows(shapes, copy_tbps: float, fused: bool = False, tail: bool = False, on_row=None) -> list[dict]:
    """Per shape: the 16-bit and the fp8 kernel at their tables' configs; `fused`: both kernels with
    this step's K/V written in-kernel (NEW_KV, slot -1: nothing stored) and attended inside its tile
    (NEW_KV_TAIL off), another compiled loop; `tail` (with `fused`): those launches with NEW_KV_TAIL on
    (the step's token added after the loop, which then is the plain launch's), and how far their
    outputs are from the in-tile fused launch's (another fp32 summation order, not the same bits).
    `on_row(row)` is called after each shape (the caller writes what is done: a time limit keeps it)."""
    from benchmarks.kernels.bench_decode import _bench, build_shape
    from benchmarks.kernels.decode_check import rel_err
    from kernels.paged_decode import paged_decode
    from kernels.reference import paged_decode_ref

    rows = []
    for b, n, h, kvh, d in shapes:
        dt = torch.float16 if h == kvh else torch.bfloat16
        q, _, _, kc, vc, bt, ctx = build_shape(b, n, h, kvh, d, dt)
        (k8, ks), (v8, vs) = fp8_copy(kc), fp8_copy(vc)
        scale = d**-0.5
        f16 = lambda: paged_decode(q, kc, vc, bt, ctx, scale)  # noqa: E731
        f8 = lambda: paged_decode(q, k8, v8, bt, ctx, scale, k_scale=ks, v_scale=vs)  # noqa: E731
        ref = paged_decode_ref(q[:2], k8, v8, bt[:2], ctx[:2], scale, k_scale=ks, v_scale=vs)
        err = max(rel_err(f8()[:2], ref), rel_err(f8()[:2], ref))  # the second call: the cached launch plan
        t16, t8 = _bench(f16), _bench(f8)
        bytes16 = 2 * b * n * kvh * d * 2
        row = dict(impl="paged_decode", batch=b, context=n, heads=h, kv_heads=kvh, head_dim=d,
                   dtype=str(dt).removeprefix("torch."),
                   kv_bytes_16bit=bytes16, kv_bytes_fp8=bytes16 // 2, ms_16bit=t16, ms_fp8=t8,
                   tbps_16bit=bytes16 / t16 / 1e9, tbps_fp8=bytes16 / 2 / t8 / 1e9, speedup=t16 / t8, fp8_rel_err=err)
        row["copy_share_16bit"], row["copy_share_fp8"] = row["tbps_16bit"] / copy_tbps, row["tbps_fp8"] / copy_tbps
        extra = ""
        if fused:  # the engine's launch: k_new, v_new written by the kernel (slot -1: not stored)
            kn = torch.randn(b, kvh, d, device=q.device, dtype=dt)
            slots = torch.full((b,), -1, dtype=torch.int32, device=q.device)
            kw = dict(k_new=kn, v_new=kn, slot_mapping=slots)
            inside = {"NEW_KV_TAIL": False}  # (these rows: the step's token inside its tile, the default until 2026-11-27)
            tf16 = _bench(lambda: paged_decode(q, kc, vc, bt, ctx, scale, _config=inside, **kw))
            tf8 = _bench(lambda: paged_decode(q, k8, v8, bt, ctx, scale, k_scale=ks, v_scale=vs, _config=inside, **kw))
            row.update(ms_16bit_fused=tf16, ms_fp8_fused=tf8, copy_share_16bit_fused=bytes16 / tf16 / 1e9 / copy_tbps,
                       copy_share_fp8_fused=bytes16 / 2 / tf8 / 1e9 / copy_tbps)
            extra += (f" | fused write: 16-bit {row['copy_share_16bit_fused']:4.0%}, "
                      f"fp8 {row['copy_share_fp8_fused']:4.0%}")
            if tail:
                row["tail"] = t = tail_rows(q, (kc, vc, None, None), (k8, v8, ks, vs), bt, ctx, scale, kw)
                t["copy_share_16bit"] = bytes16 / t["ms_16bit"] / 1e9 / copy_tbps
                t["copy_share_fp8_cast"] = bytes16 / 2 / t["ms_fp8_cast"] / 1e9 / copy_tbps
                extra += (f" | tail: 16-bit {t['copy_share_16bit']:4.0%}, fp8 {t['copy_share_fp8_cast']:4.0%}"
                          f" err {t['rel_err']:.1e}")
        rows.append(row)
        if on_row is not None:
            on_row(row)
        print(f"{h:2d}/{kvh:2d}x{d:3d} b={b:3d} n={n:5d} {bytes16 / 1e6:7.0f} MB 16-bit {t16 * 1e3:8.1f} us "
              f"{row['copy_share_16bit']:4.0%} | fp8 {t8 * 1e3:8.1f} us {row['copy_share_fp8']:4.0%} of copy "
              f"x{row['speedup']:.2f} err={err:.1e}{extra}", flush=True)
        del q, kc, vc, k8, v8, bt, ctx
        torch.cuda.empty_cache()
    return rows


def tail_rows(q, cache16, cache8, bt, ctx, scale, kw: dict) -> dict:
    """The fused-write launches with NEW_KV_TAIL: ms of the 16-bit kernel and of the fp8 one (key
    ms_fp8_cast, as when the fp8 kernel had other casts), and the largest relative distance of their
    outputs from the in-tile fused launch's."""
    from benchmarks.kernels.bench_decode import _bench
    from benchmarks.kernels.decode_check import rel_err
    from kernels.paged_decode import paged_decode

    def call(cache, cfg):
        kc, vc, ks, vs = cache
        return lambda: paged_decode(q, kc, vc, bt, ctx, scale, k_scale=ks, v_scale=vs, _config=cfg, **kw)

    inside, after = {"NEW_KV_TAIL": False}, {"NEW_KV_TAIL": True}
    out = {"ms_16bit": _bench(call(cache16, after)), "ms_fp8_cast": _bench(call(cache8, after))}
    out["rel_err"] = max(rel_err(call(cache16, after)(), call(cache16, inside)()),
                         rel_err(call(cache8, after)(), call(cache8, inside)()))
    return out


def sweep_rows(copy_tbps: float, budget_s: float) -> list[dict]:
    """fp8 configs x split counts (default split, half, double) at SWEEP_SHAPES."""
    from benchmarks.kernels.bench_decode import _bench, build_shape
    from benchmarks.kernels.decode_check import pool_map
    from kernels.decode_config import MAX_SPLITS, _num_sms, choose_config
    from kernels.paged_decode import paged_decode

    sms, t0, rows = _num_sms(torch.device("cuda")), time.time(), []
    points = {}
    for b, n, h, kvh, d in SWEEP_SHAPES:
        base = choose_config(b, kvh, h // kvh, n, sms, d, 1)
        splits = sorted({max(1, min(MAX_SPLITS, base["num_splits"] * f)) for f in (0.5, 1, 2)} - {0})
        points[b, n, h, kvh, d] = (base, [(c, int(s)) for c in _sweep_cfgs(h // kvh, d) for s in splits])
    jobs = {(h, kvh, d, tuple(sorted(c.items())), s > 1, 1 << (s - 1).bit_length()): (h, kvh, d, c, s)
            for (b, n, h, kvh, d), (_, pts) in points.items() for c, s in pts}
    pool_map(_compile_job, list(jobs.values()))
    print(f"sweep: {len(jobs)} fp8 variants compiled in {time.time() - t0:.0f} s", flush=True)
    for (b, n, h, kvh, d), (base, pts) in points.items():
        if time.time() - t0 > budget_s:
            print(f"sweep: budget spent, skipping {h}/{kvh}x{d} b={b} n={n}", flush=True)
            continue
        q, _, _, kc, vc, bt, ctx = build_shape(b, n, h, kvh, d, torch.float16 if h == kvh else torch.bfloat16)
        (k8, ks), (v8, vs) = fp8_copy(kc), fp8_copy(vc)
        del kc, vc
        res = []
        for cfg, ns in pts + [(None, base["num_splits"])]:
            fn = lambda: paged_decode(q, k8, v8, bt, ctx, d**-0.5, num_splits=ns, k_scale=ks, v_scale=vs,  # noqa: E731
                                      _config=cfg)
            res.append((_bench(fn, rep=30, warmup=10), ns, cfg))
        fp8_bytes = 2 * b * n * kvh * d
        best = sorted(res, key=lambda r: r[0])
        for ms, ns, cfg in best:
            rows.append(dict(impl="paged_decode fp8 sweep", batch=b, context=n, heads=h, kv_heads=kvh, head_dim=d,
                             num_splits=ns,
                             config=cfg or "default", default=base, ms=ms, copy_share=fp8_bytes / ms / 1e9 / copy_tbps))
        default_ms = next(ms for ms, _, cfg in res if cfg is None)
        print(f"sweep {h}/{kvh}x{d} b={b} n={n}: default {fp8_bytes / default_ms / 1e9 / copy_tbps:.0%} of copy "
              f"({base}); best {fp8_bytes / best[0][0] / 1e9 / copy_tbps:.0%}: splits={best[0][1]} {best[0][2]}; "
              f"next {[(round(fp8_bytes / m / 1e9 / copy_tbps, 3), s, c) for m, s, c in best[1:4]]}", flush=True)
        del q, k8, v8, bt, ctx
        torch.cuda.empty_cache()
    return rows


def workload(n: int, prompt_len: int, output_len: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], int]:
    """n prompts of prompt_len random token ids below vocab (seeded), each to run for output_len tokens
    with ignore_eos: what the engine section submits (and what a peer's harness can send)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(n)], output_len


def _drive(engine, prompts, output_len: int) -> tuple[float, int, int, dict]:
    """All prompts submitted at once, stepped to the end: (seconds, output tokens, most running at once,
    per request the times its tokens arrived, in seconds after the submission)."""
    from server.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
        times[f"r{i}"] = []
    most = 0
    while engine.has_unfinished():
        for out in engine.step():
            times[out.request_id] += [time.perf_counter() - t0] * len(out.new_token_ids)
        most = max(most, len(engine.scheduler.running))
    return time.perf_counter() - t0, sum(map(len, times.values())), most, times


def engine_run(path: Path, kv: str, args) -> dict:
    from server.config import EngineConfig
    from server.engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_dtype=kv, attention=args.attention,
                                    max_model_len=args.tpot_context, max_num_seqs=args.max_num_seqs,
                                    load_format=args.load_format))
    start_s = time.perf_counter() - t0
    bs, blocks = engine.block_manager.block_size, engine.block_manager.num_blocks
    fit = blocks // -(-(args.prompt_len + args.output_len) // bs)
    n = args.concurrency or fit
    res = dict(impl="engine", kv_cache_dtype=kv, start_s=start_s, kv_blocks=blocks, kv_tokens=blocks * bs,
               kv_bytes_per_token=engine.cache_spec.bytes_per_block // bs, sequences_fit=fit, requests=n)
    scales = engine.runner.kv_caches[0][0]
    if hasattr(scales, "scale"):
        res["k_scale_layer0"] = scales.scale.tolist()
    vocab = engine.spec.vocab_size
    _drive(engine, workload(2, min(256, args.prompt_len), 8, vocab, seed=1)[0], 8)  # warm-up
    prompts, out_len = workload(n, args.prompt_len, args.output_len, vocab)
    secs, tokens, most, times = _drive(engine, prompts, out_len)
    # where the run's time went: until every request had its first token (the prefills, with the
    # decodes of those already in), then the decodes alone (what the cache's width speeds up)
    filled = max(t[0] for t in times.values() if t)
    after = sum(1 for t in times.values() for x in t if x > filled)
    res.update(seconds=secs, output_tokens=tokens, output_tok_s=tokens / secs, most_running=most,
               all_first_tokens_s=filled, decode_only_tok_s=after / (secs - filled) if secs > filled else None)
    print(f"{kv}: {blocks} blocks ({blocks * bs} tokens), {n} requests of {args.prompt_len}+{out_len}: "
          f"{tokens / secs:.0f} output tok/s, at most {most} running ({secs:.1f} s, every first token by "
          f"{filled:.1f} s, then {res['decode_only_tok_s'] or 0:.0f} tok/s; start-up {start_s:.0f} s)", flush=True)
    prompt, _ = workload(1, args.tpot_context - args.tpot_tokens, 0, vocab, seed=2)
    secs, tokens, _, times = _drive(engine, prompt, args.tpot_tokens)
    gaps = [b - a for a, b in zip(times["r0"], times["r0"][1:])]
    res.update(tpot_context=args.tpot_context, tpot_tokens=tokens, tpot_ms=1e3 * statistics.median(gaps),
               tpot_mean_ms=1e3 * statistics.fmean(gaps), ttft_s=times["r0"][0])
    print(f"{kv}: batch-1 TPOT at {args.tpot_context} tokens {res['tpot_ms']:.2f} ms (mean {res['tpot_mean_ms']:.2f})",
          flush=True)
    engine.runner.close()
    del engine
    torch.cuda.empty_cache()
    return res


def report(result: dict) -> str:
    out = [f"{result['note']}\n"] if result.get("note") else []
    decode = [r for r in result["rows"] if r["impl"] == "paged_decode"]
    engine = [r for r in result["rows"] if r["impl"] == "engine"]
    if decode:
        casts = list(dict.fromkeys(c for r in decode for c in r.get("casts", {})))
        fused = any("ms_fp8_fused" in r for r in decode)
        tails = list(dict.fromkeys(k.removeprefix("copy_share_") for r in decode for k in r.get("tail", {})
                                   if k.startswith("copy_share_")))
        out += ["| heads | d | batch | context | 16-bit K/V | 16-bit % copy | fp8 % copy (fp8 bytes) | fp8 speed-up |"
                + "".join(f" fp8 {c} % copy (x) |" for c in casts)
                + (" fused write: 16-bit / fp8 % copy |" if fused else "")
                + "".join(f" fused, NEW_KV_TAIL: {t.replace('_', ' ', 1).replace('16bit', '16-bit')} % copy |" for t in tails),
                "|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * (len(casts) + fused + len(tails))]
        for r in decode:
            cells = "".join(f" {r['casts'][c]['copy_share']:.0%} ({r['casts'][c]['speedup']:.2f}x) |"
                            if c in r.get("casts", {}) else " |" for c in casts)
            if fused:
                cells += (f" {r['copy_share_16bit_fused']:.0%} / {r['copy_share_fp8_fused']:.0%} |"
                          if "ms_fp8_fused" in r else " |")
            cells += "".join(f" {r['tail']['copy_share_' + t]:.0%} |" if "copy_share_" + t in r.get("tail", {})
                             else " |" for t in tails)
            out.append(f"| {r['heads']}/{r['kv_heads']} | {r['head_dim']} | {r['batch']} | {r['context']} | "
                       f"{r['kv_bytes_16bit'] / 1e6:.0f} MB | {r['copy_share_16bit']:.0%} | {r['copy_share_fp8']:.0%} | "
                       f"{r['speedup']:.2f}x |" + cells)
    if engine:
        e = {r["kv_cache_dtype"]: r for r in engine}
        out += ["", "| cache | KV tokens | requests | output tok/s | most resident | TPOT @ "
                f"{engine[0]['tpot_context']} (ms) |", "|---|---:|---:|---:|---:|---:|"]
        for kv, r in e.items():
            out.append(f"| {kv} | {r['kv_tokens']} | {r['requests']} | {r['output_tok_s']:.0f} | {r['most_running']} | "
                       f"{r['tpot_ms']:.2f} |")
        if {"auto", "fp8"} <= set(e):
            a, f = e["auto"], e["fp8"]
            out.append(f"\nfp8 / 16-bit: output throughput {f['output_tok_s'] / a['output_tok_s']:.2f}x, resident "
                       f"{f['most_running'] / a['most_running']:.2f}x, TPOT {a['tpot_ms'] / f['tpot_ms']:.2f}x faster")
    return "\n".join(out)


def main(argv=None) -> dict:
    from benchmarks.kernels.bench_decode import _bench
    from benchmarks.shared.checkpoint import make_config_only_llama, make_random_llama

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--sections", nargs="+", default=["decode", "engine"], choices=["decode", "engine"])
    ap.add_argument("--sweep", action="store_true", help="also sweep fp8 decode configs")
    ap.add_argument("--sweep-budget", type=float, default=120.0)
    ap.add_argument("--fused-write", action="store_true",
                    help="decode: also time both kernels as the engine launches them (the step's K/V written in-kernel)")
    ap.add_argument("--new-kv-tail", action="store_true",
                    help="decode, with --fused-write: also time the launch option NEW_KV_TAIL (the step's token "
                         "after the loop), 16-bit and fp8")
    ap.add_argument("--checkpoint", default=None, help="directory of the 8B-shape checkpoint (built there if missing)")
    ap.add_argument("--load-format", default="dummy", choices=["dummy", "auto"],
                    help="dummy: config.json alone, random weights made on the GPU at start-up; auto: random "
                         "weights written to --checkpoint (16 GB: minutes) that a peer can serve too")
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=0, help="requests at once (0: as many as the cache holds)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--tag", default="", help="results file fp8_kv_<tag>_<gpu>.json (one per section run apart)")
    ap.add_argument("--tpot-context", type=int, default=32768)
    ap.add_argument("--tpot-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    assert torch.cuda.is_available(), "the benchmark needs a CUDA GPU"
    result = dict(gpu_run_info("benchmarks.kernels.bench_fp8_kv", argv), args=vars(args), rows=[])
    prefix = "fp8_kv" + (f"_{args.tag}" if args.tag else "")
    nbytes = 1 << 30
    src = torch.empty(nbytes // 2, device="cuda", dtype=torch.float16).normal_()
    dst = torch.empty_like(src)
    copy_tbps = 2 * nbytes / _bench(lambda: dst.copy_(src)) / 1e9
    del src, dst
    result["copy_tbps"] = copy_tbps
    print(f"{result['device']}: copy {copy_tbps:.2f} TB/s", flush=True)
    if "decode" in args.sections:
        def keep(row: dict) -> None:  # the file after each shape: a time limit keeps the shapes done
            result["rows"].append(row)
            write_result(result, args.out_dir, prefix)

        decode_rows(DECODE_SHAPES, copy_tbps, args.fused_write, args.new_kv_tail, on_row=keep)
        if args.sweep:
            result["rows"] += sweep_rows(copy_tbps, args.sweep_budget)
        write_result(result, args.out_dir, prefix)
    if "engine" in args.sections:
        path = Path(args.checkpoint or "/tmp/flashpage-fp8kv-" + args.shape)
        if args.load_format == "dummy" and not (path / "config.json").exists():
            make_config_only_llama(path, args.shape)
        elif args.load_format == "auto" and not any(path.glob("*.safetensors")):
            t = time.perf_counter()
            make_random_llama(path, args.shape, device="cuda")
            print(f"checkpoint {args.shape} built in {path} in {time.perf_counter() - t:.0f} s", flush=True)
        result["checkpoint"] = dict(shape=args.shape, path=str(path), load_format=args.load_format)
        for kv in ("auto", "fp8"):
            # each cache dtype's engine in a process of its own: the GPU's memory is all the next one's
            # (in one process the second engine's cache, sized from the free memory, failed to fit on an
            # H100 on 2026-11-28: 39.5 GiB stayed reserved by the first engine's allocator)
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                result["rows"].append(pool.submit(engine_run, path, kv, args).result())
            write_result(result, args.out_dir, prefix)  # what is done survives a time limit
    path = write_result(result, args.out_dir, prefix)
    print(report(result))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
