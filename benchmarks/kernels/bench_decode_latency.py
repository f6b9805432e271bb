"""Small-batch paged decode as the engine launches it (GPU): where a batch-1 step's ~11 us attention
launch goes, and which split count and tile config make it shorter.

At batch 1 a decode launch reads a few MB of K/V at most, so its time is latency (the dependent
loads of context_len, the block table, K/V, the split partials), not bandwidth: the profile of the
Llama-3.1-8B step (benchmarks/results/experiments/profile_step_llama-3.1-8b_tp1_h100.json) shows
10.8 us a layer on an H100, 11.3 on an H200 at TP=2, ~7% of the step. This runs the engine's launch
(this step's K/V written in the same launch, kernels/paged_decode.py), one per layer of 32 layers,
each with its own cache, inside one CUDA graph, with a 64 MB read between layers so that every
launch starts from an L2 without its data (as after the layer's GEMMs), and takes the decode
kernel's own device time from torch.profiler: per (shape, batch, context), the default config
(decode_config.choose_config at each block-table width), every split count x tile config, and each
tile at 32 splits with decode_config's launch option HALF_MERGE (which the tables pick for small grids).

Measured so (H200, benchmarks/results/decode_latency_h200.json) the default launch took 7.2-8.0 us
at 512 tokens for the 8B shape and its TP shares, against 11.1-11.3 in the engines' step profiles:
the launch alone does not hold the difference (what the step around it adds is not measured here).

  python -m benchmarks.kernels.bench_decode_latency [--out-dir benchmarks/results] [--quick]
Writes decode_latency_<gpu>.json.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import time

import torch

from benchmarks.kernels.decode_check import pool_map
from benchmarks.shared.common import gpu_run_info, write_result

BLOCK_SIZE = 16  # the engine's default (server/config.py)
LAYERS = 32
# (name, heads, kv_heads, head_dim): one rank's attention
SHAPES = (("llama-3.1-8b", 32, 8, 128), ("llama-3.1-8b/tp2", 16, 4, 128), ("llama-3.1-70b/tp4", 16, 2, 128),
          ("qwen2.5-0.5b", 14, 2, 64))
BATCHES = (1, 4)
CONTEXTS = (512, 2048, 8192, 32768)
WIDTHS = (4096, 131072)  # block-table widths in tokens (max_model_len): the default config's input
SPLITS = (1, 2, 4, 8, 16, 32)
TILES = {128: ((64, 4, 3), (64, 4, 5), (32, 4, 3), (32, 4, 5)), 64: ((32, 4, 3), (32, 4, 5), (64, 4, 3), (16, 4, 5))}


def _cfg(tile: tuple, splits: int, half: bool = False) -> dict:
    block_n, warps, stages = tile
    # (HALF_MERGE said either way: paged_decode's _config overrides the tables' config key by key, and
    # the tables pick HALF_MERGE for some of these cases)
    return {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages, "PREFETCH": 0, "num_splits": splits,
            "HALF_MERGE": half}


def _configs(d: int) -> list[dict]:
    """Every tile at every split count, and at 32 splits with the launch option HALF_MERGE too."""
    return [_cfg(t, s) for t in TILES[d] for s in SPLITS] + [_cfg(t, 32, half=True) for t in TILES[d]]


def _layers(heads: int, kvh: int, d: int, batch: int, context: int, width: int, count: int = LAYERS):
    """`count` caches of `batch` sequences of `context` tokens (this step's the last), one block table."""
    dev, dt = "cuda", torch.bfloat16
    nblk = -(-context // BLOCK_SIZE)
    bt = torch.zeros(batch, width // BLOCK_SIZE, dtype=torch.int32, device=dev)
    bt[:, :nblk] = torch.randperm(batch * nblk, device=dev).view(batch, nblk).int()
    last = context - 1
    slot = (bt[:, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE)
    ctx = torch.full((batch,), context, dtype=torch.int32, device=dev)
    layers = []
    for _ in range(count):
        kc, vc = (torch.randn(batch * nblk, BLOCK_SIZE, kvh, d, device=dev, dtype=dt) for _ in range(2))
        q, out = (torch.randn(batch, heads, d, device=dev, dtype=dt) for _ in range(2))
        kn, vn = (torch.randn(batch, kvh, d, device=dev, dtype=dt) for _ in range(2))
        layers.append((q, kc, vc, out, kn, vn))
    return bt, ctx, slot, layers


def _run(case, cfg: dict | None) -> None:
    from kernels.paged_decode import paged_decode

    bt, ctx, slot, layers = case
    for q, kc, vc, out, kn, vn in layers:
        paged_decode(q, kc, vc, bt, ctx, 0.088, out=out, k_new=kn, v_new=vn, slot_mapping=slot,
                     num_splits=None if cfg is None else cfg["num_splits"], _config=cfg)


def _compile(job) -> None:
    """Compile one variant (spawned process; Triton's disk cache keeps it for the main process)."""
    heads, kvh, d, cfg = job
    _run(_layers(heads, kvh, d, 1, 100, 4096, count=1), cfg)
    torch.cuda.synchronize()


@functools.cache
def _flush() -> tuple[torch.Tensor, torch.Tensor]:
    """The 64 MB that the graph reads before each launch, and the scalar its sum goes to."""
    return torch.zeros(16 << 20, dtype=torch.float32, device="cuda"), torch.empty((), dtype=torch.float32, device="cuda")


def time_us(case, cfg: dict | None, replays: int = 20) -> float:
    """Median device time of one decode launch: LAYERS launches in a CUDA graph, each after a 64 MB
    read, under torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    flush, sink = _flush()
    _run(case, cfg)  # compile / plan outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    bt, ctx, slot, layers = case
    with torch.cuda.graph(g):
        for layer in layers:
            torch.sum(flush, dim=0, out=sink)
            _run((bt, ctx, slot, [layer]), cfg)
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    us = [e.time_range.elapsed_us() for e in prof.events()
          if e.device_type == DeviceType.CUDA and "_decode_kernel" in e.name]
    return statistics.median(us)


def _split_us(row: dict, tile: tuple, splits: int, half: bool = False) -> float | None:
    for c in row["configs"]:
        cfg = c["config"]
        if ((cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"], cfg["num_splits"]) == (*tile, splits)
                and cfg.get("HALF_MERGE", False) == half):
            return c["us"]
    return None


def report(result: dict) -> str:
    """The docs/benchmarks.md section: per case, the default config's time at each block-table width,
    the default tile at 16 and 32 splits, and the fastest config measured."""
    lines = [f"Device time of one decode launch (the fused K/V write; {result['layers']} layers' launches in a "
             "CUDA graph, a 64 MB read before each), median, us. `default`: decode_config.choose_config at a "
             "block-table width of 4k / 128k tokens (at 8k+ tokens only the 128k width holds the context).", "",
             "| shape (one rank) | batch | context | default 4k | default 128k | 16 splits | 32 splits | 32, HALF_MERGE "
             "| best | best config |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        dflt = {w: f"{v['us']:.1f} ({v['config']['num_splits']})" for w, v in r["default"].items()}
        cfg = next(iter(r["default"].values()))["config"]
        tile = (cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"])
        at = [_split_us(r, tile, 16), _split_us(r, tile, 32), _split_us(r, tile, 32, half=True)]
        b = r["best"]["config"]
        lines.append(f"| {r['shape']} ({r['heads']}/{r['kv_heads']} x {r['head_dim']}) | {r['batch']} | {r['context']} | "
                     f"{dflt.get('4096', '-')} | {dflt.get('131072', '-')} | "
                     + " | ".join("-" if u is None else f"{u:.1f}" for u in at)
                     + f" | {r['best']['us']:.1f} | {b['num_splits']} splits{' (HALF_MERGE)' if b.get('HALF_MERGE') else ''}, "
                       f"{b['BLOCK_N']}-key tiles, {b['num_stages']} stages |")
    lines += ["", "(default cells: us (split count); 16 / 32 splits: the default's tile at that split count; "
              "HALF_MERGE: decode_config's launch option, - where the run predates it)"]
    if result.get("note"):
        lines += ["", result["note"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from kernels.decode_config import _num_sms, choose_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="the TP=1 shape at batch 1 alone")
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; cases left after it are skipped")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    shapes = SHAPES[:1] if args.quick else SHAPES
    batches = BATCHES[:1] if args.quick else BATCHES
    sms = _num_sms(torch.device("cuda"))
    pool_map(_compile, [(h, kvh, d, cfg) for _, h, kvh, d in shapes for cfg in _configs(d)])
    result = gpu_run_info("benchmarks.kernels.bench_decode_latency", argv)
    result.update(layers=LAYERS, block_size=BLOCK_SIZE, rows=[])
    rows, path = result["rows"], None
    # batch 1 first: the cases this is for
    for b, (name, h, kvh, d), n in itertools.product(batches, shapes, CONTEXTS):
        if time.monotonic() - t0 > args.budget:
            print(f"budget spent: {name} b{b} ctx {n} and later cases skipped")
            break
        case = _layers(h, kvh, d, b, n, max(WIDTHS))
        row = {"impl": "flashpage", "shape": name, "heads": h, "kv_heads": kvh, "head_dim": d, "batch": b, "context": n,
               "default": {}, "configs": []}
        for w in WIDTHS:
            if w >= n:
                cfg = choose_config(b, kvh, h // kvh, w, sms, head_dim=d)
                row["default"][str(w)] = {"config": cfg, "us": round(time_us(case, cfg), 2)}
        for cfg in _configs(d):
            row["configs"].append({"config": cfg, "us": round(time_us(case, cfg), 2)})
        best = min(row["configs"], key=lambda c: c["us"])
        row["best"] = best
        dflt = ", ".join(f"w{w}: {v['us']} us ({v['config']['num_splits']} splits)" for w, v in row["default"].items())
        print(f"{name:18s} b{b} ctx {n:6d}  default {dflt}  best {best['us']} us {best['config']}", flush=True)
        rows.append(row)
        path = write_result(result, args.out_dir, "decode_latency")  # after every case: a limit keeps the rest
        del case
    print("wrote", path)
    return result


if __name__ == "__main__":
    main()
