"""HTTP load test for `POST /generate` with `"stream": true` (flashpage or anything speaking its API).

    python -m benchmarks.serving.load_test run --url http://127.0.0.1:8000 --concurrency 1 8 32 \\
        --num-requests 64 --duration 60 --input-len 512 --input-jitter 128 \\
        --output-len 256 --output-jitter 64 --vocab-size 50257 --out load.json
    python -m benchmarks.serving.load_test run --url ... --request-rate 2 8 --num-requests 100   # open loop
    python -m benchmarks.serving.load_test plot load.json [other.json ...] --out-prefix load     # PNGs

(`run` may be left out.) From Python: `run_load(url, concurrency=8, num_requests=32, ...)` returns one
result row (a dict); `plot(results, out_prefix)` (benchmarks/serving/load_plots.py) draws it. One client
process's requests are in benchmarks/serving/load_client.py; the metrics are defined and computed in
benchmarks/serving/load_metrics.py (its docstring is appended to --help).

Load
- closed loop (`--concurrency C`): C clients, each sends its next request when the previous one ends.
- open loop (`--request-rate R`): requests arrive as a Poisson process of R per second (exponential
  gaps, seeded), whatever is in flight; `--max-concurrency` optionally caps the requests in flight.
- bounds: `--num-requests N` stops issuing after N requests; `--duration D` stops issuing D s after
  the start and cancels what is still in flight at D + `--grace` s (cancelled requests are counted
  as `cancelled`, not as errors). Give either or both.
- prompts: `prompt_token_ids` of uniform random ids in [0, vocab) (the vocab comes from
  `--vocab-size`, or from the server's `GET /info` or `/health` JSON if either has `vocab_size`),
  with length uniform in [input_len - jitter, input_len + jitter]; or, with `--prompts-file`, text
  prompts from the file's lines or blank-line-separated paragraphs (then the prompt length is
  whatever the server's tokenizer makes of them; it is read back from `usage.prompt_tokens`).
  `max_tokens` is uniform in [output_len - jitter, output_len + jitter], and `ignore_eos: true`
  forces every output to that length.
- warm-up: `--warmup N` requests (own prompts, same shape) before the clock starts, not counted.
- client processes: one asyncio + httpx process spends some 30-60 us of CPU per streamed event, so
  it tops out near 15-30k tokens/s (and, near that, delays its own next request and its timing);
  by default a level with more than 16 streams is split over several spawned client processes (one
  per 16, at most 8 and CPUs - 2; `--workers`) that start together and whose records are merged. `client_cpu_util` (busiest process, fraction of a core)
  says whether the load generator itself was close to saturation.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from benchmarks.serving import load_metrics  # noqa: E402
from benchmarks.serving.load_client import Progress, load_prompts, measure, prepare  # noqa: E402
from benchmarks.serving.load_metrics import RequestRecord, print_row, summarize_records  # noqa: E402
from benchmarks.serving.load_plots import plot  # noqa: E402


# ------------------------------------------------------------------------------- client processes
def _split(total: int | None, parts: int, i: int) -> int | None:
    """Part i of `total` split as evenly as possible into `parts`."""
    if total is None:
        return None
    return total // parts + (1 if i < total % parts else 0)


def auto_workers(concurrency: int | None, request_rate: float | None, max_concurrency: int | None,
                 output_len: int) -> int:
    """Client processes: one per 16 concurrent streams (a single asyncio+httpx process spends
    ~30-60 us of CPU per streamed event, so one process tops out around 15-30k events/s; on an H100
    two processes for 64 streams ran 80% busy and kept only 55 requests in flight), at most 8 and at
    most the CPU count minus two (the server needs its own cores): 1024 clients on 16 CPUs are 8
    processes of 128 streams (each raises its open-file limit to fit them, load_client.raise_fd_limit)."""
    streams = concurrency or max_concurrency
    if streams is None:  # open loop, uncapped: guess the streams in flight from the rate
        streams = int((request_rate or 1) * max(output_len, 1) * 0.01) + 1
    cap = max(1, min(8, (os.cpu_count() or 2) - 2))
    return max(1, min(cap, math.ceil(streams / 16)))


class _SharedCounter:
    """Progress from a worker process: bumps a shared integer the parent draws."""

    def __init__(self, value) -> None:
        self.value = value

    def update(self, n: int = 1) -> None:
        with self.value.get_lock():
            self.value.value += n


def _worker_main(url, kwargs, counter, ready, start, results, index) -> None:
    """A client process: say it is ready, wait for the common start, run its share, send back its records."""
    try:
        with ready.get_lock():
            ready.value += 1
        start.wait()
        records, t0, t_end, cpu = asyncio.run(measure(url, **kwargs, progress=_SharedCounter(counter)))
        results.put((index, [asdict(r) for r in records], t0, t_end, cpu, None))
    except BaseException as e:  # report, never hang the parent
        results.put((index, [], 0.0, 0.0, 0.0, f"{type(e).__name__}: {e}"))


def _measure_in_processes(url: str, workers: int, *, concurrency, request_rate, max_concurrency, num_requests,
                          label, progress, seed, **kwargs) -> tuple[list[RequestRecord], float, float, float]:
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")  # no fork of a process that may hold threads and sockets
    counter, ready, start, results = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Event(), ctx.Queue()
    procs = []
    for i in range(workers):
        share = dict(kwargs, concurrency=_split(concurrency, workers, i),
                     request_rate=request_rate / workers if request_rate is not None else None,
                     max_concurrency=_split(max_concurrency, workers, i) if max_concurrency else None,
                     num_requests=_split(num_requests, workers, i), seed=seed + 1_000_003 * i)
        if share["concurrency"] == 0 or share["num_requests"] == 0:
            continue
        p = ctx.Process(target=_worker_main, args=(url, share, counter, ready, start, results, i), daemon=True)
        p.start()
        procs.append(p)
    bar = Progress(num_requests, f"{label} " + (f"c={concurrency}" if concurrency else f"rate={request_rate}/s")
                   + f" ({len(procs)} client processes)", progress)
    deadline = time.monotonic() + 120
    while ready.value < len(procs) and time.monotonic() < deadline and any(p.is_alive() for p in procs):
        time.sleep(0.05)  # every child imported and waiting: start them together
    start.set()
    got, seen = [], 0
    while len(got) < len(procs):
        try:
            got.append(results.get(timeout=0.2))
        except queue_mod.Empty:
            if not any(p.is_alive() for p in procs) and results.empty():
                break
        if counter.value > seen:
            bar.update(counter.value - seen)
            seen = counter.value
    if counter.value > seen:
        bar.update(counter.value - seen)
    bar.close()
    for p in procs:
        p.join(timeout=10)
    failed = [msg for *_, msg in got if msg] + (["a client process died"] if len(got) < len(procs) else [])
    if failed:
        raise RuntimeError(f"load test client process failed: {failed[0]}")
    fields = set(RequestRecord.__dataclass_fields__)
    records = [RequestRecord(**{k: v for k, v in d.items() if k in fields}) for _, recs, *_ in got for d in recs]
    records.sort(key=lambda r: r.start)
    for i, r in enumerate(records):  # one numbering across processes, in order of sending
        r.index = i
    t0 = min(g[2] for g in got if g[1]) if any(g[1] for g in got) else 0.0
    t_end = max(g[3] for g in got) if got else 0.0
    return records, t0, t_end, max(g[4] for g in got) if got else 0.0


async def run_load_async(url: str, **kwargs) -> dict:
    """`run_load` from inside a running event loop (client processes, if any, are waited for in a thread)."""
    return await asyncio.to_thread(run_load, url, **kwargs)


def run_load(url: str, *, concurrency: int | None = None, request_rate: float | None = None,
             max_concurrency: int | None = None, num_requests: int | None = None, duration: float | None = None,
             grace: float = 5.0, input_len: int = 512, input_jitter: int = 0, output_len: int = 256,
             output_jitter: int = 0, vocab_size: int | None = None, prompts: list[str] | None = None,
             prompts_file: str | None = None, prompts_split: str = "line", warmup: int = 0, seed: int = 0,
             temperature: float = 0.0, ignore_eos: bool = True, timeout: float = 600.0, progress: bool = True,
             label: str = "server", keep_requests: bool = False, extra_body: dict | None = None,
             workers: int | None = None, transport: httpx.AsyncBaseTransport | None = None,
             api: str = "generate") -> dict:
    """Run one load level against `url`; return its result row (metrics: see the module docstring).

    Closed loop with `concurrency`, or open loop with `request_rate` (Poisson); bounded by
    `num_requests` and/or `duration` (+ `grace`). `workers` client processes share the load (None:
    `auto_workers`; their Poisson streams add up to `request_rate`, each sends its share of
    `num_requests`); `warmup` requests go first, from this process. `keep_requests` adds the
    per-request records under "requests"; `transport` replaces the network (tests use
    httpx.MockTransport; it implies one process). `api`: "generate" (flashpage's POST /generate) or
    "completions" (OpenAI's streamed /v1/completions; `extra_body` names the "model")."""
    if (concurrency is None) == (request_rate is None):
        raise ValueError("give exactly one of concurrency (closed loop) or request_rate (open loop)")
    if concurrency is not None and concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if request_rate is not None and request_rate <= 0:
        raise ValueError("request_rate must be > 0")
    if num_requests is None and duration is None:
        raise ValueError("give num_requests and/or duration, or the run never ends")
    if prompts is None and prompts_file is not None:
        prompts = load_prompts(prompts_file, prompts_split)
    body_extra = {"temperature": temperature, "ignore_eos": ignore_eos, **(extra_body or {})}
    shape = dict(input_len=input_len, input_jitter=input_jitter, output_len=output_len,
                 output_jitter=output_jitter, vocab_size=vocab_size, prompts=prompts)
    if transport is not None:
        workers = 1
    elif workers is None:
        workers = auto_workers(concurrency, request_rate, max_concurrency, output_len)
    workers = max(1, min(workers, concurrency or workers, num_requests or workers))
    vocab_size, warm_errors = asyncio.run(prepare(
        url, vocab_size=vocab_size, prompts=prompts, warmup=warmup, warmup_concurrency=concurrency or max_concurrency or 8,
        shape=shape, body_extra=body_extra, seed=seed, timeout=timeout, progress=progress, label=label,
        transport=transport, api=api))
    shape["vocab_size"] = vocab_size
    level = dict(concurrency=concurrency, request_rate=request_rate, max_concurrency=max_concurrency,
                 num_requests=num_requests, duration=duration, grace=grace, shape=shape, body_extra=body_extra,
                 seed=seed, timeout=timeout, api=api)
    if workers == 1:
        what = f"c={concurrency}" if request_rate is None else f"rate={request_rate}/s"
        bar = Progress(num_requests, f"{label} {what}", progress)
        records, t0, t_end, cpu = asyncio.run(measure(url, **level, progress=bar, transport=transport))
        bar.close()
    else:
        records, t0, t_end, cpu = _measure_in_processes(url, workers, label=label, progress=progress, **level)
    elapsed = t_end - t0
    row = {"impl": label, "api": api, "mode": "closed" if request_rate is None else "poisson", "concurrency": concurrency,
           "request_rate": request_rate, "max_concurrency": max_concurrency,
           "input_len": input_len if prompts is None else None, "input_jitter": input_jitter,
           "output_len": output_len, "output_jitter": output_jitter, "vocab_size": vocab_size,
           "warmup": warmup, "warmup_errors": warm_errors, "num_requests_bound": num_requests,
           "duration_bound_s": duration, "client_processes": workers, "seed": seed,
           # CPU busy fraction of the busiest client process: near 1.0, the client may be the bottleneck
           "client_cpu_util": cpu / elapsed if elapsed > 0 else None,
           **summarize_records(records, elapsed)}
    if keep_requests:
        row["requests"] = [{**asdict(r), "ok": r.ok, "tpot": r.tpot} for r in records]
    return row


# ------------------------------------------------------------------------------- CLI
def _add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help="closed loop: this many concurrent clients (several values = a sweep)")
    g.add_argument("--request-rate", type=float, nargs="+", default=None,
                   help="open loop: Poisson arrivals at this many requests/s (inf = all at once)")
    g.add_argument("--max-concurrency", type=int, default=None, help="open loop: cap on requests in flight")
    g.add_argument("--num-requests", type=int, default=None, help="requests per level (bound)")
    g.add_argument("--duration", type=float, default=None,
                   help="seconds per level: stop issuing then, cancel in-flight requests at duration + grace")
    g.add_argument("--grace", type=float, default=5.0, help="seconds in-flight requests get after --duration")
    g.add_argument("--warmup", type=int, default=0, help="requests sent before each level, not counted")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request HTTP timeout (s)")
    g.add_argument("--workers", type=int, default=None,
                   help="client processes sharing the load (default: one per 16 streams, at most 8 and CPUs - 2)")
    g = p.add_argument_group("requests")
    g.add_argument("--input-len", type=int, default=512, help="prompt tokens (mean)")
    g.add_argument("--input-jitter", type=int, default=0, help="prompt length uniform in len +- jitter")
    g.add_argument("--output-len", type=int, default=256, help="max_tokens (mean); ignore_eos forces it")
    g.add_argument("--output-jitter", type=int, default=0, help="max_tokens uniform in len +- jitter")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="random prompt ids are drawn from [0, vocab) (default: ask the server)")
    g.add_argument("--prompts-file", default=None, help="text prompts instead of random ids")
    g.add_argument("--prompts-split", choices=["line", "paragraph"], default="line")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let outputs stop at EOS (default: ignore_eos, outputs forced to max_tokens)")
    g.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.load_test",
                                description=__doc__ + "\n" + load_metrics.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    r = sub.add_parser("run", help="run load levels against a server", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    r.add_argument("--url", default="http://127.0.0.1:8000")
    r.add_argument("--label", default="server", help="the `impl` name in result rows")
    r.add_argument("--out", default=None, help="write the result JSON here")
    r.add_argument("--plot", default=None, metavar="PREFIX", help="also write PREFIX_throughput.png and PREFIX_latency.png")
    r.add_argument("--save-requests", action="store_true", help="keep per-request records in the JSON")
    r.add_argument("--no-progress", dest="progress", action="store_false")
    _add_load_args(r)
    pl = sub.add_parser("plot", help="plot one or more result JSON files")
    pl.add_argument("files", nargs="+")
    pl.add_argument("--out-prefix", required=True)
    pl.add_argument("--title", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in ("run", "plot", "-h", "--help"):
        argv = ["run", *argv]
    args = build_parser().parse_args(argv)
    if args.cmd == "plot":
        for path in plot(args.files, args.out_prefix, args.title):
            print(path)
        return 0
    if args.cmd != "run":
        build_parser().print_help()
        return 2
    if (args.concurrency is None) == (args.request_rate is None):
        raise SystemExit("give --concurrency or --request-rate (one of them)")
    if args.num_requests is None and args.duration is None:
        raise SystemExit("give --num-requests and/or --duration")
    common = dict(num_requests=args.num_requests, duration=args.duration, grace=args.grace, warmup=args.warmup,
                  timeout=args.timeout, input_len=args.input_len, input_jitter=args.input_jitter,
                  output_len=args.output_len, output_jitter=args.output_jitter, vocab_size=args.vocab_size,
                  prompts_file=args.prompts_file, prompts_split=args.prompts_split, temperature=args.temperature,
                  ignore_eos=args.ignore_eos, seed=args.seed, progress=args.progress, label=args.label,
                  keep_requests=args.save_requests, max_concurrency=args.max_concurrency, workers=args.workers)
    levels = [dict(concurrency=c) for c in args.concurrency or []] + \
             [dict(request_rate=r) for r in args.request_rate or []]
    rows = []
    for level in levels:
        row = run_load(args.url, **level, **common)
        print_row(row)
        rows.append(row)
    result = {"date": datetime.date.today().isoformat(), "command": "python -m benchmarks.serving.load_test " + " ".join(sys.argv[1:]),
              "url": args.url, "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(args.out)
    if args.plot:
        for path in plot(result, args.plot):
            print(path)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
