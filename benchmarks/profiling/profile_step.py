"""Where a decode step's time goes, at a model's shape and tensor-parallel size: the served step
interval, the step's device time through its CUDA graph and eagerly, and each mode's kernels by
name and by category (benchmarks/profiling/kernel_categories.py), from rank 0's process.

    python -m benchmarks.profiling.profile_step --shape llama-3.1-8b --batch 1 256          # one GPU
    python -m benchmarks.profiling.profile_step --tensor-parallel-size 2 --batch 1          # two GPUs
    python -m benchmarks.profiling.profile_step --tensor-parallel-size 2 --disable-custom-all-reduce  # NCCL's
    python -m benchmarks.profiling.profile_step --shape tiny-llama --device cpu --context 32  # CPU smoke

An offline LLMEngine as served (CUDA graphs, asynchronous scheduling) holds the model: a Llama
shape of benchmarks/shared/checkpoint.py with --load-format dummy (config.json alone, random bf16
weights made on the GPUs), GPT-2 small from a random checkpoint (fp16), or tiny-llama (two small
layers: the CPU path the tests run). At each --batch B, B requests of --context random prompt ids
are prefilled, then:

1. `step_ms`: the wall time of one `LLMEngine.step()` over --served-steps steps of the B decodes,
   what a client sees between tokens (at B = 1 the TPOT bench_tp measures);
2. per mode, `graph` (the decode graph replayed, as served; CUDA only) and `eager` (the same step
   without graphs: the graph's kernels are the eager step's, launched one by one): one decode step
   of the B sequences (the same positions each time) launched --reps times, each launch behind a
   spin of the device (three times the launch's host time, at least 5 ms) so that the host has
   enqueued all of it before it starts (the other ranks too, whose messages come first): `device_ms`
   (CUDA events around the launch: the step on the device alone, the inputs' upload and the ids'
   copy back included; the median), `host_ms` (the host's time in `ModelRunner.launch`, the other
   ranks' messages included), then --steps launches likewise under torch.profiler: the kernels'
   summed time (`kernel_ms`), the time some kernel ran (`busy_ms`), `gap_ms` = device_ms - busy_ms
   (the device idle inside the step: launch latency, waits), the kernels by category with their
   share, and every kernel by name (its time and count per step).

So step_ms - graph device_ms is what the host (scheduling, packing, the launch, and under tensor
parallelism the other ranks' start) adds to the step as served; graph gap_ms the device idle
between the graph's kernels; the categories where the kernels' time goes.

Under --tensor-parallel-size N the profile is rank 0's (the engine's process; the other ranks run
the same kernels). Behind the spin every rank has its step enqueued before rank 0 starts, so an
all-reduce's time is its own plus what the other rank's kernels before it took longer than this
one's. The all-reduces are the one-shot over symmetric memory (the default) or, with
--disable-custom-all-reduce, NCCL's. On the CPU (--device cpu) the graph mode is absent, the "kernels"
are operators by self time and the times are wall times.

Writes <out-dir>/profile_step_<shape>_tp<N>[_nccl][_fp8][_pdl]_<gpu>.json: {device, torch, triton, date,
command, shape, dtype, tensor_parallel_size, disable_custom_all_reduce, context, rows: [{batch,
step_ms, graph, eager}]}, each mode {device_ms, host_ms, kernel_ms, busy_ms, gap_ms, spin_ms,
kernels_per_step, categories: {category: {us, count, share}}, kernels: [{name, category, us,
count}]} (graph None on the CPU), rewritten after each batch. A profile is an experiment: the
default --out-dir is benchmarks/results/experiments/, which make_report does not read; `report`
renders a file (printed at the end).
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.profiling.kernel_categories import CATEGORIES, breakdown
from benchmarks.shared.checkpoint import LLAMA_SHAPES, make_config_only_llama, make_random_gpt2
from benchmarks.shared.common import gpu_run_info, write_result

# The CPU path's shape: the Llama-3.1-8B shape's kind of model (GQA, llama3 rope) in two small layers
TINY = dict(LLAMA_SHAPES["llama-3.1-8b"], num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=512)
SHAPES = ["gpt2-small", "tiny-llama", *sorted(LLAMA_SHAPES)]


def checkpoint(shape: str, root: Path) -> tuple[Path, str, str, int]:
    """(its directory, load format, 16-bit dtype, vocabulary size) of a shape."""
    if shape == "gpt2-small":
        return make_random_gpt2(root / shape, "small"), "auto", "float16", 50257
    fields = TINY if shape == "tiny-llama" else LLAMA_SHAPES[shape]
    return make_config_only_llama(root / shape, fields), "dummy", "bfloat16", fields["vocab_size"]


def prefilled(engine, batch: int, context: int, vocab: int, max_tokens: int, rng: random.Random) -> list[str]:
    """`batch` requests of `context` random ids added and stepped until every one decodes."""
    from server.sampling_params import SamplingParams

    ids = [f"b{batch}-{i}-{rng.random()}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(vocab) for _ in range(context)],
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while any(engine.seqs[r].num_computed < context for r in ids):
        engine.step()
    return ids


def served_step_ms(engine, steps: int) -> float:
    """Wall milliseconds of one LLMEngine.step() over `steps` (after a few unmeasured)."""
    for _ in range(3):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1e3


def spin_cycles(ms: float) -> int:
    """Cycles of torch.cuda._sleep that keep the device busy for about `ms` milliseconds."""
    torch.cuda._sleep(1 << 10)  # (its first launch loads the kernel: not timed)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1 << 20)
    end.record()
    end.synchronize()
    return int((1 << 20) / start.elapsed_time(end) * ms)


def launch(runner, batch, spin: int) -> tuple[float, float]:
    """(device ms, host ms) of one launch of `batch`, collected. On CUDA the launch waits behind
    `spin` cycles of the device, longer than the host takes to enqueue it (and to send the other
    ranks theirs), so that the events around it time the step alone; on the CPU the device time is
    the launch's and collect's wall time."""
    if spin:
        torch.cuda._sleep(spin)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    handle = runner.launch(batch.prefills, batch.decodes)
    host_ms = (time.perf_counter() - t0) * 1e3
    if spin:
        end.record()
    runner.collect(handle)
    return (start.elapsed_time(end) if spin else (time.perf_counter() - t0) * 1e3), host_ms


def profiled(runner, batch, steps: int, spin: int) -> list[tuple[float, str, float]]:
    """(start us, name, us) of every kernel (CUDA) or operator by self time (CPU) of `steps`
    launches, each behind its spin as `launch` times it (the spin itself left out)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if spin else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            launch(runner, batch, spin)
    # (record_function ranges, e.g. NCCL's or gloo's around their kernels, are not kernels of their own)
    if spin:
        return [(e.time_range.start, e.name, e.time_range.elapsed_us()) for e in prof.events()
                if e.device_type == DeviceType.CUDA and not e.is_user_annotation and "spin_kernel" not in e.name]
    return [(e.time_range.start, e.name, e.self_cpu_time_total) for e in prof.events()
            if e.device_type == DeviceType.CPU and not (e.is_async or e.is_user_annotation)]


def measure_mode(runner, batch, args, on_cuda: bool) -> dict:
    """One mode's times and kernels (the runner's graphs as they are set: see profile_batch)."""
    # compiles (an eager step of a new size), allocator, caches; the spin: 3x the host's launch
    spin_ms = max(5.0, 3 * min(launch(runner, batch, 0)[1] for _ in range(3)))
    spin = spin_cycles(spin_ms) if on_cuda else 0
    times = [launch(runner, batch, spin) for _ in range(args.reps)]
    device_ms, host_ms = (statistics.median(t) for t in zip(*times))
    if on_cuda and max(t[1] for t in times) > spin_ms:  # then that launch's device time has idle time in it
        print(f"  a launch took the host {max(t[1] for t in times):.1f} ms, longer than the spin ({spin_ms:.1f} ms)")
    kernels = breakdown(profiled(runner, batch, args.steps, spin), args.steps)
    return {"device_ms": round(device_ms, 4), "host_ms": round(host_ms, 4), **kernels,
            "gap_ms": round(device_ms - kernels["busy_ms"], 4), "spin_ms": round(spin_ms, 2) if on_cuda else None}


def tokens_needed(args) -> int:
    """Tokens a request may generate here: the served steps, those it decodes while later prompts
    of its batch are prefilled (chunks of at least 2048 ids a step), and some to spare."""
    return args.served_steps + 32 + max(args.batch) * args.context // 2048


def profile_batch(engine, b: int, args, vocab: int, rng: random.Random) -> dict:
    runner, on_cuda = engine.runner, engine.device.type == "cuda"
    ids = prefilled(engine, b, args.context, vocab, tokens_needed(args), rng)
    try:
        row = {"batch": b, "step_ms": round(served_step_ms(engine, args.served_steps), 4)}
        # One more step of the same decodes, launched by hand from here on (the engine's own step in
        # flight stays so; the requests are aborted after)
        batch = engine.scheduler.schedule()
        if batch.prefills or len(batch.decodes) != b:
            raise RuntimeError(f"expected {b} decodes, scheduled {len(batch.decodes)} and "
                               f"{len(batch.prefills)} prefills")
        graphs = runner.graphs
        row["graph"] = measure_mode(runner, batch, args, on_cuda) if graphs is not None else None
        runner.graphs = None  # ModelRunner.launch runs a step eagerly where there are no decode graphs
        try:
            row["eager"] = measure_mode(runner, batch, args, on_cuda)
        finally:
            runner.graphs = graphs
    finally:
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished():
            engine.step()
    return row


def _mode_line(name: str, m: dict | None) -> str:
    if m is None:
        return f"| {name} | - | - | - | - | - | - |"
    return (f"| {name} | {m['device_ms']:.3f} | {m['kernel_ms']:.3f} | {m['busy_ms']:.3f} | {m['gap_ms']:.3f} "
            f"| {m['host_ms']:.3f} | {m['kernels_per_step']:.0f} |")


def report(result: dict, top: int = 15) -> str:
    """A profile file as markdown: per batch, each mode's times, the categories side by side, and
    the top kernels (the graph's where the profiler saw them, else the eager step's)."""
    custom = "" if result["tensor_parallel_size"] == 1 else (
        ", NCCL all-reduces" if result["disable_custom_all_reduce"] else ", custom all-reduce")
    quant = (f", {result['quantization']} weights" if result.get("quantization") else "") + (
        ", PDL" if result.get("enable_pdl") else "")
    lines = [f"{result['shape']} at TP={result['tensor_parallel_size']}{custom}, context {result['context']}, "
             f"{result['dtype']}{quant}, rank 0's profile ({result['device']})"]
    for row in result["rows"]:
        modes = [(name, row[name]) for name in ("graph", "eager") if row.get(name) is not None]
        lines += ["", f"Batch {row['batch']}: served step {row['step_ms']:.3f} ms", "",
                  "| mode | device ms | kernel ms | busy ms | gap ms | host launch ms | kernels |",
                  "|---|---|---|---|---|---|---|"]
        lines += [_mode_line(name, row.get(name)) for name in ("graph", "eager")]
        lines += ["", "| category | " + " | ".join(f"{name} us | share" for name, _ in modes) + " |",
                  "|---|" + "---|---|" * len(modes)]
        for cat in CATEGORIES:
            cells = [m["categories"].get(cat) for _, m in modes]
            if any(cells):
                lines.append(f"| {cat} | " + " | ".join(f"{c['us']:.1f} | {c['share']:.1%}" if c else "- | -"
                                                        for c in cells) + " |")
        name, m = next(((n, m) for n, m in modes if m["kernels"]), (None, None))
        if m is not None:
            lines += ["", f"Top kernels ({name}):", "", "| us | count | category | kernel |", "|---|---|---|---|"]
            lines += [f"| {k['us']:.1f} | {k['count']:g} | {k['category']} | `{k['name'][:110]}` |"
                      for k in m["kernels"][:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b", choices=SHAPES)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--disable-custom-all-reduce", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine's setting (default: server/config.py's, NCCL)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    p.add_argument("--context", type=int, default=512, help="prompt ids of each request (the decode's context)")
    p.add_argument("--served-steps", type=int, default=50, help="engine steps timed for step_ms")
    p.add_argument("--reps", type=int, default=20, help="launches timed per mode (device_ms, host_ms)")
    p.add_argument("--steps", type=int, default=20, help="launches profiled per mode")
    p.add_argument("--top", type=int, default=15, help="kernels the printed report lists per batch")
    p.add_argument("--dtype", default=None, help="default: the shape's 16-bit dtype on CUDA, float32 on the CPU")
    p.add_argument("--enable-pdl", action="store_true", help="programmatic dependent launch (kernels/pdl.py)")
    p.add_argument("--quantization", "-q", default=None, choices=["fp8"],
                   help="fp8: the dummy weights quantized at load (per channel, FP8 activations per token: "
                        "FP8_DYNAMIC's step)")
    p.add_argument("--device", default="cuda", help="cuda (cuda:0..N-1), or cpu")
    p.add_argument("--out-dir", default="benchmarks/results/experiments")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="profile-step-") as tmp:  # (the engine has read it when it starts)
        result = run(args, argv, Path(tmp))
    print(report(result, args.top))
    return result


def run(args, argv: list[str] | None, root: Path) -> dict:
    """Every --batch profiled with one engine (its checkpoint made under `root`); the file written."""
    from server.config import EngineConfig
    from server.engine import LLMEngine

    path, load_format, dtype, vocab = checkpoint(args.shape, root)
    dtype = args.dtype or (dtype if args.device.startswith("cuda") else "float32")
    custom = args.disable_custom_all_reduce
    setting = {} if custom is None else {"disable_custom_all_reduce": custom}
    config = EngineConfig(model=str(path), load_format=load_format, dtype=dtype, device=args.device,
                          tensor_parallel_size=args.tensor_parallel_size, max_num_seqs=max(256, *args.batch),
                          quantization=args.quantization, enable_pdl=args.enable_pdl,
                          max_model_len=args.context + tokens_needed(args) + 16, **setting)
    result = {**gpu_run_info("benchmarks.profiling.profile_step", argv, args.device), "shape": args.shape,
              "dtype": dtype, "tensor_parallel_size": config.tensor_parallel_size,
              "disable_custom_all_reduce": config.disable_custom_all_reduce, "context": args.context,
              "quantization": args.quantization, "enable_pdl": args.enable_pdl, "rows": []}
    prefix = f"profile_step_{args.shape}_tp{config.tensor_parallel_size}" + (
        "_nccl" if config.tensor_parallel_size > 1 and config.disable_custom_all_reduce else "") + (
        f"_{args.quantization}" if args.quantization else "") + ("_pdl" if args.enable_pdl else "")
    engine = LLMEngine(config)
    rng = random.Random(0)
    try:
        for b in args.batch:
            row = profile_batch(engine, b, args, vocab, rng)
            result["rows"].append(row)
            out = write_result(result, args.out_dir, prefix)
            print(f"batch {b}: step {row['step_ms']:.3f} ms"
                  + "".join(f", {name} {m['device_ms']:.3f} ms on the device ({m['kernel_ms']:.3f} in kernels)"
                            for name in ("graph", "eager") if (m := row[name]) is not None), flush=True)
    finally:
        engine.close()
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (`timeout`: main's finally stops the ranks)
    main()
