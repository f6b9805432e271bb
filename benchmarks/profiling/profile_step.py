"""Where a decode step's device time goes: per-kernel GPU time of one decode step of GPT-2 small
(random weights, fp16), from torch.profiler over eager steps (the same kernels the CUDA graph
replays), grouped by kernel name.

  python -m benchmarks.profiling.profile_step --batch 1 --context 512
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.shared.checkpoint import make_random_gpt2  # noqa: E402
from server.config import EngineConfig  # noqa: E402
from server.engine import LLMEngine  # noqa: E402
from server.sampling_params import SamplingParams  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    path = make_random_gpt2(tempfile.mkdtemp(prefix="gpt2-small-"), "small")
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float16", enforce_eager=True, async_scheduling=False))
    rng = random.Random(0)
    for b in args.batch:
        ids = [f"p{b}-{i}" for i in range(b)]
        for rid in ids:
            engine.add_request(rid, [rng.randrange(50257) for _ in range(args.context)],
                               SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        while any(engine.seqs[r].num_computed < args.context for r in ids):
            engine.step()
        batch = engine.scheduler.schedule()
        for _ in range(3):
            engine.runner.collect(engine.runner.launch(batch.prefills, batch.decodes))
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.runner.collect(engine.runner.launch(batch.prefills, batch.decodes))
            torch.cuda.synchronize()
        per_kernel: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per_kernel.setdefault(e.name, []).append(e.device_time)
        total = sum(sum(v) for v in per_kernel.values()) / args.steps
        count = sum(len(v) for v in per_kernel.values()) / args.steps
        print(f"\nbatch {b}, context {args.context}: {total / 1e3:.3f} ms of kernel time per step, {count:.0f} kernels")
        rows = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[: args.top]
        for name, times in rows:
            print(f"  {sum(times) / args.steps:8.1f} us  x{len(times) / args.steps:5.1f}  {name[:100]}")
        for rid in ids:
            engine.abort_request(rid)


if __name__ == "__main__":
    main()
