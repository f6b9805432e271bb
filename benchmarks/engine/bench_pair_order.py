"""Does the order inside bench_structured's pairs bias their ratio? The same requests run first and
second in each pair (plain/plain: a ratio of 1 is no bias), then the penalties pair in both orders.
Medians and quartiles of each pair's own ratio (the first run's throughput over the second's), in
one process on the GPU, GPT-2 small random fp16, batch 64, 256 tokens, greedy.

  python -m benchmarks.engine.bench_pair_order --repeats 15 > benchmarks/results/experiments/pair_order_h100.txt
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.engine.bench_structured import PENALTIES, engine_and_prompts, sampling, timed  # noqa: E402
from benchmarks.shared.common import gpu_run_info  # noqa: E402


def order_ratios(first: list[float], second: list[float]) -> dict:
    """Each pair's first/second throughput ratio (times: seconds per run, same tokens), summarized."""
    ratios = [b / a for a, b in zip(first, second)]
    q = statistics.quantiles(ratios, n=4)
    return dict(median=statistics.median(ratios), q1=q[0], q3=q[2], pairs=len(ratios))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        engine, prompts = engine_and_prompts(tmp, args.batch, 128)
        pen = [sampling(0.0, j, max_tokens=args.max_tokens, ignore_eos=True, **PENALTIES) for j in range(args.batch)]
        plain = [sampling(0.0, j, max_tokens=args.max_tokens, ignore_eos=True) for j in range(args.batch)]
        for params in (pen, plain, pen, plain):  # each path's first runs are cold
            engine.generate(prompts, params)
        info = gpu_run_info("benchmarks.engine.bench_pair_order", argv) if torch.cuda.is_available() else {"device": "cpu"}
        print(f"{info['device']}, torch {info.get('torch', torch.__version__)}, triton {info.get('triton', '-')}, "
              f"{info.get('date', '')}; `{info.get('command', '')}`")
        print(f"{args.repeats} pairs each, batch {args.batch}, {args.max_tokens} tokens, greedy; penalties {PENALTIES}; "
              "each pair's first-run throughput over its second's")
        print(f"{'pair (first/second)':22} {'median':>7} {'q1':>7} {'q3':>7}")
        for name, a, b in (("plain/plain", plain, plain), ("penalties/plain", pen, plain),
                           ("plain/penalties", plain, pen), ("plain/plain", plain, plain)):
            first, second = [], []
            for _ in range(args.repeats):
                first.append(timed(engine, prompts, a)[0])
                second.append(timed(engine, prompts, b)[0])
            r = order_ratios(first, second)
            print(f"{name:22} {r['median']:7.3f} {r['q1']:7.3f} {r['q3']:7.3f}")
        engine.close()


if __name__ == "__main__":
    main()
