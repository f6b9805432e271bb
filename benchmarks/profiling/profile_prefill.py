"""Where a long prompt's time to first token goes: one request prefilled in chunks, step by step.
Issue 45's side by side left flashpage behind vLLM on a 32k-token prompt's TTFT; this splits it.

    python -m benchmarks.profiling.profile_prefill [--shape llama-3.1-8b] [--prompt 32768] [--chunk 8192]
    python -m benchmarks.profiling.profile_prefill --shape tiny-llama --device cpu --prompt 64 --chunk 16  # smoke

An offline LLMEngine as served (CUDA graphs, asynchronous scheduling, no prefix caching) holds a
shape of benchmarks/shared/checkpoint.py with --load-format dummy (profile_step.py's checkpoints),
with --chunk as max_num_batched_tokens. One request of --prompt random ids and one output token runs
unmeasured (it compiles), then --reps more give the TTFT (wall, add_request to the first token's
step), then one more under torch.profiler: each engine step's wall time, and over the request the
device's kernels by category and by name (kernel_categories.breakdown) and the device idle inside
it (the request's wall time less the time some kernel ran). Writes profile_prefill_<shape>_<prompt>_<gpu>.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.profiling.kernel_categories import CATEGORIES, breakdown, profiled_events
from benchmarks.profiling.profile_step import SHAPES, checkpoint
from benchmarks.shared.common import gpu_run_info, write_result


def one_request(engine, ids: list[int], step_ms: list[float] | None = None) -> float:
    """Wall ms from adding a request of these ids (one greedy output) to the step that yields it."""
    from server.sampling_params import SamplingParams

    rid = f"r{random.random()}"
    t0 = time.perf_counter()
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while True:
        s0 = time.perf_counter()
        outs = engine.step()
        if step_ms is not None:
            step_ms.append((time.perf_counter() - s0) * 1e3)
        if any(o.request_id == rid and o.finished for o in outs):
            return (time.perf_counter() - t0) * 1e3


def profiled(engine, ids: list[int], on_cuda: bool) -> tuple[float, list[float], list[tuple[float, str, float]]]:
    """(wall ms, each step's wall ms, (start us, name, us) of every kernel, or on the CPU every
    operator by self time) of one request under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    steps: list[float] = []
    with profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU]) as prof:
        wall = one_request(engine, ids, steps)
    return wall, steps, profiled_events(prof, on_cuda)


def report(result: dict, top: int = 20) -> str:
    p = result["profile"]
    lines = [f"{result['shape']}, a {result['prompt']:,}-token prompt in chunks of {result['chunk']:,}, {result['dtype']} "
             f"({result['device']}): TTFT {result['ttft_ms']:.1f} ms (median of {len(result['ttft_runs_ms'])}); "
             f"profiled: {p['wall_ms']:.1f} ms wall, {p['kernel_ms']:.1f} ms in kernels, {p['busy_ms']:.1f} busy, "
             f"{p['wall_ms'] - p['busy_ms']:.1f} idle; steps " + ", ".join(f"{s:.1f}" for s in p["step_ms"]) + " ms",
             "", "| category | ms | share | count |", "|---|---:|---:|---:|"]
    for cat in CATEGORIES:
        if (c := p["categories"].get(cat)) is not None:
            lines.append(f"| {cat} | {c['us'] / 1e3:.2f} | {c['share']:.1%} | {c['count']:g} |")
    lines += ["", "| ms | count | category | kernel |", "|---:|---:|---|---|"]
    lines += [f"| {k['us'] / 1e3:.2f} | {k['count']:g} | {k['category']} | `{k['name'][:110]}` |"
              for k in p["kernels"][:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=SHAPES)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--reps", type=int, default=3, help="timed requests before the profiled one")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out-dir", default="benchmarks/results/experiments")
    args = ap.parse_args(argv)
    from server.config import EngineConfig
    from server.engine import LLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        path, load_format, dtype, vocab = checkpoint(args.shape, Path(tmp))
        dtype = dtype if args.device.startswith("cuda") else "float32"
        engine = LLMEngine(EngineConfig(model=str(path), load_format=load_format, dtype=dtype, device=args.device,
                                        max_model_len=args.prompt + 16, max_num_batched_tokens=args.chunk,
                                        enable_prefix_caching=False))
        try:
            rng = random.Random(0)
            prompt = lambda: [rng.randrange(vocab) for _ in range(args.prompt)]  # noqa: E731
            one_request(engine, prompt())  # compiles
            runs = [one_request(engine, prompt()) for _ in range(args.reps)]
            on_cuda = args.device.startswith("cuda")
            if on_cuda:
                torch.cuda.synchronize()
            wall, steps, events = profiled(engine, prompt(), on_cuda)
        finally:
            engine.close()
    result = {**gpu_run_info("benchmarks.profiling.profile_prefill", argv, args.device), "shape": args.shape,
              "prompt": args.prompt, "chunk": args.chunk, "dtype": dtype, "ttft_runs_ms": runs,
              "ttft_ms": statistics.median(runs),
              "profile": {"wall_ms": wall, "step_ms": steps, **breakdown(events, 1)}}
    result["profile"]["kernels"] = result["profile"]["kernels"][:60]  # (the file keeps the top 60)
    out = write_result(result, args.out_dir, f"profile_prefill_{args.shape}_{args.prompt}")
    print(report(result))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
