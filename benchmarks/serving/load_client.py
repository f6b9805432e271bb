"""One client process of the load test (benchmarks/serving/load_test.py): request shapes and prompts, one
streaming `POST /generate` timed per token (or, with api="completions", one streamed OpenAI
`POST /v1/completions`, which any OpenAI-compatible server answers: vLLM's too), and the
closed-loop / Poisson driver that issues requests until a bound is hit, filling a `RequestRecord`
(benchmarks/serving/load_metrics.py) per request."""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.serving.load_metrics import RequestRecord


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


async def _stream_events(client: httpx.AsyncClient, url: str, body: dict, rec: RequestRecord, on_event) -> RequestRecord:
    """POST `body` to `url` with streaming and call `on_event(event, t)` for each SSE JSON event until
    `data: [DONE]` (t: seconds since the request was sent), filling `rec`'s status, errors, end to
    end time and cancellation in place (so a cancelled request keeps what it got)."""
    rec.start = start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
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
                on_event(event, now - start)
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
    finally:
        if rec.e2e is None:  # an error answer or event: its time still counts in the run's elapsed
            rec.e2e = time.perf_counter() - start
    return rec


async def send_request(client: httpx.AsyncClient, url: str, spec: RequestSpec, rec: RequestRecord,
                       body_extra: dict) -> RequestRecord:
    """POST one streaming request to /generate and fill `rec` in place."""
    body = {"max_tokens": spec.max_tokens, "stream": True, **body_extra}
    if spec.prompt_token_ids is not None:
        body["prompt_token_ids"] = spec.prompt_token_ids
    else:
        body["prompt"] = spec.prompt
    last = [0.0]  # the time of the last event that carried tokens

    def on_event(event: dict, t: float) -> None:
        tokens = event.get("token_ids") or []
        if tokens:
            if rec.ttft is None:
                rec.ttft = t
            else:
                rec.itl.append(t - last[0])
            rec.itl.extend([0.0] * (len(tokens) - 1))
            last[0] = t
            rec.n_out += len(tokens)
        if event.get("finished"):
            rec.finish_reason = event.get("finish_reason")
            usage = event.get("usage") or {}
            rec.usage_completion_tokens = usage.get("completion_tokens")
            rec.prompt_tokens = usage.get("prompt_tokens")

    return await _stream_events(client, url.rstrip("/") + "/generate", body, rec, on_event)


async def send_completion(client: httpx.AsyncClient, url: str, spec: RequestSpec, rec: RequestRecord,
                          body_extra: dict) -> RequestRecord:
    """`send_request` for OpenAI's streamed /v1/completions (body_extra carries "model"). Its chunks
    carry text, not token ids, so each chunk with a choice counts as one token's arrival (the ITL
    values are the gaps between chunks, as `vllm bench serve` takes them) and `n_out` is the final
    chunk's usage.completion_tokens (stream_options.include_usage), the chunk count without it."""
    body = {"max_tokens": spec.max_tokens, "stream": True, "stream_options": {"include_usage": True}, **body_extra,
            "prompt": spec.prompt_token_ids if spec.prompt_token_ids is not None else spec.prompt}
    last = [0.0]

    def on_event(event: dict, t: float) -> None:
        if event.get("choices"):
            if rec.ttft is None:
                rec.ttft = t
            else:
                rec.itl.append(t - last[0])
            last[0] = t
            rec.n_out += 1
            rec.finish_reason = event["choices"][0].get("finish_reason") or rec.finish_reason
        if event.get("usage"):  # the last chunk: the server's count replaces the chunks'
            rec.usage_completion_tokens = event["usage"].get("completion_tokens")
            rec.prompt_tokens = event["usage"].get("prompt_tokens")
            rec.n_out = rec.usage_completion_tokens if rec.usage_completion_tokens is not None else rec.n_out

    return await _stream_events(client, url.rstrip("/") + "/v1/completions", body, rec, on_event)


SENDERS = {"generate": send_request, "completions": send_completion}


# ------------------------------------------------------------------------------- progress
class Progress:
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
                 duration, grace, rate_seed, progress, api="generate") -> tuple[list[RequestRecord], float, float]:
    """Issue requests until a bound is hit; return (records, t0, t_end) in perf_counter seconds."""
    send = SENDERS[api]
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
            await send(client, url, spec, rec, body_extra)
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


def raise_fd_limit(need: int, warn: bool = True) -> int:
    """Raise this process's soft open-file limit to `need` (within the hard limit): a client process
    holds one socket per stream, and 1024 streams in one process (one CPU core to spare) would pass
    the usual soft limit of 1024. Returns the soft limit now in force."""
    try:
        import resource
    except ImportError:  # not Unix
        return need
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < need and warn:
            print(f"warning: {need} sockets wanted but the open-file limit is {hard} (ulimit -Hn): expect "
                  "connection errors; use more client processes", file=sys.stderr)
        return new
    return soft


async def measure(url: str, *, concurrency, request_rate, max_concurrency, num_requests, duration, grace, shape,
                  body_extra, seed, timeout, progress, transport=None,
                  api="generate") -> tuple[list[RequestRecord], float, float, float]:
    """One process's share of a level: (records, t0, t_end, client CPU seconds)."""
    pool = (concurrency or max_concurrency or 0) + 16
    if transport is None:
        # open loop uncapped: no bound on the streams in flight; ask for room for a few thousand
        raise_fd_limit(pool + 64 if concurrency or max_concurrency else 4096, warn=bool(concurrency or max_concurrency))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=pool)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)), limits=limits,
                                 transport=transport) as client:
        cpu = time.process_time()
        records, t0, t_end = await _drive(client, url, PromptSource(**shape, seed=seed), body_extra,
                                          concurrency=concurrency, request_rate=request_rate,
                                          max_concurrency=max_concurrency, num_requests=num_requests,
                                          duration=duration, grace=grace, rate_seed=seed + 1, progress=progress,
                                          api=api)
        return records, t0, t_end, time.process_time() - cpu


async def prepare(url: str, *, vocab_size, prompts, warmup, warmup_concurrency, shape, body_extra, seed, timeout,
                  progress, label, transport=None, api="generate") -> tuple[int | None, int]:
    """Resolve the vocab size (asking the server if needed) and send the warm-up; (vocab, warm-up errors)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                 limits=httpx.Limits(max_connections=None), transport=transport) as client:
        if prompts is None and not vocab_size:
            vocab_size = (await fetch_server_info(client, url)).get("vocab_size")
            if not vocab_size:
                raise ValueError(f"{url} does not tell its vocab size (GET /info or /health): pass vocab_size")
        if warmup <= 0:
            return vocab_size, 0
        bar = Progress(warmup, f"{label} warm-up", progress)
        recs, _, _ = await _drive(client, url, PromptSource(**{**shape, "vocab_size": vocab_size}, seed=seed + 7919),
                                  body_extra, concurrency=max(1, min(warmup, warmup_concurrency)), request_rate=None,
                                  max_concurrency=None, num_requests=warmup, duration=None, grace=0.0, rate_seed=0,
                                  progress=bar, api=api)
        bar.close()
        return vocab_size, sum(not r.ok for r in recs)

