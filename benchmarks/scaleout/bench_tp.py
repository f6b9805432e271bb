"""Tensor parallelism over one host's GPUs: batch-1 TPOT at each --tensor-parallel-size against its
floor, the load test's HTTP levels, and offline throughput, for a Llama shape served with
--load-format dummy (random weights made on the GPUs from config.json alone: no weight files).

    python -m benchmarks.scaleout.bench_tp --shape llama-3.1-8b --tp-sizes 1 2 --out-dir /tmp/out           # 2 GPUs
    python -m benchmarks.scaleout.bench_tp --tp-sizes 1 2 --custom-all-reduce off on --out-dir /tmp/out     # both ways
    python -m benchmarks.scaleout.bench_tp --shape llama-3.1-70b --tp-sizes 4 --load-levels 1 16 64 256 \\
        --offline-requests 512 --out-dir /tmp/out                                                  # 4 GPUs

For each size N in turn: a server (`python -m server --load-format dummy --tensor-parallel-size N
--dtype bfloat16 --max-model-len L`, CUDA graphs and asynchronous scheduling on, as served); batch-1
TPOT from --tpot-requests requests sent one at a time (a prompt of --tpot-input-len random ids,
--tpot-output-len tokens with ignore_eos; benchmarks/serving/load_test.py's tpot, (e2e - ttft) / (n - 1),
its median); then each --load-levels concurrency C, closed loop as benchmarks/serving/compare.py runs it
(prompts 512 +- 128 ids, outputs 256 +- 64 tokens, --level-duration s a level); the server stops,
and with --offline-requests > 0 an offline LLMEngine of the same size generates that many requests
of the same shape (benchmarks/engine/bench_throughput.py's workload and timing).

--custom-all-reduce off on: each size N > 1 once with NCCL's all-reduces (--disable-custom-all-reduce)
and once with the one-shot over symmetric memory (--no-disable-custom-all-reduce, the server's
default; models/parallel/symm_all_reduce.py), a row each, naming it (`custom_all_reduce`; None at N = 1).
Before the servers, at each N > 1 on CUDA: the all-reduce alone, NCCL's against the one-shot, at
each of --all-reduce-bytes (benchmarks/scaleout/all_reduce_micro.py: the median of graph replays,
microseconds an all-reduce).

The floor of a decode step at batch 1 is reading one rank's weights once: the model's parameter
bytes (bf16) over N (norms are replicated, and K/V heads would be past N = num_kv_heads, which
these shapes do not reach) over --hbm-tbps (3.0 TB/s: what a GEMV reaches of an H100's 3.35). The
goals of issue 50: Llama-3.1-8B, TPOT at TP=2 <= 0.6 x TP=1's; Llama-3.1-70B at TP=4, TPOT <= 1.3 x
its floor (35.3 GB a rank: 11.8 ms).

Writes <out-dir>/tp_<shape>_<gpu>.json: {device, torch, triton, date, command, shape, hbm_tbps,
all_reduce: [{tp, graph_ops, replays, custom, rows: [{bytes, nccl_us, custom_us, nccl_over_custom}]}
(or {tp, error, rows: []} where it failed)],
rows: [{impl, tp, custom_all_reduce, start_s, tpot_ms, tpot_runs_ms, floor_ms, tpot_over_floor,
load: [load_test rows], offline: {requests, tokens, seconds, tokens_per_s}}], goals: [...]},
rewritten after every row.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.shared.checkpoint import LLAMA_SHAPES, make_config_only_llama  # noqa: E402
from benchmarks.shared.common import ServerProcess, gpu_run_info, write_result  # noqa: E402
from benchmarks.serving.load_test import run_load  # noqa: E402

GOALS = {"llama-3.1-8b": ("speedup", 2, 1, 0.6), "llama-3.1-70b": ("floor", 4, None, 1.3)}


def parameter_bytes(path: Path) -> int:
    """bf16 bytes of the model's parameters (transformers' model on the meta device: nothing allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return 2 * sum(p.numel() for p in model.parameters())


def _tag(tp: int, custom: bool | None) -> str:
    return f"tp{tp}" + {None: "", False: "-nccl", True: "-custom"}[custom]


def serve(path: Path, tp: int, custom: bool | None, args) -> ServerProcess:
    flag = [] if custom is None else ["--no-disable-custom-all-reduce" if custom else "--disable-custom-all-reduce"]
    return ServerProcess.python_server(
        ["--model", str(path), "--load-format", "dummy", "--tensor-parallel-size", str(tp), "--dtype", "bfloat16",
         "--max-model-len", str(args.max_model_len), "--device", args.device, *flag, *args.server_args],
        log_path=Path(args.out_dir) / f"server_{_tag(tp, custom)}.log")


def measure_server(path: Path, tp: int, custom: bool | None, vocab: int, args) -> dict:
    t0 = time.monotonic()
    srv = serve(path, tp, custom, args).wait_healthy(args.start_timeout)
    row = {"tp": tp, "custom_all_reduce": custom, "start_s": round(time.monotonic() - t0, 1)}
    try:
        runs = []
        for i in range(args.tpot_repeats):  # one request at a time: batch 1 throughout
            r = run_load(srv.url, concurrency=1, num_requests=args.tpot_requests, input_len=args.tpot_input_len,
                         output_len=args.tpot_output_len, vocab_size=vocab, warmup=1 if i == 0 else 0, seed=i,
                         progress=False, label=_tag(tp, custom))
            runs.append(r["tpot_p50_ms"])
        row["tpot_runs_ms"] = [round(t, 3) for t in runs]
        row["tpot_ms"] = round(statistics.median(runs), 3)
        row["load"] = []
        for c in args.load_levels:
            level = run_load(srv.url, concurrency=c, num_requests=max(4 * c, 16), duration=args.level_duration,
                             grace=5.0, input_len=args.input_len, input_jitter=args.input_len // 4,
                             output_len=args.output_len, output_jitter=args.output_len // 4, vocab_size=vocab,
                             warmup=min(c, 8), seed=c, progress=False, label=_tag(tp, custom))
            row["load"].append(level)
            print(f"  {_tag(tp, custom)} c={c}: {level['output_tokens_per_s']:.0f} tok/s,"
                  f" ttft p50 {level['ttft_p50_ms']:.1f} ms,"
                  f" tpot p50 {level['tpot_p50_ms']:.2f} ms, errors {level['errors']}", flush=True)
    finally:
        srv.stop()
    return row


def offline(path: Path, tp: int, custom: bool | None, vocab: int, args) -> dict:
    """An offline engine of `tp` ranks in this process (rank 0): --offline-requests of the levels' shape."""
    import torch

    from benchmarks.engine.bench_throughput import workload
    from server.config import EngineConfig
    from server.engine import LLMEngine
    from server.sampling_params import SamplingParams

    setting = {} if custom is None else {"disable_custom_all_reduce": not custom}
    engine = LLMEngine(EngineConfig(model=str(path), load_format="dummy", tensor_parallel_size=tp, dtype="bfloat16",
                                    max_model_len=args.max_model_len, device=args.device, **setting))
    try:
        spread = (args.input_len - args.input_len // 4, args.input_len + args.input_len // 4)
        prompts, outs = workload(args.offline_requests, spread, (args.output_len * 3 // 4, args.output_len * 5 // 4),
                                 vocab, seed=0)
        params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outs]
        engine.generate(prompts[:4], params[:4])  # warm-up
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        sync()
        t0 = time.perf_counter()
        tokens = sum(len(r.token_ids) for r in engine.generate(prompts, params))
        sync()
        seconds = time.perf_counter() - t0
    finally:
        engine.close()
    return {"requests": args.offline_requests, "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1)}


def _all_reduce_name(row: dict) -> str:
    return {None: "", False: " (NCCL all-reduce)", True: " (custom all-reduce)"}[row.get("custom_all_reduce")]


def goals(shape: str, rows: list[dict], device: str = "NVIDIA H100") -> list[dict]:
    """The issue's goal for each row at its size (one per all-reduce setting). The goals are set on
    H100s (the floor's 3.0 TB/s is an H100's): on another device `met` is None, the ratio only shown."""
    kind, tp, base, bound = GOALS.get(shape, (None, None, None, None))
    h100 = _goal_device(device)
    at = [r for r in rows if r["tp"] == tp]
    out = []
    for row in at:
        name = f"TPOT at TP={tp}{_all_reduce_name(row)}"
        if kind == "speedup" and any(r["tp"] == base for r in rows):
            ratio = row["tpot_ms"] / next(r for r in rows if r["tp"] == base)["tpot_ms"]
            out.append({"goal": f"{name} <= {bound} x TP={base}'s", "ratio": round(ratio, 3),
                        "met": ratio <= bound if h100 else None})
        elif kind == "floor":
            ratio = row["tpot_over_floor"]
            out.append({"goal": f"{name} <= {bound} x its floor ({row['floor_ms']} ms)", "ratio": ratio,
                        "met": ratio <= bound if h100 else None})
    return out


def _goal_device(device: str) -> bool:
    """Whether the issue's goals are judged on `device`: the H100s they were set on."""
    return "H100" in device


def _verdict(goal: dict, device: str) -> str:
    """met / not met on an H100; elsewhere (files written before `met` said None there too) neither."""
    if not _goal_device(device) or goal["met"] is None:
        return f"the goal is an H100's; this ran on {device or 'another device'}"
    return "met" if goal["met"] else "not met"


def report(result: dict) -> str:
    """docs/benchmarks.md's section of one tp_*.json (benchmarks/make_report.py)."""
    levels = [row["concurrency"] for row in result["rows"][0].get("load", [])] if result["rows"] else []
    head = ["TP", "all-reduce", "batch-1 TPOT ms", "floor ms", "x floor", "offline tok/s"]
    head += [f"tok/s @{c}" for c in levels]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["rows"]:
        all_reduce = {None: "-", False: "NCCL", True: "custom"}[row.get("custom_all_reduce")]
        cells = [row["tp"], all_reduce, f"{row['tpot_ms']:.2f}", f"{row['floor_ms']:.2f}", f"{row['tpot_over_floor']:.2f}",
                 f"{row['offline']['tokens_per_s']:,.0f}" if "offline" in row else "-"]
        cells += [f"{level['output_tokens_per_s']:,.0f}" for level in row.get("load", [])]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    for g in result.get("goals", []):
        lines.append(f"\nGoal: {g['goal']}: {g['ratio']} ({_verdict(g, result.get('device', ''))}).")
    for micro in result.get("all_reduce", []):
        if "error" in micro:
            lines.append(f"\nOne all-reduce at TP={micro['tp']}: failed ({micro['error']}).")
            continue
        lines += [f"\nOne all-reduce at TP={micro['tp']}, bf16, median of CUDA-graph replays (us):", "",
                  "| bytes | NCCL | custom | NCCL / custom |", "|---|---|---|---|"]
        lines += [f"| {r['bytes']:,} | {r['nccl_us']} | {r.get('custom_us', '-')} | {r.get('nccl_over_custom', '-')} |"
                  for r in micro["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(LLAMA_SHAPES))
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--custom-all-reduce", nargs="+", choices=["off", "on"], default=["on"],
                   help="each size > 1 with NCCL's all-reduces (off), the one-shot over symmetric memory (on), or both (default: on, the server's default)")
    p.add_argument("--all-reduce-bytes", type=int, nargs="*", default=[8 << 10, 32 << 10, 128 << 10, 512 << 10,
                                                                      1 << 20, 2 << 20, 4 << 20],
                   help="message sizes of the all-reduce microbenchmark at each size > 1 on CUDA (none: skip it)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--tpot-requests", type=int, default=4, help="requests per TPOT run, one at a time")
    p.add_argument("--tpot-repeats", type=int, default=3, help="TPOT runs (the median of their medians is reported)")
    p.add_argument("--tpot-input-len", type=int, default=128)
    p.add_argument("--tpot-output-len", type=int, default=256)
    p.add_argument("--load-levels", type=int, nargs="*", default=[], help="concurrency levels of the HTTP load test")
    p.add_argument("--input-len", type=int, default=512, help="the levels' and offline prompts (+- a quarter)")
    p.add_argument("--output-len", type=int, default=256, help="their outputs (+- a quarter)")
    p.add_argument("--level-duration", type=float, default=30.0, help="seconds a load level issues requests")
    p.add_argument("--offline-requests", type=int, default=0, help="0: no offline run")
    p.add_argument("--hbm-tbps", type=float, default=3.0, help="the floor's memory bandwidth, TB/s")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--device", default="cuda", help="cuda (cuda:0..N-1), or cpu for a dry run of the whole path")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more `python -m server` flags (last)")
    p.add_argument("--out-dir", default="benchmarks/results")
    args = p.parse_args(argv)
    # `timeout` sends SIGTERM: exit through the finally blocks, which stop the server (its own
    # session) and with it the ranks that hold the GPUs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    path = make_config_only_llama(Path(tempfile.mkdtemp(prefix="bench-tp-")) / args.shape, args.shape)
    vocab = LLAMA_SHAPES[args.shape]["vocab_size"]
    weights = parameter_bytes(path)
    head = gpu_run_info("benchmarks.scaleout.bench_tp", argv) if args.device.startswith("cuda") else {
        "device": "cpu", "command": "python -m benchmarks.scaleout.bench_tp " + " ".join(argv if argv is not None else sys.argv[1:])}
    result = {**head, "shape": args.shape, "parameter_bytes": weights,
              "hbm_tbps": args.hbm_tbps, "max_model_len": args.max_model_len, "rows": []}
    if args.device.startswith("cuda") and args.all_reduce_bytes:
        from benchmarks.scaleout.all_reduce_micro import describe, measure

        result["all_reduce"] = []
        for tp in sorted({t for t in args.tp_sizes if t > 1}):
            try:
                micro = measure(tp, args.all_reduce_bytes)
            except RuntimeError as e:  # (the servers' rows still run: each falls back or fails on its own)
                micro = {"tp": tp, "error": str(e), "rows": []}
                print(f"  all-reduce tp={tp}: {e}", flush=True)
            result["all_reduce"].append(micro)
            for r in micro["rows"]:
                print("  " + describe(tp, r), flush=True)
    runs = [(tp, None if tp == 1 else custom == "on") for tp in args.tp_sizes
            for custom in (args.custom_all_reduce if tp > 1 else ["off"])]
    for tp, custom in runs:
        print(f"{args.shape} at --tensor-parallel-size {tp}{_all_reduce_name({'custom_all_reduce': custom})}",
              flush=True)
        row = {"impl": "flashpage", **measure_server(path, tp, custom, vocab, args)}
        floor_ms = weights / tp / (args.hbm_tbps * 1e12) * 1e3
        row["floor_ms"], row["tpot_over_floor"] = round(floor_ms, 4), round(row["tpot_ms"] / floor_ms, 3)
        result["rows"].append(row)
        result["goals"] = goals(args.shape, result["rows"], result["device"])
        out = write_result(result, args.out_dir, f"tp_{args.shape}")  # the server's figures survive a time limit
        if args.offline_requests:
            row["offline"] = offline(path, tp, custom, vocab, args)
            out = write_result(result, args.out_dir, f"tp_{args.shape}")
        print(f"  {_tag(tp, custom)}: batch-1 TPOT {row['tpot_ms']:.2f} ms (runs {row['tpot_runs_ms']}),"
              f" floor {row['floor_ms']:.2f} ms"
              f" ({row['tpot_over_floor']:.2f}x), started in {row['start_s']} s"
              + (f", offline {row['offline']['tokens_per_s']:.0f} tok/s" if "offline" in row else ""), flush=True)
    for g in result.get("goals", []):
        print(f"goal: {g['goal']}: {g['ratio']} -> {_verdict(g, result['device'])}")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
