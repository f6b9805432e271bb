"""What structured outputs and the penalties cost: offline output throughput of the engine
(Python API, no HTTP) with and without them, at the same output lengths, in one process.

- structured: `--batch` requests constrained by a JSON schema (XGrammar; the masks are filled on
  the host while the device runs the step, then applied after the captured graph) run to the end
  of their grammar; then the same prompts unconstrained with max_tokens set to the lengths the
  constrained run produced (ignore_eos), so both decode exactly as many tokens.
- penalties: presence, frequency and repetition penalties (device-side token counts) against the
  same requests without them, `--max-tokens` each (ignore_eos).
Each pair runs greedy and sampled (temperature 1, seeded), once to warm up (discarded: the first
run of each path is cold), then `--repeats` times alternating; the median throughput of each side
is reported with their ratio, and the median of each pair's own ratio: the device hosts' speed
moves in stretches of seconds that take in both runs of a pair (~0.2 s) but not all the pairs.
The schema is compiled once before the runs and that time reported apart: a server compiles each
distinct schema once.

The checkpoint is GPT-2 small at its real shape with random weights and the embedded model's
8k byte-level BPE (benchmarks/shared/checkpoint.py): XGrammar's token masks are built over that
tokenizer, so a real 50k vocabulary would make each bitmask fill dearer than measured here.

  python -m benchmarks.engine.bench_structured --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.shared.checkpoint import make_random_gpt2  # noqa: E402
from benchmarks.shared.common import gpu_run_info, write_result  # noqa: E402
from server.config import EngineConfig  # noqa: E402
from server.engine import LLMEngine  # noqa: E402
from server.sampling_params import SamplingParams, StructuredOutput  # noqa: E402

# A record of the shape extraction pipelines ask for: nested object, array, enum, bounded numbers.
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "maxLength": 32},
    "role": {"enum": ["admin", "editor", "viewer"]},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
    "score": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["name", "age", "email", "role", "address", "tags", "score"]}
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)


def engine_and_prompts(tmp: str, batch: int, prompt_len: int, checkpoint: str | None = None,
                       device: str | None = None) -> tuple[LLMEngine, list[list[int]]]:
    """The benchmark's engine (`checkpoint`, or random GPT-2 small fp16 written under `tmp`) and
    its `batch` prompts of `prompt_len` random ids (seeded: the same in every run)."""
    path = checkpoint or str(make_random_gpt2(Path(tmp) / "gpt2-small", "small", dtype=torch.float16))
    engine = LLMEngine(EngineConfig(model=path, device=device, max_num_seqs=batch, enable_prefix_caching=False,
                                    log_stats_interval=0))
    rng = random.Random(0)
    vocab = min(engine.spec.vocab_size, len(engine.tokenizer))
    return engine, [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]


def timed(engine: LLMEngine, prompts, params) -> tuple[float, list]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, outs


def sampling(temperature: float, i: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=i if temperature else None, **kw)


def structured_pair(engine, prompts, temperature: float, max_tokens: int) -> dict:
    spec = StructuredOutput("json", json.dumps(SCHEMA, sort_keys=True))
    dt_s, outs = timed(engine, prompts, [sampling(temperature, i, max_tokens=max_tokens, structured=spec)
                                         for i in range(len(prompts))])
    lengths = [len(o.token_ids) for o in outs]
    parsed = 0
    for o in outs:
        try:
            json.loads(o.text)
            parsed += 1
        except ValueError:
            pass
    dt_u, outs_u = timed(engine, prompts, [sampling(temperature, i, max_tokens=n, ignore_eos=True)
                                           for i, n in enumerate(lengths)])
    assert [len(o.token_ids) for o in outs_u] == lengths
    tokens = sum(lengths)
    return dict(tokens=tokens, with_tok_s=tokens / dt_s, without_tok_s=tokens / dt_u, parsed=parsed,
                mean_len=tokens / len(lengths))


def penalty_pair(engine, prompts, temperature: float, max_tokens: int) -> dict:
    dt_p, outs = timed(engine, prompts, [sampling(temperature, i, max_tokens=max_tokens, ignore_eos=True, **PENALTIES)
                                         for i in range(len(prompts))])
    dt_u, _ = timed(engine, prompts, [sampling(temperature, i, max_tokens=max_tokens, ignore_eos=True)
                                      for i in range(len(prompts))])
    tokens = sum(len(o.token_ids) for o in outs)
    return dict(tokens=tokens, with_tok_s=tokens / dt_p, without_tok_s=tokens / dt_u)


def phase_times(engine: LLMEngine, prompts, max_tokens: int, kind: str = "structured_json") -> str:
    """Where a constrained step's time goes: each phase's mean milliseconds per step, timed on the
    host by wrapping the engine's methods (the grammar job runs in the grammar process; runner.collect
    is the engine's thread blocked on the device, which waits for the job's fill)."""
    from collections import defaultdict

    import server.worker.logits as logits_mod
    import server.worker.runner as runner_mod

    spent, calls, longest = defaultdict(float), defaultdict(int), defaultdict(float)

    def timing(fn, label):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                spent[label] += dt
                calls[label] += 1
                longest[label] = max(longest[label], dt)
        return wrapper

    def timed_method(owner, name, label):
        fn = getattr(owner, name)
        setattr(owner, name, timing(fn, label))
        return fn

    runner, grammars = engine.runner, engine.grammars
    saved = [(runner, n, timed_method(runner, n, f"runner.{n}")) for n in ("launch", "collect", "complete")]
    saved += [(engine, n, timed_method(engine, n, f"engine.{n}")) for n in ("step", "_launch", "_finish")]
    saved += [(grammars, n, timed_method(grammars, n, f"grammar process: {n}")) for n in ("job", "check")]
    # inside runner.launch and runner.complete
    saved += [(runner, n, timed_method(runner, n, f"  runner.{n}")) for n in ("_plan", "_sample", "_choose",
                                                                                    "_finish_launch")]
    saved += [(runner_mod, n, timed_method(runner_mod, n, f"  {n}")) for n in ("sample", "argmax_choice")]
    saved += [(logits_mod, n, timed_method(logits_mod, n, f"  {n}")) for n in ("apply_penalties",)]
    saved += [(runner.counts, "add", timed_method(runner.counts, "add", "  TokenCounts.add"))]
    build = logits_mod.StepControls.build
    logits_mod.StepControls.build = staticmethod(timing(build, "StepControls.build"))
    try:
        if kind == "structured_json":
            spec = StructuredOutput("json", json.dumps(SCHEMA, sort_keys=True))
            params = [sampling(0.0, i, max_tokens=max_tokens, structured=spec) for i in range(len(prompts))]
        else:  # "penalties", or "plain" (the same requests without them)
            extra = PENALTIES if kind == "penalties" else {}
            params = [sampling(0.0, i, max_tokens=max_tokens, ignore_eos=True, **extra) for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        logits_mod.StepControls.build = staticmethod(build)
    steps = calls["engine.step"]
    lines = [f"{sum(len(o.token_ids) for o in outs)} tokens, {steps} steps, {wall / steps * 1e3:.3f} ms a step",
             f"{'phase':40} {'calls':>6} {'ms / step':>10} {'longest ms':>10}"]
    lines += [f"{k:40} {calls[k]:6d} {spent[k] / steps * 1e3:10.3f} {longest[k] * 1e3:10.3f}" for k in sorted(spent)]
    return "\n".join(lines)


ROW_GROUPS = ((64, 64), (33, 63), (9, 32), (1, 8))  # decode steps by rows (batch 64: all, then as rows end)


def step_times(engine: LLMEngine, prompts, temperature: float, max_tokens: int) -> list[dict]:
    """One more structured pair, each step timed on the device (CUDA events recorded as each step
    is launched): the two sides' steps summed by how many rows decoded in them, so that the table
    says where the constrained run's extra time goes (the prompts' step; the steps of all 64 rows;
    the steps in which rows end)."""
    runner, launch, marks = engine.runner, engine.runner.launch, []

    def timed_launch(prefills, decodes):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((event, len(decodes), len(prefills)))
        return launch(prefills, decodes)

    def group(n: int, prefills: int) -> str:
        return "prompts" if prefills else next(f"{lo}-{hi}" if lo < hi else f"{lo}" for lo, hi in ROW_GROUPS
                                               if lo <= n <= hi)

    def run(params) -> dict:
        marks.clear()
        outs = engine.generate(prompts, params)
        torch.cuda.synchronize()
        sums: dict = {}
        for (a, n, p), (b, _, _) in zip(marks, marks[1:]):  # the last launch has no successor
            steps, us = sums.get(group(n, p), (0, 0.0))
            sums[group(n, p)] = (steps + 1, us + a.elapsed_time(b) * 1e3)
        return {"lengths": [len(o.token_ids) for o in outs], "sums": sums}

    spec = StructuredOutput("json", json.dumps(SCHEMA, sort_keys=True))
    runner.launch = timed_launch
    try:
        w = run([sampling(temperature, i, max_tokens=max_tokens, structured=spec) for i in range(len(prompts))])
        wo = run([sampling(temperature, i, max_tokens=n, ignore_eos=True) for i, n in enumerate(w["lengths"])])
    finally:
        runner.launch = launch
    rows = []
    for name in ["prompts"] + [f"{lo}-{hi}" if lo < hi else f"{lo}" for lo, hi in ROW_GROUPS]:
        (n, a), (m, b) = w["sums"].get(name, (0, 0.0)), wo["sums"].get(name, (0, 0.0))
        rows.append(dict(rows=name, steps_with=n, steps_without=m, with_us=round(a), without_us=round(b)))
    return rows


def split_timeline(marks: list[tuple[float, int, int]], t0: float, t1: float) -> dict:
    """Where one run's wall time went, on the host's clock: `marks` are (time, decodes, prefills)
    at each launch, t0/t1 the run's start and end. pre_ms: start to the first launch; first_ms:
    the first step (the prompts'), launch to launch; full_us: the median of the steps of every row
    (the most decodes); tail_ms: the decode steps with fewer; post_ms: the last launch to the end."""
    gaps = [(b[0] - a[0], a[1], a[2]) for a, b in zip(marks, marks[1:])]
    most = max(n for _, n, _ in gaps)
    full = [g for g, n, p in gaps if n == most and not p]
    return dict(wall_ms=(t1 - t0) * 1e3, pre_ms=(marks[0][0] - t0) * 1e3, first_ms=gaps[0][0] * 1e3,
                full_us=statistics.median(full) * 1e6, full_steps=len(full),
                tail_ms=sum(g for g, n, p in gaps if n < most and not p) * 1e3, post_ms=(t1 - marks[-1][0]) * 1e3,
                steps=len(marks))


def timelines(engine: LLMEngine, prompts, max_tokens: int, repeats: int) -> str:
    """`repeats` structured runs and their unconstrained twins (same lengths), greedy and seeded
    temperature 1, split by split_timeline, with the messages the engine's thread sent the grammar
    process and its time in them: the costs outside the steps (admission, the tail) beside the
    steps' own."""
    runner, launch, conn = engine.runner, engine.runner.launch, engine.grammars.conn
    marks, sends = [], [0, 0.0]
    send = conn.send

    def timed_send(msg):
        t = time.perf_counter()
        send(msg)
        sends[0] += 1
        sends[1] += time.perf_counter() - t

    def run(params) -> tuple[dict, list[int]]:
        marks.clear()
        sends[:] = [0, 0.0]
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        return dict(split_timeline(marks, t0, t1), sends=sends[0], send_ms=sends[1] * 1e3), [len(o.token_ids) for o in outs]

    spec = StructuredOutput("json", json.dumps(SCHEMA, sort_keys=True))
    runner.launch = lambda p, d: (marks.append((time.perf_counter(), len(d), len(p))), launch(p, d))[1]
    conn.send = timed_send
    keys = ["wall_ms", "pre_ms", "first_ms", "full_us", "full_steps", "tail_ms", "post_ms", "steps", "sends", "send_ms"]
    lines = [f"{'t':>3} {'side':5} " + " ".join(f"{k:>10}" for k in keys)]
    try:
        for temperature in (0.0, 1.0):
            for i in range(repeats + 1):  # the first pair is discarded (each path's first run is cold)
                w, lengths = run([sampling(temperature, j, max_tokens=max_tokens, structured=spec)
                                  for j in range(len(prompts))])
                wo, _ = run([sampling(temperature, j, max_tokens=n, ignore_eos=True) for j, n in enumerate(lengths)])
                for side, d in (("with", w), ("w/o", wo)) if i else ():
                    lines.append(f"{temperature:3.0f} {side:5} " + " ".join(f"{d[k]:10.2f}" for k in keys))
    finally:
        runner.launch, conn.send = launch, send
    return "\n".join(lines)


def paired_ratio(runs: list[dict]) -> float:
    """The median of each pair's with/without ratio (see the module docstring)."""
    return statistics.median(r["with_tok_s"] / r["without_tok_s"] for r in runs)


def summary(runs: list[dict]) -> dict:
    w = statistics.median(r["with_tok_s"] for r in runs)
    wo = statistics.median(r["without_tok_s"] for r in runs)
    out = dict(with_tok_s=round(w, 1), without_tok_s=round(wo, 1), ratio=round(w / wo, 4),
               paired_ratio=round(paired_ratio(runs), 4), tokens=runs[0]["tokens"], runs=runs)
    if "parsed" in runs[0]:
        out.update(parsed=min(r["parsed"] for r in runs), mean_len=round(runs[0]["mean_len"], 1))
    return out


def report(result: dict) -> str:
    """docs/benchmarks.md's table (benchmarks/make_report.py)."""
    lines = [f"Batch {result['rows'][0]['batch']}, prompts of {result['prompt_len']} random ids, {result['model']}; "
             f"median of {result['repeats']} alternating runs per side (paired: the median of each pair's own "
             "ratio), after one discarded pair (the first run of each "
             f"path is cold; the schema compiled before them, once: {result.get('schema_compile_ms', '?')} ms). Structured: a JSON schema of 7 fields "
             "(nested object, array, enum, bounded numbers, a pattern) to the grammar's end, against unconstrained "
             f"decoding of the same lengths; penalties: {', '.join(f'{k} {v}' for k, v in result['penalties'].items())}, "
             f"{result['max_tokens']} tokens each.", "",
             "| what | sampling | with (tok/s) | without (tok/s) | with / without | paired | outputs that parse |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        parsed = f"{r['parsed']}/{r['batch']}" if "parsed" in r else ""
        lines.append(f"| {r['kind'].replace('_', ' ')} | {'greedy' if not r['temperature'] else 'temperature 1'} | "
                     f"{r['with_tok_s']:,.0f} | {r['without_tok_s']:,.0f} | {r['ratio']:.2f} | "
                     f"{paired_ratio(r['runs']):.2f} | {parsed} |")
    timed = [r for r in result["rows"] if "steps" in r]
    if timed:
        lines += ["", "Where the structured runs' extra time goes: one more pair, each step timed on the device "
                  "(from its launch to the next), summed by the rows that decoded in it (64 until the first output "
                  "ends; the prompts' step first).", "",
                  "| sampling | rows in the step | steps | with (ms) | without (ms) | with, per step (us) | "
                  "without, per step (us) |", "|---|---|---:|---:|---:|---:|---:|"]
        for r in timed:
            for s in r["steps"]:
                per = lambda us, n: f"{us / n:,.0f}" if n else "-"  # noqa: E731
                lines.append(f"| {'greedy' if not r['temperature'] else 'temperature 1'} | {s['rows']} | "
                             f"{s['steps_with']} | {s['with_us'] / 1e3:.2f} | {s['without_us'] / 1e3:.2f} | "
                             f"{per(s['with_us'], s['steps_with'])} | {per(s['without_us'], s['steps_without'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--checkpoint", help="a checkpoint directory (default: random GPT-2 small, fp16)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--profile", choices=["structured_json", "penalties"],
                    help="only profile one greedy run of that pair on the host (cProfile, by own time)")
    ap.add_argument("--phases", choices=["structured_json", "penalties", "plain"],
                    help="only time one greedy run's step phases on the host (see phase_times)")
    ap.add_argument("--timeline", type=int, metavar="N",
                    help="only split N structured runs and their twins by phase on the host (see timelines)")
    ap.add_argument("--kinds", nargs="+", choices=["structured_json", "penalties"],
                    default=["structured_json", "penalties"], help="which pairs to run")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        engine, prompts = engine_and_prompts(tmp, args.batch, args.prompt_len, args.checkpoint, args.device)
        engine.generate(prompts[:4], [SamplingParams(max_tokens=8, structured=StructuredOutput("json_object"),
                                                     **PENALTIES)] * 4)  # warm-up: compile, first matchers
        # The schema compiles once per process (cached after): timed here (in this process, as an
        # API process compiles it), outside the runs, which measure decoding as a server does once
        # it has seen the schema (the warm-up pair compiles it in the engine's grammar process).
        from server.engine.grammar import Grammars

        grammars = Grammars(engine.tokenizer, engine.spec.vocab_size, engine.eos_token_ids)
        t0 = time.perf_counter()
        grammars.compile(StructuredOutput("json", json.dumps(SCHEMA, sort_keys=True)))
        compile_ms = (time.perf_counter() - t0) * 1e3
        if args.phases:
            for _ in range(2):  # the first run compiles what it first meets
                text = phase_times(engine, prompts, args.max_tokens, args.phases)
            print(text)
            return {}
        if args.timeline:
            print(timelines(engine, prompts, args.max_tokens, args.timeline))
            return {}
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            pair = structured_pair if args.profile == "structured_json" else penalty_pair
            prof.runcall(pair, engine, prompts, 0.0, args.max_tokens)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            return {}
        rows = []
        for kind, pair in (("structured_json", structured_pair), ("penalties", penalty_pair)):
            if kind not in args.kinds:
                continue
            for temperature in (0.0, 1.0):
                pair(engine, prompts, temperature, args.max_tokens)  # warm-up: each path's first run is cold
                runs = [pair(engine, prompts, temperature, args.max_tokens) for _ in range(args.repeats)]
                rows.append(dict(impl="flashpage", kind=kind, temperature=temperature, batch=args.batch,
                                 **summary(runs)))
                if kind == "structured_json" and torch.cuda.is_available():
                    rows[-1]["steps"] = step_times(engine, prompts, temperature, args.max_tokens)
    on_gpu = torch.cuda.is_available() and (args.device or "cuda").startswith("cuda")
    head = gpu_run_info("benchmarks.engine.bench_structured", argv) if on_gpu else dict(device="cpu", date=time.strftime("%Y-%m-%d"))
    result = dict(**head, model="gpt2-small (random weights, fp16, embedded tokenizer)" if not args.checkpoint
                  else args.checkpoint, schema=SCHEMA, penalties=PENALTIES, prompt_len=args.prompt_len,
                  max_tokens=args.max_tokens, repeats=args.repeats, schema_compile_ms=round(compile_ms, 1), rows=rows)
    print(f"{'kind':16} {'temp':>4} {'with tok/s':>11} {'without':>11} {'ratio':>6} {'paired':>6}")
    for r in rows:
        print(f"{r['kind']:16} {r['temperature']:4.1f} {r['with_tok_s']:11.1f} {r['without_tok_s']:11.1f} "
              f"{r['ratio']:6.3f} {r['paired_ratio']:6.3f}"
              + (f"  parsed {r['parsed']}/{r['batch']}, mean {r['mean_len']} tokens" if "parsed" in r else ""))
    if args.out_dir:
        print("wrote", write_result(result, args.out_dir, "structured"))
    return result


if __name__ == "__main__":
    main()
