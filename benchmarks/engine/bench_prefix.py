"""Prefix caching and chunked prefill, measured through the engine's Python API on the GPU.

shared prefix: one request warms the cache with a long shared prefix (a system prompt), then a
  burst of requests = that prefix + a short unique suffix arrives at once. Time to first token
  and output throughput with prefix caching on vs off.
long prompts: running requests decode while long prompts keep arriving. Inter-token latency of
  the running requests with chunked prefill (a step carries the decodes plus at most
  --chunk-budget prompt tokens) vs unchunked (whole prompts in one step).

  python -m benchmarks.engine.bench_prefix --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.shared.checkpoint import make_random_gpt2  # noqa: E402
from benchmarks.shared.common import gpu_run_info, write_result  # noqa: E402
from server.config import EngineConfig  # noqa: E402
from server.engine import LLMEngine  # noqa: E402
from server.sampling_params import SamplingParams  # noqa: E402

VOCAB = 50257


def _pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if len(xs) else float("nan")


def drive(engine: LLMEngine, arrivals: list[tuple[int, str, list[int], int]]):
    """Run the engine; arrivals are (step index to add at, id, prompt, max_tokens). Returns per
    request: submit time, token times."""
    times: dict[str, list[float]] = {}
    submit: dict[str, float] = {}
    pending = sorted(arrivals)
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, n = pending.pop(0)
            engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            submit[rid] = time.perf_counter()
            times[rid] = []
        for out in engine.step():
            times[out.request_id].append(time.perf_counter())
        step += 1
    return submit, times


def shared_prefix(path, caching: bool, n: int, prefix_len: int, suffix_len: int, out_len: int) -> dict:
    rng = random.Random(0)
    prefix = [rng.randrange(VOCAB) for _ in range(prefix_len)]
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float16", enable_prefix_caching=caching))
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))  # compile/warm-up
    drive(engine, [(0, "warm", prefix + [7], 1)])
    burst = [(0, f"r{i}", prefix + [rng.randrange(VOCAB) for _ in range(suffix_len)], out_len) for i in range(n)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    submit, times = drive(engine, burst)
    dt = time.perf_counter() - t0
    ttft = [(times[r][0] - submit[r]) * 1e3 for r in submit]
    hits = engine.block_manager.allocator.stats
    engine.close()
    return dict(scenario="shared_prefix", prefix_caching=caching, requests=n, prefix_len=prefix_len,
                suffix_len=suffix_len, output_len=out_len, ttft_mean_ms=round(float(np.mean(ttft)), 2),
                ttft_p50_ms=round(_pct(ttft, 50), 2), ttft_p99_ms=round(_pct(ttft, 99), 2),
                output_tokens_per_s=round(n * out_len / dt, 1), seconds=round(dt, 3),
                prefix_hit_rate=round(hits.hit_rate, 3))


def long_prompts(path, chunked: bool, budget: int, running: int, arrivals: int, prompt_len: int) -> dict:
    rng = random.Random(1)
    cfg = EngineConfig(model=str(path), dtype="float16", enable_prefix_caching=False, enable_chunked_prefill=chunked,
                       max_num_batched_tokens=budget if chunked else 16384)
    engine = LLMEngine(cfg)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
    plan = [(0, f"run{i}", [rng.randrange(VOCAB) for _ in range(64)], 400) for i in range(running)]
    plan += [(20 + 10 * j, f"long{j}", [rng.randrange(VOCAB) for _ in range(prompt_len)], 8) for j in range(arrivals)]
    submit, times = drive(engine, plan)
    gaps = [b - a for r, ts in times.items() if r.startswith("run") for a, b in zip(ts, ts[1:])]
    gaps_ms = [g * 1e3 for g in gaps]
    ttft_long = [(times[r][0] - submit[r]) * 1e3 for r in times if r.startswith("long")]
    engine.close()
    return dict(scenario="long_prompts", chunked_prefill=chunked, budget=budget if chunked else None,
                running=running, arrivals=arrivals, prompt_len=prompt_len,
                itl_p50_ms=round(_pct(gaps_ms, 50), 3), itl_p99_ms=round(_pct(gaps_ms, 99), 3),
                itl_max_ms=round(max(gaps_ms), 3), long_ttft_p50_ms=round(_pct(ttft_long, 50), 2))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: random-initialised GPT-2 small)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=768)
    ap.add_argument("--chunk-budget", type=int, default=512)
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args(argv)
    path = args.model or make_random_gpt2(tempfile.mkdtemp(prefix="gpt2-small-"), "small")
    rows = []
    for caching in (True, False):
        rows.append(shared_prefix(path, caching, args.requests, args.prefix_len, 32, 64))
        print(rows[-1], flush=True)
    for chunked in (True, False):
        rows.append(long_prompts(path, chunked, args.chunk_budget, 32, 8, 960))
        print(rows[-1], flush=True)
    for r in rows:
        r["impl"] = "flashpage"
    result = dict(gpu_run_info("benchmarks.engine.bench_prefix", argv),
                  model="random-initialised GPT-2 small (124M), float16" if not args.model else args.model, rows=rows)
    write_result(result, args.out_dir, "prefix")
    print(report(result))
    return result


def report(result: dict) -> str:
    sp = [r for r in result["rows"] if r["scenario"] == "shared_prefix"]
    lp = [r for r in result["rows"] if r["scenario"] == "long_prompts"]
    lines = []
    if sp:
        r0 = sp[0]
        lines += [f"{r0['requests']} requests sharing a {r0['prefix_len']}-token prefix (+{r0['suffix_len']} own tokens, "
                  f"{r0['output_len']} out), sent at once after one warm-up request:", "",
                  "| prefix caching | TTFT p50 ms | TTFT p99 ms | output tok/s | block hit rate |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {'on' if r['prefix_caching'] else 'off'} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
                  f"{r['output_tokens_per_s']:,.0f} | {r['prefix_hit_rate']:.2f} |" for r in sp]
    if lp:
        r0 = lp[0]
        lines += ["", f"{r0['running']} requests decoding while {r0['arrivals']} prompts of {r0['prompt_len']} tokens arrive:",
                  "", "| prefill | ITL p50 ms | ITL p99 ms | ITL max ms | long-prompt TTFT p50 ms |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {'chunked, ' + str(r['budget']) + ' tokens/step' if r['chunked_prefill'] else 'unchunked'} | "
                  f"{r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} | {r['itl_max_ms']:.2f} | {r['long_ttft_p50_ms']:.1f} |"
                  for r in lp]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
