"""Quantized weights on a GPU, 16-bit and quantized side by side in one run, same shapes (issue 47):

  gemm        the linears of a shape at decode and prefill row counts: bf16 cuBLAS, FP8 through
              torch._scaled_mm (rowwise; with and without the activation quantization), the Triton
              FP8 GEMM (per channel and 128x128 blocks), the int4 and FP8 weight-only GEMMs; plus a
              sweep of the weight-only GEMM's decode tiles (the figures its config table comes from)
  tpot        batch-1 time per output token of the engine (128-token prompt, CUDA graphs): the
              difference between a 257- and a 1-token generation, over 256 tokens; and the decode
              graph's replay alone (device time)
  throughput  offline, bench_throughput.py's workload (256 requests, 128-512 tokens in and out)

Random checkpoints at the shape's real size (benchmarks/shared/checkpoint.py), quantized on the GPU by
benchmarks/quant/quant_checkpoint.py (fp8-dynamic: compressed-tensors FP8_DYNAMIC; awq: AWQ 4-bit g128).
Goals: at the Llama-3.1-8B shape, batch-1 TPOT FP8 <= 0.6x bf16 and 4-bit <= 0.4x; throughput FP8
>= 1.3x bf16. Writes quant_<gpu>.json after every step.

    python -m benchmarks.quant.bench_quant --shape llama-3.1-8b --formats bf16 fp8-dynamic awq --out-dir OUT
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.shared.checkpoint import LLAMA_SHAPES, make_random_llama  # noqa: E402
from benchmarks.shared.common import gpu_run_info, write_result  # noqa: E402
from benchmarks.quant.quant_checkpoint import quantize_checkpoint  # noqa: E402

GOALS = {"tpot_fp8_ratio_max": 0.6, "tpot_int4_ratio_max": 0.4, "throughput_fp8_ratio_min": 1.3}


def linear_shapes(shape: str) -> dict[str, tuple[int, int]]:
    s = LLAMA_SHAPES[shape]
    h, heads, kv = s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"]
    d = s.get("head_dim") or h // heads
    return {"qkv_proj": ((heads + 2 * kv) * d, h), "o_proj": (h, heads * d),
            "gate_up_proj": (2 * s["intermediate_size"], h), "down_proj": (h, s["intermediate_size"])}


def gemm_rows(shape: str, ms: list[int]) -> list[dict]:
    from triton.testing import do_bench

    from kernels.fp8_matmul import fp8_matmul
    from kernels.fp8_quant import quant_fp8
    from kernels.quant_reference import pack_int4
    from kernels.wo_matmul import wo_matmul

    rows = []
    for name, (n, k) in linear_shapes(shape).items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        scale = (w.float().abs().amax(1, keepdim=True) / 448).contiguous()
        w8 = (w.float() / scale).to(torch.float8_e4m3fn)
        block_scale = scale.expand(n, k // 128).contiguous()
        q4 = pack_int4(torch.randint(0, 16, (n, k), device="cuda"))
        s4 = torch.rand(n, k // 128, device="cuda") * 0.01
        z4 = torch.full((n, k // 128), 8, dtype=torch.uint8, device="cuda")
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quant_fp8(x)
            xqg, xsg = quant_fp8(x, 128)
            cases = {
                "bf16_cublas": lambda: torch.nn.functional.linear(x, w),
                "fp8_scaled_mm": lambda: torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=scale.view(1, -1),
                                                          out_dtype=torch.bfloat16),
                "fp8_scaled_mm_with_quant": lambda: _scaled_mm_with_quant(x, w8, scale),
                "fp8_triton_channel": lambda: fp8_matmul(xq, xs, w8, scale, 1 << 30, torch.bfloat16),
                "fp8_triton_block": lambda: fp8_matmul(xqg, xsg, w8, block_scale, 128, torch.bfloat16),
                "int4_weight_only": lambda: wo_matmul(x, q4, s4, z4, 128),
                "fp8_weight_only": lambda: wo_matmul(x, w8, scale, None, 1 << 30),
            }
            bytes_w = {"bf16_cublas": 2 * n * k, "int4_weight_only": n * k // 2}
            for impl, fn in cases.items():
                us = do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3
                wb = bytes_w.get(impl, n * k)
                rows.append(dict(step="gemm", linear=name, n=n, k=k, m=m, impl=impl, us=round(us, 2),
                                 weight_tbps=round(wb / us / 1e6, 3)))
            print(f"gemm {name:>12} m={m:5d}: " + "  ".join(f"{r['impl']} {r['us']:.1f}" for r in rows[-len(cases):]),
                  flush=True)
    return rows


def _scaled_mm_with_quant(x, w8, scale):
    """What a w8a8 linear runs when no norm quantized its input: the per-token quantization, then the GEMM."""
    from kernels.fp8_quant import quant_fp8

    q, s = quant_fp8(x)
    return torch._scaled_mm(q, w8.t(), scale_a=s, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16)


def sweep_rows(shape: str) -> list[dict]:
    """Decode tiles (M = 1 and 16) over the shape's linears: the int4 weight-only GEMM's, the Triton FP8 GEMM's."""
    from triton.testing import do_bench

    from kernels.fp8_matmul import Fp8MatmulConfig, fp8_matmul
    from kernels.fp8_quant import quant_fp8
    from kernels.quant_reference import pack_int4
    from kernels.wo_matmul import WoConfig, wo_matmul

    rows = []
    configs = [WoConfig(16, bn, bk, 4, st) for bn in (32, 64) for bk in (64, 128) for st in (3, 5)]
    fp8_configs = [Fp8MatmulConfig(16, bn, 4, 4, bk) for bn in (64, 128) for bk in (128, 256)]
    for name, (n, k) in linear_shapes(shape).items():
        q4 = pack_int4(torch.randint(0, 16, (n, k), device="cuda"))
        s4 = torch.rand(n, k // 128, device="cuda") * 0.01
        z4 = torch.full((n, k // 128), 8, dtype=torch.uint8, device="cuda")
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            best = None
            for cfg in configs:
                us = _bench_or_none(lambda: wo_matmul(x, q4, s4, z4, 128, cfg=cfg))
                rows.append(dict(step="sweep", impl="int4_weight_only", linear=name, n=n, k=k, m=m, config=list(cfg),
                                 us=us))
                if us is not None:
                    best = min(best or (us, cfg), (us, cfg))
            print(f"sweep int4 {name:>12} m={m}: best {best[1]} {best[0]:.1f} us", flush=True)
        # the Triton FP8 GEMM per channel at decode, against which torch._scaled_mm is measured above
        w8 = (torch.randn(n, k, device="cuda") * 10).to(torch.float8_e4m3fn)
        ws = torch.rand(n, 1, device="cuda") * 0.01
        for m in (1, 16):
            xq, xs = quant_fp8(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            best = None
            for cfg in fp8_configs:
                us = _bench_or_none(lambda: fp8_matmul(xq, xs, w8, ws, 1 << 30, torch.bfloat16, cfg=cfg))
                rows.append(dict(step="sweep_fp8", impl="fp8_triton_channel", linear=name, n=n, k=k, m=m,
                                 config=list(cfg), us=us))
                if us is not None:
                    best = min(best or (us, cfg), (us, cfg))
            scaled = do_bench(lambda: torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=ws.view(1, -1),
                                                       out_dtype=torch.bfloat16), warmup=5, rep=20,
                              return_mode="median") * 1e3
            rows.append(dict(step="sweep_fp8", impl="fp8_scaled_mm", linear=name, n=n, k=k, m=m, config="scaled_mm",
                             us=round(scaled, 2)))
            print(f"sweep fp8 {name:>12} m={m}: best {best[1]} {best[0]:.1f} us, torch._scaled_mm {scaled:.1f} us",
                  flush=True)
    return rows


def _bench_or_none(fn) -> float | None:
    """Median microseconds, or None for a config the GPU cannot run (shared memory)."""
    from triton.testing import do_bench

    try:
        return round(do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e3, 2)
    except Exception as e:  # triton's OutOfResources
        print(f"  config skipped: {type(e).__name__}", flush=True)
        return None


def install_tuned(rows: list[dict]) -> dict:
    """The sweep's best decode tiles in place of the kernels' tables for the engine steps that
    follow (recorded in the result), and the Triton FP8 GEMM for decode rows where it beat
    torch._scaled_mm on every linear of the shape."""
    import kernels.wo_matmul as wo
    import models.quant.methods as methods
    from kernels.fp8_matmul import Fp8MatmulConfig
    import kernels.fp8_matmul as f8

    def best(step):
        found = {}
        for r in rows:
            if r["step"] == step and r["us"] is not None and r["config"] != "scaled_mm":
                key = (r["n"], r["k"], r["m"])
                if key not in found or r["us"] < found[key][0]:
                    found[key] = (r["us"], r["config"])
        return found

    wo_best, f8_best = best("sweep"), best("sweep_fp8")
    scaled = {(r["n"], r["k"], r["m"]): r["us"] for r in rows
              if r["step"] == "sweep_fp8" and r["config"] == "scaled_mm"}
    wo_default, f8_default = wo.config, f8.config

    def wo_config(m, n, k):
        hit = wo_best.get((n, k, 1 if m <= 1 else 16)) if m <= 16 else None
        return wo.WoConfig(*hit[1]) if hit else wo_default(m, n, k)

    def f8_config(m, n):
        hit = next((v for (nn, _, mm), v in f8_best.items() if nn == n and mm == (1 if m <= 1 else 16)), None)
        return Fp8MatmulConfig(*hit[1]) if hit and m <= 16 else f8_default(m, n)

    wo.config, f8.config = wo_config, f8_config
    triton_wins = bool(scaled) and all(f8_best[key][0] < us for key, us in scaled.items() if key in f8_best)
    methods.TRITON_DECODE_ROWS = 16 if triton_wins else 0
    tuned = dict(wo={str(k): v[1] for k, v in wo_best.items()}, fp8={str(k): v[1] for k, v in f8_best.items()},
                 triton_decode_rows=methods.TRITON_DECODE_ROWS)
    print("tuned:", tuned, flush=True)
    return tuned


def engine_rows(path: Path, fmt: str, throughput: bool, args) -> list[dict]:
    from benchmarks.engine.bench_throughput import run_engine, workload
    from server.config import EngineConfig
    from server.engine import LLMEngine
    from server.sampling_params import SamplingParams
    from triton.testing import do_bench

    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(path), max_model_len=args.max_model_len))
    load_s = time.perf_counter() - t0
    rows = []
    prompt = [[(7 * i) % 1000 + 1 for i in range(128)]]

    def gen(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - t

    gen(8)
    diffs = sorted((gen(257) - gen(1)) / 256 * 1e3 for _ in range(3))
    graphs = engine.runner.graphs
    size = min(graphs.sizes) if graphs is not None else None  # the smallest decode graph holds batch 1
    replay_ms = do_bench(graphs.graphs[size][0].replay, return_mode="median") if graphs is not None else None
    rows.append(dict(step="tpot", impl=fmt, format=fmt, quantization=engine.quantization, weight_bytes=engine.weight_bytes,
                     kv_blocks=engine.block_manager.num_blocks,
                     tpot_ms=round(diffs[1], 3), tpot_ms_runs=[round(d, 3) for d in diffs],
                     graph_replay_ms=round(replay_ms, 3) if replay_ms else None, load_s=round(load_s, 1)))
    print(f"tpot {fmt}: {diffs[1]:.3f} ms (runs {diffs}), decode graph replay {replay_ms} ms, "
          f"weights {engine.weight_bytes / 2**30:.2f} GiB, load {load_s:.0f} s", flush=True)
    if throughput:
        vocab = engine.spec.vocab_size
        prompts, outs = workload(args.num_requests, (128, 512), (128, 512), vocab, seed=0)
        dt, tokens, split = run_engine(engine, prompts, outs)
        rows.append(dict(step="throughput", impl=fmt, format=fmt, requests=len(prompts), output_tokens=tokens,
                         seconds=round(dt, 2), tok_per_s=round(tokens / dt, 1), split=split))
        print(f"throughput {fmt}: {tokens / dt:.0f} tok/s ({tokens} tokens in {dt:.1f} s)", flush=True)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def summarize(rows: list[dict]) -> dict:
    tpot = {r["format"]: r["tpot_ms"] for r in rows if r["step"] == "tpot"}
    tput = {r["format"]: r["tok_per_s"] for r in rows if r["step"] == "throughput"}
    out = {}
    if "bf16" in tpot:
        for fmt, ms in tpot.items():
            out[f"tpot_ratio_{fmt}"] = round(ms / tpot["bf16"], 3)
    if "bf16" in tput:
        for fmt, v in tput.items():
            out[f"throughput_ratio_{fmt}"] = round(v / tput["bf16"], 3)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=list(LLAMA_SHAPES))
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8-dynamic", "awq"])
    ap.add_argument("--steps", nargs="+", default=["gemm", "sweep", "tpot", "throughput"])
    ap.add_argument("--gemm-m", type=int, nargs="+", default=[1, 16, 64, 256, 2048])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args(argv)
    result = dict(benchmark="quant", shape=args.shape, **gpu_run_info("benchmarks.quant.bench_quant", argv),
                  formats=args.formats, goals=GOALS, rows=[])

    def save():
        result["summary"] = summarize(result["rows"])
        write_result(result, args.out_dir, "quant")

    if "gemm" in args.steps:
        result["rows"] += gemm_rows(args.shape, args.gemm_m)
        save()
    if "sweep" in args.steps:
        result["rows"] += sweep_rows(args.shape)
        result["tuned"] = install_tuned(result["rows"])
        save()
    if {"tpot", "throughput"} & set(args.steps):
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            bf16 = make_random_llama(Path(tmp) / "bf16", args.shape, device="cuda")
            for fmt in args.formats:
                path = bf16
                if fmt != "bf16":
                    path = Path(tmp) / fmt
                    t0 = time.perf_counter()
                    quantize_checkpoint(bf16, path, fmt, device="cuda", dequantized=False)
                    torch.cuda.empty_cache()
                    print(f"{fmt} checkpoint written in {time.perf_counter() - t0:.0f} s", flush=True)
                result["rows"] += engine_rows(path, fmt, "throughput" in args.steps, args)
                save()
    save()
    print(result["summary"])
    return result


if __name__ == "__main__":
    main()
