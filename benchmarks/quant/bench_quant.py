"""Quantized weights on a GPU, 16-bit and quantized side by side in one run, same shapes (issue 47):

  gemm        the shape's four linears at 1, 16, 256 and 2048 rows: bf16 cuBLAS, torch._scaled_mm
              (rowwise; with and without the activation quantization before it), torch's 128x128-block
              FP8 GEMM where this torch has one (checked against ours), and ours: what
              models/quant/gemms.py runs for FP8 per channel (input quantized by the norm, or raw: the
              GEMV quantizes it at one row), FP8 128x128 blocks and int4 (AWQ's group 128), plus the
              tile kernels and the int4 GEMV's half2 loop (ours_int4_half2; _prescale: each K step scaled) at
              one row for comparison with the GEMV, and the 16-bit weight through our GEMV (ours_bf16_gemv,
              kernels/gemv.py's gemv16, which models/linear.py takes at one row) beside bf16 cuBLAS. Each
              case is timed as a CUDA graph of calls over
              copies of the weight that together pass the L2 cache (as a decode step's layers do): no
              launch gaps, no L2 hits, device time only
  sweep       the decode GEMV's tiles at one row for each linear (FP8 per channel, int4, bf16), the default
              (kernels/gemv.py's config) first; the best of each is recorded under "tuned", and the
              engine steps run with them only with --install-tuned (else what ships: "engine_gemv")
  tpot        batch-1 time per output token of the engine (128-token prompt, CUDA graphs): the
              difference between a 257- and a 1-token generation, over 256 tokens; and the batch-1
              decode graph's replay alone
  throughput  offline, bench_throughput.py's workload (256 requests, 128-512 tokens in and out)

Each format's engine runs in a child process (one failure, a device-side assert included, costs only
that format) under the run's time budget. Checkpoints: benchmarks/shared/checkpoint.py's random Llama at the
shape's real size, written on the GPU, and benchmarks/quant/quant_checkpoint.py's copies (fp8-dynamic:
compressed-tensors FP8_DYNAMIC; fp8-block: quant_method fp8, 128x128 blocks; awq: AWQ 4-bit g128).
Goals: at the Llama-3.1-8B shape, batch-1 TPOT FP8 <= 0.6x bf16 and 4-bit <= 0.4x; throughput FP8
>= 1.3x bf16. Writes quant_<gpu>.json after every step and prints a table last.

    python -m benchmarks.quant.bench_quant --out-dir OUT [--time-budget 420] [--install-tuned]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.shared.checkpoint import LLAMA_SHAPES, make_random_llama
from benchmarks.shared.common import gpu_run_info, replay_us, write_result

GOALS = {"tpot_fp8_ratio_max": 0.6, "tpot_int4_ratio_max": 0.4, "throughput_fp8_ratio_min": 1.3}
INT4 = ("awq", "gptq", "w4a16")
# a format's options, as suffixes (awq+no-prescale+pdl): its engine with a models/quant/gemms.py switch
# on or off (+prescale / +no-prescale: o_proj's and down_proj's int4 GEMVs through the scaled half2
# loop; +quantfirst / +no-quantfirst: an FP8 GEMV's 16-bit row quantized by its own launch first;
# +w8a16 / +no-w8a16: one row read by FP8 linears unquantized), or with --enable-pdl (+pdl), or
# with a 16-bit linear's one row through cuBLAS instead of our GEMV (+no-gemv16: models/linear.py's
# FLASHPAGE_GEMV16=0, read as the model is built)
GEMMS_OPTIONS = {"prescale": "HALF2_PRESCALE", "quantfirst": "FP8_GEMV_QUANT_FIRST", "w8a16": "ONE_ROW_W8A16"}


def gemms_switches(fmt: str) -> dict[str, bool]:
    """The gemms.py switches a format's options set: awq+no-prescale -> {"HALF2_PRESCALE": False}."""
    out = {}
    for opt in fmt.split("+")[1:]:
        name = opt.removeprefix("no-")
        if name in GEMMS_OPTIONS:
            out[GEMMS_OPTIONS[name]] = not opt.startswith("no-")
        elif opt not in ("pdl", "gemv16", "no-gemv16"):
            raise SystemExit(f"bench_quant: unknown format option +{opt} (prescale, quantfirst, w8a16, pdl, no-gemv16, "
                             "no-...)")
    return out


def base_format(fmt: str) -> str:
    """The checkpoint format of a format with options (awq+prescale+pdl -> awq)."""
    return fmt.split("+")[0]
GEMV_SWEEP = [(16, 512, 4, 0), (8, 512, 4, 0), (32, 512, 8, 0), (16, 1024, 8, 0), (8, 1024, 4, 0), (4, 512, 2, 0),
              (16, 512, 4, 1), (4, 256, 2, 0), (8, 256, 4, 0)]  # (block_n, block_k, warps, splits: 0 = from the shape)
# gemv16's, its K splits named: in its first H200 sweep (of GEMV_SWEEP) the shape's rule split
# qkv_proj's 16 x 512 tiles in two, 17.4 us against 14.5 unsplit
GEMV16_SWEEP = [(16, 512, 4, 1), (16, 512, 4, 2), (16, 512, 4, 4), (8, 512, 4, 1), (8, 512, 4, 2), (8, 256, 4, 1),
                (8, 256, 4, 2), (16, 256, 4, 1), (16, 256, 4, 2), (32, 256, 4, 1), (32, 512, 8, 1), (16, 1024, 8, 1),
                (4, 512, 2, 1), (4, 512, 2, 2)]


def linear_shapes(shape: str) -> dict[str, tuple[int, int]]:
    s = LLAMA_SHAPES[shape]
    h, heads, kv = s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"]
    d = s.get("head_dim") or h // heads
    return {"qkv_proj": ((heads + 2 * kv) * d, h), "o_proj": (h, heads * d),
            "gate_up_proj": (2 * s["intermediate_size"], h), "down_proj": (h, s["intermediate_size"])}


def graph_us(call, copies: int, calls: int = 24, reps: int = 7) -> float:
    """Median device microseconds of one call(i): `calls` calls captured in one CUDA graph, call j on
    copy j % copies of the weights."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, autotune and cuBLAS's workspace outside the capture
        for i in range(copies):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for j in range(calls):
            call(j % copies)
    graph.replay()
    us = replay_us(graph, calls, reps)
    del graph
    return round(us, 2)


def _weights(n: int, k: int, copies: int) -> list[dict]:
    """Each linear's weights in every layout the cases read, `copies` times (different values)."""
    from kernels.quant_reference import pack_int4

    out = []
    for _ in range(copies):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        scale = (w.float().abs().amax(1, keepdim=True) / 448).contiguous()
        blocks = w.float().reshape(n // 128, 128, k // 128, 128).abs().amax((1, 3)) / 448  # [N/128, K/128]
        w8b = (w.float() / blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
        out.append(dict(w=w, w8=(w.float() / scale).to(torch.float8_e4m3fn), scale=scale, w8b=w8b, blocks=blocks,
                        block_scale=blocks.repeat_interleave(128, 0).contiguous(),
                        q4=pack_int4(torch.randint(0, 16, (n, k), device="cuda")),
                        s4=torch.rand(n, k // 128, device="cuda") * 0.002,
                        z4=torch.randint(0, 16, (n, k // 128), device="cuda", dtype=torch.uint8)))
    return out


def _block_scaled_mm(xq, xs, wq, blocks):
    """torch._scaled_mm with 1x128 activation and 128x128 weight block scales (DeepSeek's recipe),
    where this torch and GPU have it: both scales outer-dim-major."""
    return torch._scaled_mm(xq, wq.t(), scale_a=xs.t().contiguous().t(), scale_b=blocks.t(), out_dtype=torch.bfloat16)


def gemm_rows(shape: str, ms: list[int]) -> list[dict]:
    from kernels.fp8_matmul import fp8_matmul
    from kernels.fp8_quant import quant_fp8
    from kernels.gemv import fp8_gemv, gemv16, wo_gemv
    from kernels.wo_matmul import wo_matmul
    from models.quant.gemms import QuantizedInput, fp8_linear, weight_only_linear

    rows = []
    for name, (n, k) in linear_shapes(shape).items():
        copies = max(2, -(-300_000_000 // (2 * n * k)))  # > 300 MB of bf16 weights: past the 50 MB L2
        ws = _weights(n, k, copies)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quant_fp8(x)
            xqg, xsg = quant_fp8(x, 128)
            cases = {
                "bf16_cublas": lambda i: torch.nn.functional.linear(x, ws[i]["w"]),
                "fp8_scaled_mm": lambda i: torch._scaled_mm(xq, ws[i]["w8"].t(), scale_a=xs,
                                                            scale_b=ws[i]["scale"].view(1, -1),
                                                            out_dtype=torch.bfloat16),
                "fp8_scaled_mm_with_quant": lambda i: _scaled_mm_with_quant(x, ws[i]),
                "fp8_block_scaled_mm": lambda i: _block_scaled_mm(xqg, xsg, ws[i]["w8b"], ws[i]["blocks"]),
                "ours_fp8": lambda i: fp8_linear(QuantizedInput(xq, xs), ws[i]["w8"], ws[i]["scale"], 1 << 30,
                                                 1 << 30, None, torch.bfloat16, None, True),
                "ours_fp8_raw_input": lambda i: fp8_linear(x, ws[i]["w8"], ws[i]["scale"], 1 << 30, 1 << 30, None,
                                                           torch.bfloat16, None, True),
                "ours_fp8_block": lambda i: fp8_linear(QuantizedInput(xqg, xsg), ws[i]["w8b"], ws[i]["block_scale"],
                                                       128, 128, None, torch.bfloat16, None, False),
                "ours_int4": lambda i: weight_only_linear(x, ws[i]["q4"], ws[i]["s4"], ws[i]["z4"], 128, None),
            }
            if m == 1:  # the tile kernels the GEMV replaces at one row
                # the 16-bit weight through our GEMV (what models/linear.py takes at one row) against bf16_cublas
                cases["ours_bf16_gemv"] = lambda i: gemv16(x, ws[i]["w"])
                cases["fp8_tiles"] = lambda i: fp8_matmul(xq, xs, ws[i]["w8"], ws[i]["scale"], 1 << 30, torch.bfloat16)
                cases["int4_tiles"] = lambda i: wo_matmul(x, ws[i]["q4"], ws[i]["s4"], ws[i]["z4"], 128)
                # the GEMV's half2 loop (kernels/gemv_int4.py: what gemms.py takes after a norm), same tiles
                cases["ours_int4_half2"] = lambda i: wo_gemv(x, ws[i]["q4"], ws[i]["s4"], ws[i]["z4"], 128, half2=True)
                # a 16-bit row quantized by its own launch first, then the GEMV (the same bits as the GEMV's
                # own quantization: gemms.FP8_GEMV_QUANT_FIRST, which applies with ONE_ROW_W8A16 off)
                cases["ours_fp8_quant_first"] = lambda i: fp8_gemv(*quant_fp8(x), ws[i]["w8"], ws[i]["scale"], 1 << 30,
                                                                   torch.bfloat16)
                # the 16-bit row unquantized (w8a16: what gemms.ONE_ROW_W8A16 takes at one row, where the
                # norm and silu_mul before then quantize nothing; ours_fp8_raw_input is this there too)
                cases["ours_fp8_w8a16"] = lambda i: fp8_gemv(x, None, ws[i]["w8"], ws[i]["scale"], 1 << 30,
                                                             torch.bfloat16, weight_only=True)
                # ... with each K step's power of two (any |x|: what o_proj and down_proj would take)
                cases["ours_int4_half2_prescale"] = lambda i: wo_gemv(x, ws[i]["q4"], ws[i]["s4"], ws[i]["z4"], 128,
                                                                      half2=True, prescale=True)
            int4_bytes = n * k // 2 + n * k // 128 * 5
            weight_bytes = {"bf16_cublas": 2 * n * k, "ours_bf16_gemv": 2 * n * k, "ours_int4": int4_bytes, "int4_tiles": int4_bytes,
                            "ours_int4_half2": int4_bytes, "ours_int4_half2_prescale": int4_bytes}
            for impl, fn in cases.items():
                row = dict(step="gemm", linear=name, n=n, k=k, m=m, impl=impl)
                try:
                    if impl == "fp8_block_scaled_mm":  # only where it computes what ours does
                        got, want = fn(0).float(), cases["ours_fp8_block"](0).float()
                        assert (got - want).abs().max() <= 0.02 * want.abs().max() + 1e-3, "differs from ours"
                    row["us"] = graph_us(fn, copies)
                    row["weight_tbps"] = round(weight_bytes.get(impl, n * k + n * 4) / row["us"] / 1e6, 3)
                except Exception as e:  # a mode this torch lacks, a config a GPU cannot run
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
            print(f"gemm {name:>12} m={m:5d}: " + "  ".join(f"{r['impl']} {r.get('us', 'x')}" for r in rows[-len(cases):]),
                  flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


def _scaled_mm_with_quant(x, w):
    """A w8a8 linear whose input no norm quantized, past the GEMV's one row: quantization, then the GEMM."""
    from kernels.fp8_quant import quant_fp8

    q, s = quant_fp8(x)
    return torch._scaled_mm(q, w["w8"].t(), scale_a=s, scale_b=w["scale"].view(1, -1), out_dtype=torch.bfloat16)


SWEEP_KINDS = ("fp8", "fp8_w8a16", "int4", "int4_half2", "bf16")


def sweep_rows(shape: str, kinds: tuple[str, ...] = SWEEP_KINDS) -> list[dict]:
    """The GEMV's tiles at one row, per linear: FP8 per channel (input from the norm), int4 g128, and
    int4 g128 through the half2 loop (kernels/gemv_int4.py, an option off by default: its own picks),
    and the 16-bit weight (gemv16: what models/linear.py takes at one row)."""
    from kernels.fp8_quant import quant_fp8
    from kernels.gemv import GemvConfig, fp8_gemv, gemv16, wo_gemv

    rows = []
    for name, (n, k) in linear_shapes(shape).items():
        copies = max(2, -(-300_000_000 // (2 * n * k)))
        ws = _weights(n, k, copies)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        xq, xs = quant_fp8(x)
        for kind in kinds:
            sweep = GEMV16_SWEEP if kind == "bf16" else GEMV_SWEEP
            for c in sweep:
                cfg = GemvConfig(*c)
                if kind == "fp8":
                    fn = lambda i: fp8_gemv(xq, xs, ws[i]["w8"], ws[i]["scale"], 1 << 30, torch.bfloat16, cfg=cfg)  # noqa: E731
                elif kind == "bf16":
                    fn = lambda i: gemv16(x, ws[i]["w"], cfg=cfg)  # noqa: E731
                elif kind == "fp8_w8a16":
                    fn = lambda i: fp8_gemv(x, None, ws[i]["w8"], ws[i]["scale"], 1 << 30, torch.bfloat16, cfg=cfg,  # noqa: E731
                                            weight_only=True)
                else:
                    fn = lambda i: wo_gemv(x, ws[i]["q4"], ws[i]["s4"], ws[i]["z4"], 128, cfg=cfg,  # noqa: E731
                                           half2=kind == "int4_half2")
                row = dict(step="sweep", impl=f"{kind}_gemv", linear=name, n=n, k=k, m=1, config=list(c))
                try:
                    row["us"] = graph_us(fn, copies)
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
            done = [r for r in rows[-len(sweep):] if "us" in r]
            best = min(done, key=lambda r: r["us"]) if done else None
            print(f"sweep {kind} gemv {name:>12}: " + "  ".join(f"{r['config']} {r.get('us', 'x')}"
                                                                for r in rows[-len(sweep):])
                  + (f" -> best {best['config']}" if best else ""), flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


def best_configs(rows: list[dict]) -> dict[str, list]:
    """{"fp8|fp8_w8a16|int4|int4_half2|bf16 N K": the fastest GEMV config} from the sweep's rows
    (install_gemv_configs reads the fp8, fp8_w8a16 and int4 ones: kernels/gemv.config's)."""
    best = {}
    for r in rows:
        if r["step"] == "sweep" and "us" in r:
            key = f"{r['impl'].removesuffix('_gemv')} {r['n']} {r['k']}"
            if key not in best or r["us"] < best[key][0]:
                best[key] = (r["us"], r["config"])
    return {key: cfg for key, (_, cfg) in best.items()}


def install_gemv_configs(tuned: dict[str, list]) -> None:
    """The sweep's best GEMV tiles in place of kernels/gemv.py's defaults (in this process)."""
    import kernels.gemv as gemv

    default, default16 = gemv.config, gemv.config16

    def config(n, k, int4, w8a16=False):
        hit = tuned.get(f"{'int4' if int4 else 'fp8_w8a16' if w8a16 else 'fp8'} {n} {k}")
        return gemv.GemvConfig(*hit) if hit else default(n, k, int4, w8a16)

    def config16(n, k):
        hit = tuned.get(f"bf16 {n} {k}")
        return gemv.GemvConfig(*hit) if hit else default16(n, k)

    gemv.config, gemv.config16 = config, config16


def engine_rows(path: Path, fmt: str, args) -> list[dict]:
    """TPOT and offline throughput of one format's engine (run in a child process)."""
    from triton.testing import do_bench

    from benchmarks.engine.bench_throughput import run_engine, workload
    from server.config import EngineConfig
    from server.engine import LLMEngine
    from server.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(path), max_model_len=args.max_model_len, enable_pdl="+pdl" in fmt))
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
    replay_ms = do_bench(graphs.graphs[min(graphs.sizes)][0].replay, return_mode="median") if graphs else None
    rows.append(dict(step="tpot", impl=fmt, format=fmt, quantization=engine.quantization,
                     weight_bytes=engine.weight_bytes, kv_blocks=engine.block_manager.num_blocks,
                     tpot_ms=round(diffs[1], 3), tpot_ms_runs=[round(d, 3) for d in diffs],
                     graph_replay_ms=round(replay_ms, 3) if replay_ms else None, load_s=round(load_s, 1)))
    print(f"tpot {fmt}: {diffs[1]:.3f} ms (runs {[round(d, 3) for d in diffs]}), decode graph replay {replay_ms} ms, "
          f"weights {engine.weight_bytes / 2**30:.2f} GiB, load {load_s:.0f} s", flush=True)
    if args.num_requests:
        prompts, outs = workload(args.num_requests, (128, 512), (128, 512), engine.spec.vocab_size, seed=0)
        dt, tokens, split = run_engine(engine, prompts, outs)
        rows.append(dict(step="throughput", impl=fmt, format=fmt, requests=len(prompts), output_tokens=tokens,
                         seconds=round(dt, 2), tok_per_s=round(tokens / dt, 1), split=split))
        print(f"throughput {fmt}: {tokens / dt:.0f} tok/s ({tokens} tokens in {dt:.1f} s)", flush=True)
    return rows


def run_child(fmt: str, path: Path, args, tuned: dict, timeout: float) -> list[dict]:
    """engine_rows in a child process; a failure or the timeout becomes a row that says so."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    cmd = [sys.executable, "-m", "benchmarks.quant.bench_quant", "--child", fmt, str(path), str(out),
           "--gemv-configs", json.dumps(tuned), "--num-requests", str(args.num_requests), "--max-model-len", str(args.max_model_len)]
    try:
        proc = subprocess.run(cmd, timeout=timeout)
        if proc.returncode == 0:
            return json.loads(out.read_text())
        error = f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        error = f"killed after {timeout:.0f} s (the run's time budget)"
    print(f"engine {fmt}: {error}", flush=True)
    return [dict(step="engine", impl=fmt, format=fmt, error=error)]


def summarize(rows: list[dict]) -> dict:
    tpot = {r["format"]: r["tpot_ms"] for r in rows if r["step"] == "tpot"}
    tput = {r["format"]: r["tok_per_s"] for r in rows if r["step"] == "throughput"}
    out = {}
    for name, values in (("tpot_ratio", tpot), ("throughput_ratio", tput)):
        if "bf16" in values:
            out.update({f"{name}_{fmt}": round(v / values["bf16"], 3) for fmt, v in values.items() if fmt != "bf16"})
    for fmt in tpot:
        if base_format(fmt) != "bf16" and "bf16" in tpot:  # (bf16+pdl: a ratio, no goal)
            goal = GOALS["tpot_int4_ratio_max"] if base_format(fmt) in INT4 else GOALS["tpot_fp8_ratio_max"]
            out[f"tpot_goal_met_{fmt}"] = out[f"tpot_ratio_{fmt}"] <= goal
    for fmt in tput:
        if fmt.startswith("fp8") and "bf16" in tput:
            out[f"throughput_goal_met_{fmt}"] = out[f"throughput_ratio_{fmt}"] >= GOALS["throughput_fp8_ratio_min"]
    return out


def table(result: dict) -> str:
    """The run in a few lines: engine figures per format, and the one-row GEMMs (us) per linear."""
    rows, lines = result["rows"], []
    for r in rows:
        if r["step"] == "tpot":
            tput = next((t["tok_per_s"] for t in rows if t["step"] == "throughput" and t["format"] == r["format"]), None)
            ratio = result["summary"].get
            lines.append(f"{r['format']:>12}: TPOT {r['tpot_ms']:.3f} ms (x{ratio('tpot_ratio_' + r['format'], '-')}), "
                         f"{tput or '-'} tok/s (x{ratio('throughput_ratio_' + r['format'], '-')}), "
                         f"weights {r['weight_bytes'] / 2**30:.2f} GiB")
        elif "error" in r and r["step"] == "engine":
            lines.append(f"{r['format']:>12}: {r['error']}")
    impls = ["bf16_cublas", "ours_bf16_gemv", "fp8_scaled_mm", "ours_fp8", "ours_fp8_w8a16", "ours_fp8_raw_input", "ours_fp8_quant_first",
             "ours_fp8_block", "ours_int4",
             "ours_int4_half2", "ours_int4_half2_prescale", "fp8_tiles", "int4_tiles"]
    lines.append("one row, us: " + " | ".join(impls))
    for name in linear_shapes(result["shape"]):
        got = {r["impl"]: r.get("us", "x") for r in rows if r["step"] == "gemm" and r["linear"] == name and r["m"] == 1}
        lines.append(f"{name:>12}: " + " | ".join(str(got.get(i, "-")) for i in impls))
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=list(LLAMA_SHAPES))
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8-dynamic", "awq", "fp8-block"],
                    help="quant_checkpoint.py's formats (bf16: the 16-bit checkpoint), each with options as "
                         "suffixes: +prescale (int4: o_proj's and down_proj's GEMVs through the half2 loop with its "
                         "per-step scaling, gemms.HALF2_PRESCALE), +quantfirst (FP8: o_proj's row quantized by a "
                         "launch of its own, gemms.FP8_GEMV_QUANT_FIRST), +w8a16 (FP8: one row read unquantized, "
                         "gemms.ONE_ROW_W8A16), each also as +no-..., +pdl (--enable-pdl), +no-gemv16 (a 16-bit "
                         "linear's one row through cuBLAS, not kernels/gemv.py's gemv16: FLASHPAGE_GEMV16=0); "
                         "e.g. awq+no-prescale+pdl")
    ap.add_argument("--steps", nargs="+", default=["gemm", "sweep", "engine"])
    ap.add_argument("--gemm-m", type=int, nargs="+", default=[1, 16, 256, 2048])
    ap.add_argument("--sweep-kinds", nargs="+", default=list(SWEEP_KINDS), choices=SWEEP_KINDS,
                    help="the GEMV loops the sweep times (fp8_w8a16: fp8_gemv of an unquantized row)")
    ap.add_argument("--num-requests", type=int, default=256, help="offline throughput's requests (0: no throughput)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--time-budget", type=float, default=420, help="seconds for the whole run; engines past it are skipped")
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--install-tuned", action="store_true",
                    help="the engines run the sweep's best GEMV tiles instead of kernels/gemv.py's defaults")
    ap.add_argument("--gemv-configs", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--child", nargs=3, metavar=("FORMAT", "CHECKPOINT", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:  # one format's engine steps, in a process of its own
        fmt, path, out = args.child
        install_gemv_configs(json.loads(args.gemv_configs))
        import models.quant.gemms as gemms

        for switch, on in gemms_switches(fmt).items():
            setattr(gemms, switch, on)
        for opt in fmt.split("+")[1:]:
            if opt.removeprefix("no-") == "gemv16":
                from models.linear import GEMV16_ENV

                os.environ[GEMV16_ENV] = "0" if opt.startswith("no-") else "1"
        Path(out).write_text(json.dumps(engine_rows(Path(path), fmt, args)))
        return {}
    deadline = time.monotonic() + args.time_budget
    result = dict(benchmark="quant", shape=args.shape, **gpu_run_info("benchmarks.quant.bench_quant", argv), formats=args.formats,
                  goals=GOALS, rows=[], tuned={}, engine_gemv="tuned" if args.install_tuned else "defaults")

    def save():
        result["summary"] = summarize(result["rows"])
        write_result(result, args.out_dir, "quant")

    if "gemm" in args.steps:
        result["rows"] += gemm_rows(args.shape, args.gemm_m)
        save()
    if "sweep" in args.steps:
        rows = sweep_rows(args.shape, tuple(args.sweep_kinds))
        result["rows"] += rows
        result["tuned"] = best_configs(rows)
        print("tuned:", result["tuned"], flush=True)
        save()
    gc.collect()
    torch.cuda.empty_cache()
    if "engine" in args.steps:
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            from benchmarks.quant.quant_checkpoint import quantize_checkpoint

            t0 = time.perf_counter()
            bf16 = make_random_llama(Path(tmp) / "bf16", args.shape, device="cuda")
            print(f"bf16 checkpoint written in {time.perf_counter() - t0:.0f} s", flush=True)
            for fmt in args.formats:
                left = deadline - time.monotonic()
                if left < 60:
                    result["rows"].append(dict(step="engine", impl=fmt, format=fmt, error="skipped: time budget"))
                    continue
                path = bf16
                if base_format(fmt) != "bf16":
                    t0 = time.perf_counter()
                    path = Path(tmp) / fmt
                    quantize_checkpoint(bf16, path, base_format(fmt), device="cuda", dequantized=False)
                    torch.cuda.empty_cache()
                    print(f"{fmt} checkpoint written in {time.perf_counter() - t0:.0f} s", flush=True)
                tuned = result["tuned"] if args.install_tuned else {}
                result["rows"] += run_child(fmt, path, args, tuned, deadline - time.monotonic() - 5)
                if path != bf16:
                    for f in path.glob("*.safetensors"):
                        f.unlink()  # the disk holds the 16-bit checkpoint and one quantized copy at a time
                save()
    save()
    print(json.dumps(result["summary"]))
    print(table(result))
    return result


if __name__ == "__main__":
    main()
