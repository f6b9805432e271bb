"""The deterministic mode's kernels on the GPU, against what the default mode runs, in one process:

  GEMM       kernels/invariant_matmul.py vs cuBLAS (F.linear) on every linear-layer shape of GPT-2
             small and Llama-3.2-1B / Llama-3-8B (the LM head included), M = 1 .. 8192 rows; with
             --sweep, candidate tile configs too (what kernels/invariant_matmul.py's table comes
             from). Also: how many rows of cuBLAS's output change bits when the same rows are
             computed inside a larger batch (the problem), and of ours (must be 0).
  attention  kernels/invariant_attention.py (split and unsplit) vs kernels/paged_decode.py for
             decode batches, and vs kernels/flash_prefill.py for prefill chunks.

Medians of triton.testing.do_bench. Writes invariant_kernels_<gpu>.json.

  python -m benchmarks.kernels.bench_invariant_kernels [--out-dir benchmarks/results] [--sweep] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from benchmarks.shared.common import gpu_run_info, write_result  # noqa: E402

# (model, layer, N, K)
SHAPES = [("gpt2", "qkv", 2304, 768), ("gpt2", "o", 768, 768), ("gpt2", "fc", 3072, 768), ("gpt2", "proj", 768, 3072),
          ("gpt2", "head", 50304, 768),
          ("llama-1b", "qkv", 3072, 2048), ("llama-1b", "o", 2048, 2048), ("llama-1b", "gate_up", 16384, 2048),
          ("llama-1b", "down", 2048, 8192), ("llama-1b", "head", 128256, 2048),
          ("llama-8b", "qkv", 6144, 4096), ("llama-8b", "down", 4096, 14336)]
ROWS = (1, 16, 64, 256, 512, 1024, 8192)
# kernels/invariant_matmul.py's CONFIGS first (SMALL, NARROW, MEDIUM, LARGE), then other candidates
SWEEP = [(64, 64, 128, 4, 3), (64, 32, 128, 4, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (64, 64, 64, 4, 4),
         (64, 128, 64, 4, 4), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (128, 128, 64, 8, 3), (64, 256, 64, 4, 3)]


def _bench(fn) -> float:
    """Median us of fn replayed in a CUDA graph: device time, as a served step runs it (Triton's
    host-side dispatch would otherwise dominate the small shapes)."""
    import triton

    # do_bench_cudagraph runs fn on a fresh side stream that does not wait for the default stream:
    # without this, the first call can read inputs still being written there (a block table not
    # yet filled: the illegal address this benchmark once stopped on, in the default decode kernel).
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


def _gemm(quick: bool, sweep: bool) -> list[dict]:
    import kernels.invariant_matmul as im

    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for model, layer, n, k in (SHAPES[:5] if quick else SHAPES):
        w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).half()
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", generator=g).half()
            cfg, seg_k = im.config(n, k, m), im.segment_k(k)
            rec = dict(model=model, layer=layer, n=n, k=k, m=m, cublas_us=_bench(lambda: F.linear(x, w)),
                       ours_us=_bench(lambda: im.invariant_linear(x, w)), config=list(cfg), segment_k=seg_k,
                       split=im.split_k(m, n, k, cfg, seg_k))
            if seg_k < k:  # what the K segments cost or save: the same kernel summing K in one segment
                rec["ours_one_segment_us"] = _bench(lambda: im.invariant_linear(x, w, seg_k=k, split=False))
            if sweep and not quick:
                swept = {}
                for c in SWEEP:
                    try:
                        swept[str(c)] = _bench(lambda: im.invariant_linear(x, w, cfg=im.MatmulConfig(*c)))
                    except Exception as e:  # noqa: BLE001 - a config the shape cannot take (shared memory)
                        swept[str(c)] = repr(e)[:80]
                rec["sweep_us"] = swept
            rows.append(rec)
            print(f"{model:9s} {layer:8s} M={m:5d} cublas {rec['cublas_us']:8.1f} us  ours {rec['ours_us']:8.1f} us",
                  flush=True)
    return rows


def _config_equivalence() -> dict:
    """Does the tile config (or the K split) change a row's bits? The same x @ w.T under every SWEEP
    config, and split over K segments at small M, compared bitwise with the first (the k16 tensor-core steps accumulate in the same order whatever the
    tile; whether the instruction shapes round alike is the hardware's to answer)."""
    import kernels.invariant_matmul as im

    g = torch.Generator(device="cuda").manual_seed(2)
    out = {}
    for model, layer, n, k in SHAPES[:10]:
        w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).half()
        for m in (1, 64, 300, 2048):
            x = torch.randn(m, k, device="cuda", generator=g).half()
            res = {str(c): im.invariant_linear(x, w, cfg=im.MatmulConfig(*c), split=False) for c in SWEEP}
            if im.segment_k(k) < k and m <= 64:  # the segments spread over programs, folded by the last
                res["split"] = im.invariant_linear(x, w, split=True)
            first = next(iter(res.values()))
            out[f"{model}/{layer}/M={m}"] = {c: int((r.view(torch.int16) != first.view(torch.int16)).sum())
                                             for c, r in res.items()}
    bad = {key: v for key, v in out.items() if any(v.values())}
    print(f"config equivalence: {len(out) - len(bad)} of {len(out)} cases bitwise equal across {len(SWEEP)} configs;"
          f" differing: {bad}", flush=True)
    return out


def _invariance() -> dict:
    """Rows 0..7 computed alone (M=1 each) and as the first rows of larger batches: rows whose bits differ."""
    from kernels.invariant_matmul import invariant_linear

    g = torch.Generator(device="cuda").manual_seed(1)
    out = {}
    for model, layer, n, k in SHAPES:
        w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).half()
        x = torch.randn(4096, k, device="cuda", generator=g).half()
        rec = {}
        for name, fn in (("cublas", F.linear), ("ours", invariant_linear)):
            ref = [fn(x[i : i + 1], w) for i in range(8)]
            rec[name] = {m: sum(int(not torch.equal(fn(x[:m], w)[i], ref[i][0])) for i in range(8))
                         for m in (8, 16, 64, 256, 4096)}
        out[f"{model}/{layer}"] = rec
        print(f"{model}/{layer}: rows of 8 changed inside a batch: {rec}", flush=True)
    return out


def _attention(quick: bool) -> list[dict]:
    from kernels.flash_prefill import flash_prefill, tile_map
    from kernels.invariant_attention import SEGMENT, invariant_attention, positions_per_tile
    from kernels.paged_decode import paged_decode
    import kernels.invariant_attention as ia

    default_stages = ia.NUM_STAGES
    rows = []
    bs = 16
    for heads, kvh, d, dtype in ((12, 12, 64, torch.float16), (32, 8, 64, torch.bfloat16), (32, 8, 128, torch.bfloat16)):
        group = heads // kvh
        for batch, ctx in ((1, 512), (1, 4096), (64, 1024), (256, 1024), (256, 4096)):
            if quick and ctx > 1024:
                continue
            nb = -(-ctx // bs)
            k_cache = torch.randn(batch * nb, bs, kvh, d, device="cuda", dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            bt = torch.randperm(batch * nb, device="cuda", dtype=torch.int32).view(batch, nb)
            q = torch.randn(batch, heads, d, device="cuda", dtype=dtype)
            lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
            iota = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
            tiles = (iota[:batch], torch.zeros(batch, device="cuda", dtype=torch.int32))
            segs = -(-nb * bs // SEGMENT)
            rec = dict(kind="decode", heads=heads, kv_heads=kvh, head_dim=d, batch=batch, context=ctx,
                       default_us=_bench(lambda: paged_decode(q, k_cache, v_cache, bt, lens, d**-0.5)))
            prefix = lens - 1
            for split in (False, True):
                for stages in (2, 3, 4):
                    ia.NUM_STAGES = stages
                    rec[f"ours_split{int(split)}_stages{stages}_us"] = _bench(lambda: invariant_attention(
                        q, k_cache, v_cache, bt, iota, prefix, tiles, d**-0.5, segs, split=split))
            ia.NUM_STAGES = default_stages
            rows.append(rec)
            print(rec, flush=True)
        for n_seqs, plen in ((16, 512), (4, 2048)):  # prefill chunks: whole prompts, no prefix
            nb = -(-plen // bs)
            k_cache = torch.randn(n_seqs * nb, bs, kvh, d, device="cuda", dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            bt = torch.arange(n_seqs * nb, device="cuda", dtype=torch.int32).view(n_seqs, nb)
            t = n_seqs * plen
            q = torch.randn(t, heads, d, device="cuda", dtype=dtype)
            k = k_cache.view(-1, kvh, d)[:t]
            v = v_cache.view(-1, kvh, d)[:t]
            cu = torch.arange(0, t + 1, plen, device="cuda", dtype=torch.int32)
            zeros = torch.zeros(n_seqs, device="cuda", dtype=torch.int32)
            ts, st = tile_map([plen] * n_seqs, [0] * n_seqs, positions_per_tile(group))
            tiles = (torch.from_numpy(ts).cuda(), torch.from_numpy(st).cuda())
            rec = dict(kind="prefill", heads=heads, kv_heads=kvh, head_dim=d, batch=n_seqs, context=plen,
                       default_us=_bench(lambda: flash_prefill(q, k, v, cu, plen, d**-0.5)),
                       ours_split0_us=_bench(lambda: invariant_attention(q, k_cache, v_cache, bt, cu, zeros, tiles,
                                                                         d**-0.5, -(-plen // SEGMENT))))
            rows.append(rec)
            print(rec, flush=True)
    return rows


def report(result: dict) -> str:
    """docs/benchmarks.md section: cuBLAS's batch variance vs ours, and the GEMM and attention times."""
    inv = result.get("invariance", {})
    changed = {k: max(v["cublas"].values()) for k, v in inv.items() if max(v["cublas"].values())}
    ours = sum(max(v["ours"].values()) for v in inv.values())
    lines = [f"Rows (of 8) whose bits change when computed inside a larger batch (16 to 4096 rows): cuBLAS "
             f"{', '.join(f'{k} {v}' for k, v in changed.items()) or 'none'}; ours {ours} on every shape.", "",
             "| weight | M | cuBLAS us | ours us | ours, K in one segment, us |", "|---|---:|---:|---:|---:|"]
    for g in (r for r in result["rows"] if r["impl"] == "gemm"):
        if g["m"] in (1, 256, 8192):
            one = f"{g['ours_one_segment_us']:.1f}" if "ours_one_segment_us" in g else "-"
            lines.append(f"| {g['model']} {g['layer']} {g['n']}x{g['k']} | {g['m']} | {g['cublas_us']:.1f} | "
                         f"{g['ours_us']:.1f}{' (split)' if g.get('split') else ''} | {one} |")
    lines += ["", "| attention | heads/kv x d | batch x context | default us | ours us (unsplit / split) |",
              "|---|---|---|---:|---|"]
    for a in (r for r in result["rows"] if r["impl"] == "attention"):
        ours = " / ".join(f"{v:.1f}" for k, v in sorted(a.items()) if k.startswith("ours_"))
        lines.append(f"| {a['kind']} | {a['heads']}/{a['kv_heads']} x {a['head_dim']} | {a['batch']} x {a['context']} "
                     f"| {a['default_us']:.1f} | {ours} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--sweep", action="store_true", help="also time candidate GEMM tile configs")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    result = gpu_run_info("benchmarks.kernels.bench_invariant_kernels", argv)
    result["invariance"] = _invariance()
    result["config_equivalence"] = _config_equivalence()
    result["rows"] = ([dict(impl="gemm", **r) for r in _gemm(args.quick, args.sweep)]
                      + [dict(impl="attention", **r) for r in _attention(args.quick)])
    print("wrote", write_result(result, args.out_dir, "invariant_kernels"))


if __name__ == "__main__":
    main()
