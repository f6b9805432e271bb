"""HTTP load test for `POST /generate` with `"stream": true` (flashpage or anything speaking its API).

    python benchmarks/load_test.py run --url http://127.0.0.1:8000 --concurrency 1 8 32 \\
        --num-requests 64 --duration 60 --input-len 512 --input-jitter 128 \\
        --output-len 256 --output-jitter 64 --vocab-size 50257 --out load.json
    python benchmarks/load_test.py run --url ... --request-rate 2 8 --num-requests 100   # open loop
    python benchmarks/load_test.py plot load.json [other.json ...] --out-prefix load     # PNGs

(`run` may be left out.) From Python: `run_load(url, concurrency=8, num_requests=32, ...)` returns one
result row (a dict); `plot(results, out_prefix)` draws it.

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
  it tops out near 15-30k tokens/s; by default a level with more than 32 streams is split over
  several spawned client processes (one per 32, at most 8 and CPUs - 2; `--workers`) that start
  together and whose records are merged. `client_cpu_util` (busiest process, fraction of a core)
  says whether the load generator itself was close to saturation.

Metrics (one row per run; latencies in ms, each with mean, p50, p90, p99)
- ttft: request sent -> first SSE event that carries tokens.
- tpot: per request, (e2e - ttft) / (n_out - 1), over requests with n_out > 1.
- itl: gaps between SSE events that carry tokens, counted per token: an event carrying k tokens
  contributes one gap (time since the previous token-carrying event) and then k - 1 zeros, so a
  request contributes n_out - 1 values whose sum is its last-token time minus its ttft. (The first
  event's gap is the ttft, not an itl; its remaining k - 1 tokens count as zeros.)
- e2e: request sent -> `data: [DONE]`.
  ttft/tpot/itl/e2e are taken over successful requests only.
- requests_per_s: successful requests / elapsed; output_tokens_per_s: every output token received
  during the run (those of requests cancelled at the deadline included) / elapsed, where elapsed runs
  from the first request sent to the last one ended. (With no deadline cut the two token counts are
  equal; `output_tokens` counts successful requests only.)
- errors: non-200 answers by status (`errors_by_status`), transport failures by exception type
  (`errors_by_exception`: ConnectError, ReadTimeout, ...; a stream that ends without `[DONE]` is
  `IncompleteStream`, an unparsable event `BadEvent`).
- output tokens are counted from the stream and cross-checked against the final event's
  `usage.completion_tokens` (`usage_mismatches`, with examples); with ignore_eos, every successful
  request should also have exactly its `max_tokens` (`length_mismatches`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import summarize  # noqa: E402

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")


# ------------------------------------------------------------------------------- requests
@dataclass
class RequestSpec:
    index: int
    max_tokens: int
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None

    @property
    def input_len(self) -> int | None:
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else None


@dataclass
class RequestRecord:
    index: int
    max_tokens: int
    input_len: int | None
    start: float = 0.0  # perf_counter when the request was sent
    status: int | None = None
    error: str | None = None  # "http_400", or an exception type name
    error_detail: str | None = None
    cancelled: bool = False
    done: bool = False  # saw data: [DONE]
    ttft: float | None = None  # seconds
    e2e: float | None = None
    n_out: int = 0  # tokens counted from the stream
    usage_completion_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    itl: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled and self.done

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.n_out < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.n_out - 1)


def load_prompts(path: str | Path, split: str = "line") -> list[str]:
    text = Path(path).read_text(encoding="utf-8")
    if split == "line":
        parts = text.splitlines()
    elif split == "paragraph":
        parts = [p.replace("\n", " ") for p in text.split("\n\n")]
    else:
        raise ValueError(f"split must be 'line' or 'paragraph', not {split!r}")
    parts = [p.strip() for p in parts if p.strip()]
    if not parts:
        raise ValueError(f"{path} has no prompts")
    return parts


class PromptSource:
    """Deterministic stream of RequestSpecs (random token ids or text prompts) for one seed."""

    def __init__(self, *, input_len: int, input_jitter: int, output_len: int, output_jitter: int,
                 vocab_size: int | None = None, prompts: list[str] | None = None, seed: int = 0) -> None:
        if prompts is None and not vocab_size:
            raise ValueError("random token prompts need a vocab size (--vocab-size) or --prompts-file")
        self.rng = random.Random(seed)
        self.input_len, self.input_jitter = input_len, input_jitter
        self.output_len, self.output_jitter = output_len, output_jitter
        self.vocab_size, self.prompts = vocab_size, prompts
        self.count = 0

    def _uniform(self, mean: int, jitter: int) -> int:
        return max(1, self.rng.randint(mean - jitter, mean + jitter) if jitter > 0 else mean)

    def next(self) -> RequestSpec:
        i, self.count = self.count, self.count + 1
        max_tokens = self._uniform(self.output_len, self.output_jitter)
        if self.prompts is not None:
            return RequestSpec(i, max_tokens, prompt=self.prompts[self.rng.randrange(len(self.prompts))])
        n = self._uniform(self.input_len, self.input_jitter)
        ids = [self.rng.randrange(self.vocab_size) for _ in range(n)]
        return RequestSpec(i, max_tokens, prompt_token_ids=ids)


async def send_request(client: httpx.AsyncClient, url: str, spec: RequestSpec, rec: RequestRecord,
                       body_extra: dict) -> RequestRecord:
    """POST one streaming request and fill `rec` in place (so a cancelled request keeps what it got)."""
    body = {"max_tokens": spec.max_tokens, "stream": True, **body_extra}
    if spec.prompt_token_ids is not None:
        body["prompt_token_ids"] = spec.prompt_token_ids
    else:
        body["prompt"] = spec.prompt
    rec.start = start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url.rstrip("/") + "/generate", json=body) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                rec.error = f"http_{resp.status_code}"
                rec.error_detail = resp.text[:300]
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                now = time.perf_counter()
                if data == "[DONE]":
                    rec.done = True
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    rec.error, rec.error_detail = "BadEvent", data[:300]
                    return rec
                if "error" in event:
                    rec.error, rec.error_detail = "StreamError", json.dumps(event["error"])[:300]
                    return rec
                tokens = event.get("token_ids") or []
                if tokens:
                    if rec.ttft is None:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    rec.itl.extend([0.0] * (len(tokens) - 1))
                    last = now
                    rec.n_out += len(tokens)
                if event.get("finished"):
                    rec.finish_reason = event.get("finish_reason")
                    usage = event.get("usage") or {}
                    rec.usage_completion_tokens = usage.get("completion_tokens")
                    rec.prompt_tokens = usage.get("prompt_tokens")
            rec.e2e = time.perf_counter() - start
            if not rec.done:
                rec.error = "IncompleteStream"
    except asyncio.CancelledError:
        rec.cancelled = True
        rec.e2e = time.perf_counter() - start
        raise
    except Exception as e:  # transport errors (httpx.HTTPError) and anything else: count, never crash
        rec.error = type(e).__name__
        rec.error_detail = str(e)[:300]
        rec.e2e = time.perf_counter() - start
    return rec


# ------------------------------------------------------------------------------- progress
class _Progress:
    """tqdm when installed, else a plain stderr line redrawn at most twice a second."""

    def __init__(self, total: int | None, desc: str, enabled: bool) -> None:
        self.total, self.desc, self.enabled, self.n = total, desc, enabled, 0
        self._bar, self._last = None, 0.0
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=True, dynamic_ncols=True)
        except ImportError:
            self._bar = None

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= 0.5 or (self.total is not None and self.n >= self.total):
            self._last = now
            total = f"/{self.total}" if self.total is not None else ""
            sys.stderr.write(f"\r{self.desc}: {self.n}{total} requests")
            sys.stderr.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()


# ------------------------------------------------------------------------------- the run
async def _drive(client, url, source, body_extra, *, concurrency, request_rate, max_concurrency, num_requests,
                 duration, grace, rate_seed, progress) -> tuple[list[RequestRecord], float, float]:
    """Issue requests until a bound is hit; return (records, t0, t_end) in perf_counter seconds."""
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    stop_at = t0 + duration if duration is not None else math.inf
    hard_stop = stop_at + grace

    def more() -> bool:
        return (num_requests is None or len(records) < num_requests) and time.perf_counter() < stop_at

    def new_record() -> tuple[RequestSpec, RequestRecord]:
        spec = source.next()
        rec = RequestRecord(spec.index, spec.max_tokens, spec.input_len)
        records.append(rec)
        return spec, rec

    async def one(spec, rec):
        try:
            await send_request(client, url, spec, rec, body_extra)
        finally:
            progress.update()

    tasks: set[asyncio.Task] = set()
    if request_rate is None:  # closed loop
        async def worker():
            while more():
                spec, rec = new_record()
                await one(spec, rec)
                if rec.error is not None and rec.status is None:
                    await asyncio.sleep(0.01)  # transport error (server down): do not spin

        tasks = {asyncio.create_task(worker()) for _ in range(concurrency)}
    else:  # open loop, Poisson arrivals
        rng = random.Random(rate_seed)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def capped(spec, rec):
            if sem is None:
                return await one(spec, rec)
            try:
                async with sem:
                    return await one(spec, rec)
            except asyncio.CancelledError:
                rec.cancelled = True  # also when it never got past the cap
                raise

        async def issuer():
            next_t = time.perf_counter()
            while more():
                tasks.add(asyncio.create_task(capped(*new_record())))
                if math.isinf(request_rate):
                    await asyncio.sleep(0)
                    continue
                next_t += rng.expovariate(request_rate)
                delay = next_t - time.perf_counter()
                if next_t >= stop_at:
                    break
                if delay > 0:
                    await asyncio.sleep(delay)

        issue_task = asyncio.create_task(issuer())
        await asyncio.wait({issue_task}, timeout=None if math.isinf(hard_stop) else max(0.0, hard_stop - time.perf_counter()))
        if not issue_task.done():
            issue_task.cancel()
        await asyncio.gather(issue_task, return_exceptions=True)

    pending = {t for t in tasks if not t.done()}
    if pending:
        timeout = None if math.isinf(hard_stop) else max(0.0, hard_stop - time.perf_counter())
        _, pending = await asyncio.wait(pending, timeout=timeout)
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    t_end = max([t0] + [r.start + r.e2e for r in records if r.e2e is not None])
    return records, t0, t_end


async def fetch_server_info(client: httpx.AsyncClient, url: str) -> dict:
    """`GET /info` then `/health`: the first JSON object with a `vocab_size` (empty dict if none)."""
    for path in ("/info", "/health"):
        try:
            r = await client.get(url.rstrip("/") + path, timeout=10)
            if r.status_code == 200:
                body = r.json()
                if isinstance(body, dict) and body.get("vocab_size"):
                    return body
        except (httpx.HTTPError, ValueError):
            pass
    return {}


def summarize_records(records: list[RequestRecord], elapsed: float) -> dict:
    ok = [r for r in records if r.ok]
    errors = [r for r in records if r.error is not None and not r.cancelled]
    by_status: dict[str, int] = {}
    by_exc: dict[str, int] = {}
    for r in errors:
        if r.error.startswith("http_"):
            by_status[r.error[5:]] = by_status.get(r.error[5:], 0) + 1
        else:
            by_exc[r.error] = by_exc.get(r.error, 0) + 1
    mismatches = [r for r in ok if r.usage_completion_tokens != r.n_out]
    length_mismatches = [r for r in ok if r.n_out != r.max_tokens]
    out_tokens = sum(r.n_out for r in ok)
    all_tokens = sum(r.n_out for r in records)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else (r.input_len or 0) for r in ok)
    elapsed = max(elapsed, 1e-9)
    row = {
        "num_requests": len(records), "completed": len(ok), "cancelled": sum(r.cancelled for r in records),
        "errors": len(errors), "errors_by_status": by_status, "errors_by_exception": by_exc,
        "error_examples": sorted({f"{r.error}: {r.error_detail}" for r in errors})[:5],
        "duration_s": elapsed,
        "requests_per_s": len(ok) / elapsed,
        "output_tokens_per_s": all_tokens / elapsed,
        "completed_output_tokens_per_s": out_tokens / elapsed,
        "input_tokens_per_s": in_tokens / elapsed,
        "output_tokens": out_tokens, "output_tokens_received": all_tokens, "input_tokens": in_tokens,
        "usage_mismatches": len(mismatches),
        "usage_mismatch_examples": [{"index": r.index, "stream": r.n_out, "usage": r.usage_completion_tokens}
                                    for r in mismatches[:5]],
        "length_mismatches": len(length_mismatches),
        "mean_in_flight": sum(r.e2e for r in records if r.e2e is not None) / elapsed,
    }
    values = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [t for t in (r.tpot for r in ok) if t is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2e": [r.e2e for r in ok],
    }
    for name in LATENCY_METRICS:
        for stat, v in summarize(values[name], scale=1000.0).items():
            row[f"{name}_{stat}_ms"] = v
    return row


def _split(total: int | None, parts: int, i: int) -> int | None:
    """Part i of `total` split as evenly as possible into `parts`."""
    if total is None:
        return None
    return total // parts + (1 if i < total % parts else 0)


def auto_workers(concurrency: int | None, request_rate: float | None, max_concurrency: int | None,
                 output_len: int) -> int:
    """Client processes: one per 32 concurrent streams (a single asyncio+httpx process spends
    ~30-60 us of CPU per streamed event, so one process tops out around 15-30k events/s), at most
    8 and at most the CPU count minus two (the server needs its own cores)."""
    streams = concurrency or max_concurrency
    if streams is None:  # open loop, uncapped: guess the streams in flight from the rate
        streams = int((request_rate or 1) * max(output_len, 1) * 0.01) + 1
    cap = max(1, min(8, (os.cpu_count() or 2) - 2))
    return max(1, min(cap, math.ceil(streams / 32)))


async def _measure(url: str, *, concurrency, request_rate, max_concurrency, num_requests, duration, grace, shape,
                   body_extra, seed, timeout, progress, transport=None) -> tuple[list[RequestRecord], float, float, float]:
    """One process's share of a level: (records, t0, t_end, client CPU seconds)."""
    pool = (concurrency or max_concurrency or 0) + 16
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=pool)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)), limits=limits,
                                 transport=transport) as client:
        cpu = time.process_time()
        records, t0, t_end = await _drive(client, url, PromptSource(**shape, seed=seed), body_extra,
                                          concurrency=concurrency, request_rate=request_rate,
                                          max_concurrency=max_concurrency, num_requests=num_requests,
                                          duration=duration, grace=grace, rate_seed=seed + 1, progress=progress)
        return records, t0, t_end, time.process_time() - cpu


async def _prepare(url: str, *, vocab_size, prompts, warmup, warmup_concurrency, shape, body_extra, seed, timeout,
                   progress, label, transport=None) -> tuple[int | None, int]:
    """Resolve the vocab size (asking the server if needed) and send the warm-up; (vocab, warm-up errors)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                 limits=httpx.Limits(max_connections=None), transport=transport) as client:
        if prompts is None and not vocab_size:
            vocab_size = (await fetch_server_info(client, url)).get("vocab_size")
            if not vocab_size:
                raise ValueError(f"{url} does not tell its vocab size (GET /info or /health): pass vocab_size")
        if warmup <= 0:
            return vocab_size, 0
        bar = _Progress(warmup, f"{label} warm-up", progress)
        recs, _, _ = await _drive(client, url, PromptSource(**{**shape, "vocab_size": vocab_size}, seed=seed + 7919),
                                  body_extra, concurrency=max(1, min(warmup, warmup_concurrency)), request_rate=None,
                                  max_concurrency=None, num_requests=warmup, duration=None, grace=0.0, rate_seed=0,
                                  progress=bar)
        bar.close()
        return vocab_size, sum(not r.ok for r in recs)


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
        records, t0, t_end, cpu = asyncio.run(_measure(url, **kwargs, progress=_SharedCounter(counter)))
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
    bar = _Progress(num_requests, f"{label} " + (f"c={concurrency}" if concurrency else f"rate={request_rate}/s")
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
             workers: int | None = None, transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """Run one load level against `url`; return its result row (metrics: see the module docstring).

    Closed loop with `concurrency`, or open loop with `request_rate` (Poisson); bounded by
    `num_requests` and/or `duration` (+ `grace`). `workers` client processes share the load (None:
    `auto_workers`; their Poisson streams add up to `request_rate`, each sends its share of
    `num_requests`); `warmup` requests go first, from this process. `keep_requests` adds the
    per-request records under "requests"; `transport` replaces the network (tests use
    httpx.MockTransport; it implies one process)."""
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
    vocab_size, warm_errors = asyncio.run(_prepare(
        url, vocab_size=vocab_size, prompts=prompts, warmup=warmup, warmup_concurrency=concurrency or max_concurrency or 8,
        shape=shape, body_extra=body_extra, seed=seed, timeout=timeout, progress=progress, label=label,
        transport=transport))
    shape["vocab_size"] = vocab_size
    level = dict(concurrency=concurrency, request_rate=request_rate, max_concurrency=max_concurrency,
                 num_requests=num_requests, duration=duration, grace=grace, shape=shape, body_extra=body_extra,
                 seed=seed, timeout=timeout)
    if workers == 1:
        what = f"c={concurrency}" if request_rate is None else f"rate={request_rate}/s"
        bar = _Progress(num_requests, f"{label} {what}", progress)
        records, t0, t_end, cpu = asyncio.run(_measure(url, **level, progress=bar, transport=transport))
        bar.close()
    else:
        records, t0, t_end, cpu = _measure_in_processes(url, workers, label=label, progress=progress, **level)
    elapsed = t_end - t0
    row = {"impl": label, "mode": "closed" if request_rate is None else "poisson", "concurrency": concurrency,
           "request_rate": request_rate, "max_concurrency": max_concurrency,
           "input_len": input_len if prompts is None else None, "input_jitter": input_jitter,
           "output_len": output_len, "output_jitter": output_jitter, "vocab_size": vocab_size,
           "warmup": warmup, "warmup_errors": warm_errors, "num_requests_bound": num_requests,
           "duration_bound_s": duration, "client_processes": workers,
           # CPU busy fraction of the busiest client process: near 1.0, the client may be the bottleneck
           "client_cpu_util": cpu / elapsed if elapsed > 0 else None,
           **summarize_records(records, elapsed)}
    if keep_requests:
        row["requests"] = [{**asdict(r), "ok": r.ok, "tpot": r.tpot} for r in records]
    return row


# ------------------------------------------------------------------------------- plots
def _rows(results) -> list[dict]:
    if isinstance(results, dict):
        results = [results]
    rows = []
    for r in results:
        if isinstance(r, (str, Path)):
            r = json.loads(Path(r).read_text())
        rows += r.get("rows", [r]) if isinstance(r, dict) else list(r)
    return rows


def _x_of(row: dict) -> tuple[str, float | None]:
    if row.get("concurrency") is not None:
        return "concurrency", row["concurrency"]
    return "request_rate", row.get("request_rate")


def plot(results, out_prefix: str | Path, title: str | None = None) -> list[str]:
    """Throughput vs concurrency (or request rate) and latency percentiles vs concurrency, one line per
    impl, from result dicts / rows / JSON file paths. Writes `<out_prefix>_throughput.png` and
    `<out_prefix>_latency.png`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in _rows(results) if _x_of(r)[1] is not None]
    if not rows:
        raise ValueError("no rows with a concurrency or request_rate to plot")
    xname = _x_of(rows[0])[0]
    rows = [r for r in rows if _x_of(r)[0] == xname]
    impls = list(dict.fromkeys(r.get("impl", "server") for r in rows))
    colors = {impl: f"C{i}" for i, impl in enumerate(impls)}
    xlabel = "concurrent clients" if xname == "concurrency" else "request rate (req/s)"
    suffix = f" - {title}" if title else ""

    def series(impl, key):
        pts = sorted((_x_of(r)[1], r.get(key)) for r in rows if r.get("impl", "server") == impl)
        return [p[0] for p in pts if p[1] is not None], [p[1] for p in pts if p[1] is not None]

    def style_x(ax):
        xs = sorted({_x_of(r)[1] for r in rows})
        if min(xs) > 0 and max(xs) / min(xs) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x:g}" for x in xs])
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)

    out_prefix = str(out_prefix)
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, ylabel in ((axes[0], "output_tokens_per_s", "output tokens / s"),
                            (axes[1], "requests_per_s", "requests / s")):
        for impl in impls:
            xs, ys = series(impl, key)
            ax.plot(xs, ys, marker="o", color=colors[impl], label=impl)
        style_x(ax)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle(f"Throughput{suffix}")
    fig.tight_layout()
    paths.append(out_prefix + "_throughput.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    names = {"ttft": "time to first token", "tpot": "time per output token", "itl": "inter-token latency",
             "e2e": "end-to-end latency"}
    for ax, metric in zip(axes.flat, LATENCY_METRICS):
        for impl in impls:
            for stat, ls in (("p50", "-"), ("p99", "--")):
                xs, ys = series(impl, f"{metric}_{stat}_ms")
                ax.plot(xs, ys, marker="o", ls=ls, color=colors[impl], label=impl if stat == "p50" else None)
        style_x(ax)
        ax.set_yscale("log")
        ax.set_ylabel("ms (log)")
        ax.set_title(f"{names[metric]} (solid p50, dashed p99)")
        ax.legend(fontsize=7)
    fig.suptitle(f"Latency{suffix}")
    fig.tight_layout()
    paths.append(out_prefix + "_latency.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


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
                   help="client processes sharing the load (default: one per 32 streams, at most 8 and CPUs - 2)")
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
    p = argparse.ArgumentParser(prog="python benchmarks/load_test.py", description=__doc__,
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


def print_row(row: dict, file=sys.stderr) -> None:
    x = f"c={row['concurrency']}" if row.get("concurrency") is not None else f"rate={row.get('request_rate')}"

    def ms(key):
        v = row.get(key)
        return "-" if v is None else f"{v:.1f}"

    print(f"[{row.get('impl')}] {x}: {row['completed']}/{row['num_requests']} ok, {row['errors']} errors, "
          f"{row['cancelled']} cancelled | {row['output_tokens_per_s']:.1f} tok/s, {row['requests_per_s']:.2f} req/s | "
          f"ttft p50 {ms('ttft_p50_ms')} p99 {ms('ttft_p99_ms')} ms, tpot p50 {ms('tpot_p50_ms')} ms, "
          f"itl p99 {ms('itl_p99_ms')} ms, e2e p50 {ms('e2e_p50_ms')} ms"
          + (f" | usage mismatches {row['usage_mismatches']}" if row.get("usage_mismatches") else "")
          + (f" | errors {row['errors_by_status']} {row['errors_by_exception']}" if row.get("errors") else ""),
          file=file)
    if (row.get("client_cpu_util") or 0) > 0.8:
        print(f"   warning: a client process was {row['client_cpu_util']:.0%} busy: the load generator may be the "
              "bottleneck; use more client processes (--workers)", file=file)


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
    result = {"date": datetime.date.today().isoformat(), "command": "python " + " ".join(sys.argv),
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
