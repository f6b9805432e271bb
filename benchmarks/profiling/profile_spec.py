"""Where a speculative round's time goes at batch 1 (issue 48): the proposer's round, the target's
verification and the host's work between them, each on the host's clock and, on CUDA, with the
device's busy time inside it.

    python -m benchmarks.profiling.profile_spec --method draft_model       # Llama-3.1-8B, 3.2-1B-shaped draft
    python -m benchmarks.profiling.profile_spec --method draft_model --draft-quantization fp8
    python -m benchmarks.profiling.profile_spec --method ngram
    python -m benchmarks.profiling.profile_spec --target-shape tiny --device cpu    # CPU smoke

One request of --prompt-len random ids decodes --max-tokens greedy tokens, with every step a
verification (the back-off lifted) whose acceptance bench_spec's oracle sets (`--p`; the proposers
run and cost what they cost). The engine's step is cut into phases by timing its parts in place:

- `propose`: the proposer's round (a draft model's catch-up, its k - 1 decode steps and the
  proposals' copy to the host; the n-gram lookup). It ends in a wait for the device, so its wall
  time holds the draft's device time;
- `verify`: from ModelRunner.launch of the verification to the end of its collect (the ids on the
  host): the step's packing, upload, replay and copy back;
- `host`: the rest of a cycle (the engine's settle, outputs, scheduling, the speculator's extend
  before the proposer), when the device has nothing to run.

On CUDA, torch.profiler's kernels give each phase's device busy time (the union of its kernels'
intervals inside the phase's record_function range) and so its idle time, the host's lead before
its first kernel and the tail after its last, and its kernels by category and name. Per
verification (median over the run's cycles for the wall times, means for the kernels): {cycle_ms,
propose_ms, verify_ms, host_ms, <phase>_busy_ms, <phase>_lead_ms, <phase>_tail_ms, phases: {phase:
{busy_ms, lead_ms, tail_ms, kernels, categories, top}}}. Writes
<out-dir>/profile_spec_<method>[_draft-fp8]_<gpu>.json; an experiment (benchmarks/results/
experiments/ by default, which make_report does not read).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.engine.bench_spec import configure, run_clients
from benchmarks.profiling.kernel_categories import breakdown
from benchmarks.profiling.profile_step import TINY
from benchmarks.shared.common import gpu_run_info, write_result


def timed(obj, name: str, phase: str, spans: list) -> None:
    """Replace obj.name by a wrapper that appends (phase, start s, end s) to `spans` and runs it in
    a record_function range named `phase`."""
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        with torch.profiler.record_function(phase):
            out = fn(*args, **kwargs)
        spans.append((phase, t0, time.perf_counter()))
        return out

    setattr(obj, name, wrapper)


def cycles(spans: list) -> list[dict]:
    """Per verification: its proposer round, its launch-to-collect span and the host's time before
    the next proposer round, from the phases' host spans in order (propose, launch, ..., collect)."""
    out, cur = [], None
    for phase, t0, t1 in spans:
        if phase == "propose":
            if cur is not None and "verify_end" in cur:
                cur["next"] = t0
                out.append(cur)
            cur = {"start": t0, "propose": t1 - t0}
        elif phase == "launch" and cur is not None and "verify_start" not in cur:
            cur["verify_start"] = t0
        elif phase == "collect" and cur is not None and "verify_start" in cur:
            cur["verify_end"] = t1
    return [{"cycle_ms": 1e3 * (c["next"] - c["start"]), "propose_ms": 1e3 * c["propose"],
             "verify_ms": 1e3 * (c["verify_end"] - c["verify_start"]),
             "host_ms": 1e3 * ((c["next"] - c["start"]) - c["propose"] - (c["verify_end"] - c["verify_start"]))}
            for c in out]


def busy_in(kernels: list[tuple[float, float]], ranges: list[tuple[float, float]]) -> float:
    """Microseconds some kernel ran inside the ranges (each kernel [start, end) clipped to them)."""
    total = 0.0
    for lo, hi in ranges:
        end = lo
        for s, e in kernels:
            if e <= lo or s >= hi:
                continue
            s, e = max(s, end), min(e, hi)
            if e > s:
                total += e - s
                end = e
    return total


def phase_kernels(kernels: list[tuple[float, str, float]], ranges: list[tuple[float, float]], cycles: int) -> dict:
    """What the device did inside a phase's ranges, per cycle: busy ms (the kernels' union, clipped to
    the ranges), lead ms (from a range's start to its first kernel: the host's work before the
    device starts), tail ms (from its last kernel's end to the range's end: the copy back and the
    host's wait), and the kernels by category and name (kernel_categories.breakdown)."""
    inside, lead, tail = [], 0.0, 0.0
    for lo, hi in ranges:
        mine = [k for k in kernels if lo <= k[0] < hi]
        inside += mine
        if mine:
            lead += mine[0][0] - lo
            tail += max(0.0, hi - max(s + us for s, _, us in mine))
    spans = sorted((s, s + us) for s, _, us in kernels)
    b = breakdown(inside, cycles) if inside else {"categories": {}, "kernels": [], "kernels_per_step": 0}
    return {"busy_ms": round(busy_in(spans, ranges) / cycles / 1e3, 3), "lead_ms": round(lead / cycles / 1e3, 3),
            "tail_ms": round(tail / cycles / 1e3, 3), "kernels": b["kernels_per_step"],
            "categories": b["categories"], "top": b["kernels"][:12]}


def device_phases(prof, cycles: int) -> dict:
    """From a CUDA profile: phase_kernels of the propose and verify ranges."""
    from torch.autograd import DeviceType

    kernels = sorted((e.time_range.start, e.name, e.time_range.elapsed_us()) for e in prof.events()
                     if e.device_type == DeviceType.CUDA and not e.is_user_annotation)
    ranges: dict[str, list] = {"propose": [], "verify": []}
    for e in prof.events():
        if e.device_type == DeviceType.CPU and e.name in ranges:
            ranges[e.name].append((e.time_range.start, e.time_range.end))
    return {name: phase_kernels(kernels, sorted(r), cycles) for name, r in ranges.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="draft_model", choices=["ngram", "draft_model"])
    ap.add_argument("--target-shape", default="llama-3.1-8b", help="a benchmarks/shared/checkpoint.py shape, or tiny")
    ap.add_argument("--draft-shape", default="llama-3.2-1b")
    ap.add_argument("--draft-quantization", default=None, choices=["fp8"])
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--p", type=float, default=0.8, help="the oracle's acceptance of each proposal")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out-dir", default="benchmarks/results/experiments")
    args = ap.parse_args(argv)
    from benchmarks.shared.checkpoint import make_random_llama
    from server.config import EngineConfig, SpeculativeConfig
    from server.engine import LLMEngine
    from server.engine.spec.ngram import NgramProposer

    on_cuda = args.device.startswith("cuda")
    tmp = Path(tempfile.mkdtemp(prefix="profile-spec-"))
    tiny = args.target_shape == "tiny"
    shape = TINY if tiny else args.target_shape
    target = make_random_llama(tmp / "target", shape, device=args.device)
    spec_json = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    if args.method == "draft_model":
        draft = make_random_llama(tmp / "draft", TINY if tiny else args.draft_shape, seed=1, device=args.device)
        spec_json |= {"method": "draft_model", "model": str(draft)}
        if args.draft_quantization:
            spec_json["quantization"] = args.draft_quantization
    spec_config = SpeculativeConfig.parse(json.dumps(spec_json))
    engine = LLMEngine(EngineConfig(model=str(target), speculative_config=spec_config, max_num_seqs=8,
                                    max_model_len=args.prompt_len + args.max_tokens + 64, enable_prefix_caching=False,
                                    log_stats_interval=0, device=args.device))
    spec = engine.speculator
    spec.proposers = {args.method: spec.proposer if args.method != "ngram" else NgramProposer(1, 3)}
    configure(engine, spec, args.method, args.p, 1 << 20)
    vocab = min(engine.spec.vocab_size, len(engine.tokenizer))
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
    run_clients(engine, [prompt], 16)  # warm: the first steps of a process are slow
    configure(engine, spec, args.method, args.p, 1 << 20, seed=1)  # (a new oracle: wrapped below)
    spans: list = []
    timed(spec.proposer, "propose", "propose", spans)
    timed(engine.runner, "launch", "launch", spans)
    timed(engine.runner, "collect", "collect", spans)
    # The "verify" range: from a launch to the end of its collect (the step in flight between them)
    launch, collect, open_range = engine.runner.launch, engine.runner.collect, []

    def launch_verify(*a, **kw):
        rf = torch.profiler.record_function("verify")
        rf.__enter__()
        open_range.append(rf)
        return launch(*a, **kw)

    def collect_verify(*a, **kw):
        try:
            return collect(*a, **kw)
        finally:
            while open_range:
                open_range.pop().__exit__(None, None, None)

    engine.runner.launch, engine.runner.collect = launch_verify, collect_verify
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        run = run_clients(engine, [prompt], args.max_tokens)
    rows = cycles(spans)
    n = len(rows)
    c = spec.counters
    result = dict(gpu_run_info("benchmarks.profiling.profile_spec", argv) if on_cuda else {"device": "cpu"},
                  method=args.method, target=args.target_shape,
                  draft=args.draft_shape if args.method != "ngram" else None,
                  draft_quantization=args.draft_quantization, k=args.num_speculative_tokens, p=args.p,
                  prompt_len=args.prompt_len, max_tokens=args.max_tokens, tpot_ms=round(run["tpot_ms"], 3),
                  verifications=c.drafts,
                  mean_accepted_length=round(1 + c.accepted_tokens / c.drafts, 3) if c.drafts else None,
                  cycles=n)
    for key in ("cycle_ms", "propose_ms", "verify_ms", "host_ms"):
        result[key] = round(statistics.median(r[key] for r in rows), 3) if rows else None
    if on_cuda and n:
        result["phases"] = device_phases(prof, n)
        for phase, d in result["phases"].items():
            result[f"{phase}_busy_ms"], result[f"{phase}_lead_ms"] = d["busy_ms"], d["lead_ms"]
            result[f"{phase}_tail_ms"] = d["tail_ms"]
    engine.close()
    tag = args.method + (f"_draft-{args.draft_quantization}" if args.draft_quantization else "")
    path = write_result(result, args.out_dir, f"profile_spec_{tag}")
    print(f"wrote {path}")
    print(" ".join(f"{k}={v}" for k, v in result.items()
                   if k.endswith("_ms") or k in ("cycles", "mean_accepted_length")))
    for phase, d in result.get("phases", {}).items():
        cats = ", ".join(f"{c} {v['us']:.0f} us" for c, v in d["categories"].items())
        print(f"{phase}: {d['kernels']} kernels a cycle; {cats}")
        for k in d["top"][:6]:
            print(f"  {k['us']:8.1f} us {k['count']:5g}x {k['name'][:90]}")
    return result


if __name__ == "__main__":
    main()
