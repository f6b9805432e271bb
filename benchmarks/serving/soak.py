"""Soak test: thousands of mixed requests against one server with a deliberately small KV cache,
then: was anything lost, did anything leak? Loopback only.

    python -m benchmarks.serving.soak --model PATH                  # starts its own server (12... blocks)
    python -m benchmarks.serving.soak --url http://127.0.0.1:8000   # or soaks one that runs (give --pid for RSS)
    python -m benchmarks.serving.soak --model PATH --requests 300 --time-limit 60 --out soak.json

The mix (seeded): ~75% valid requests with random sampling settings (temperature, top_p, top_k,
seed, stop strings, text or token-id prompts, streamed or not); ~10% malformed (bad JSON, unknown
fields, out-of-range values, NaN, invalid UTF-8, out-of-vocabulary ids, prompts over the context or
--max-prompt-chars, bodies over --max-body-bytes); ~10% dropped by the client mid-request (streams
closed after a few events, non-streaming requests cancelled); ~5% hostile structured outputs and
large asks (issue 44: a $ref chain thousands deep, a 41-byte schema asking for gigabytes, a regex
that compiles for minutes, specs that are invalid or nest too deep as text, n x logprobs past
--max-request-tokens, logit_bias keys Python's int() reads), each of which must be a 400 and must
cost nothing else, mixed with valid constrained requests whose text must match their spec; and
every `--burst-every` requests a burst of `--burst-size` at once, beyond the waiting-queue limit,
that must get 503 + Retry-After rather than anything worse. Bounded by `--requests` and `--time-limit`.

Reported (JSON on stdout, and to --out): requests sent / completed / rejected by status per kind,
5xx on valid requests (503 with Retry-After is a rejection, not a failure), malformed requests not
answered with a 4xx, wrong responses (finish reason, token counts, stream framing), requests lost
(no answer at all), KV blocks leaked once the server is idle, the server's resident memory at start
and end. Exits 1 if any must-be-0 count is not 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import httpx

from benchmarks.shared.common import REPO_ROOT, ServerProcess  # noqa: E402

WORDS = ("the quick brown fox jumps over lazy dog return a new list of items naive cafe def f x "
         "Tokyo hello world server cache block page flash prefill decode").split()
MUST_BE_ZERO = ("valid_5xx", "malformed_not_4xx", "hostile_wrong", "wrong_responses", "lost", "leaked_blocks",
                "leaked_requests")


# -- the server -----------------------------------------------------------------------------------
def rss_bytes(pid: int | None) -> int | None:
    """Resident memory of `pid` (psutil if installed, else /proc)."""
    if pid is None:
        return None
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    except Exception:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# -- the requests ---------------------------------------------------------------------------------
def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def valid_body(rng: random.Random, a) -> dict:
    body: dict = {"max_tokens": rng.randint(1, a.max_tokens), "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        body["prompt"] = _text(rng, rng.randint(1, 30))
    else:
        body["prompt_token_ids"] = [rng.randrange(a.vocab_size) for _ in range(rng.randint(1, 80))]
    r = rng.random()
    if r < 0.3:
        body["temperature"] = 0.0
    elif r < 0.9:
        body["temperature"] = round(rng.uniform(0.1, 2.0), 3)
    if rng.random() < 0.4:
        body["top_p"] = round(rng.uniform(0.05, 1.0), 3)
    if rng.random() < 0.4:
        body["top_k"] = rng.randint(0, 60)
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(2**31)
    if rng.random() < 0.2:
        body["stop"] = rng.sample(["the", ".", " fox", "\n", "x"], rng.randint(1, 3))
    if rng.random() < 0.1:
        body["stop_token_ids"] = [rng.randrange(a.vocab_size)]
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    return body


def malformed(rng: random.Random, a) -> tuple[str, bytes]:
    """(name, raw body): each must be answered with a 4xx."""
    cases = [
        ("broken_json", b'{"prompt": "hi", "max_tokens": '),
        # top-level unknown keys are ignored by default (--unknown-fields); nested objects stay strict
        ("unknown_nested_field", json.dumps({"prompt": "hi", "sampling_params": {"bogus": 1}}).encode()),
        ("max_tokens_0", json.dumps({"prompt": "hi", "max_tokens": 0}).encode()),
        ("negative_temperature", json.dumps({"prompt": "hi", "temperature": -1}).encode()),
        ("top_p_0", json.dumps({"prompt": "hi", "top_p": 0}).encode()),
        ("nan", b'{"prompt": "hi", "temperature": NaN}'),
        ("wrong_type", json.dumps({"prompt": 5}).encode()),
        ("string_number", json.dumps({"prompt": "hi", "max_tokens": "7"}).encode()),
        ("no_prompt", b"{}"),
        ("both_prompts", json.dumps({"prompt": "hi", "prompt_token_ids": [1]}).encode()),
        ("too_many_stops", json.dumps({"prompt": "hi", "stop": ["a"] * 100}).encode()),
        ("invalid_utf8", b'{"prompt": "caf\xe9 \xff"}'),
        ("lone_surrogate", b'{"prompt": "a\\ud800"}'),
        ("out_of_vocab", json.dumps({"prompt_token_ids": [1, a.vocab_size + rng.randrange(10**6)]}).encode()),
        ("negative_token", json.dumps({"prompt_token_ids": [1, -5]}).encode()),
        ("over_context", json.dumps({"prompt_token_ids": [1] * a.context, "max_tokens": 8}).encode()),
        ("over_prompt_chars", json.dumps({"prompt": "y" * (a.max_prompt_chars + 1)}).encode()),
        ("over_body_limit", json.dumps({"prompt": "z " * (a.max_body_bytes // 2 + 16)}).encode()),
        ("not_an_object", b"[1, 2, 3]"),
    ]
    return rng.choice(cases)


def ref_chain(levels: int) -> dict:
    """Issue 44's crasher: each definition's property refers to the next."""
    defs = {f"d{i}": {"properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(levels)}
    return {"$defs": {**defs, f"d{levels}": {"type": "string"}}, "$ref": "#/$defs/d0"}


def hostile(rng: random.Random, a) -> tuple[str, str, dict, str | None]:
    """(name, path, body, the pattern a 200's text must match; None: it must be a 400). Within the
    soak server's --max-body-bytes (64 KiB)."""
    gen = {"prompt": _text(rng, 3), "max_tokens": 8, "temperature": 0}
    so = lambda spec: {**gen, "structured_outputs": spec}  # noqa: E731
    v1 = {"model": a.model_name, "prompt": _text(rng, 3), "max_tokens": 2}
    cases = [
        ("ref_chain", "/generate", so({"json": ref_chain(700)}), None),  # 2,100 levels: past --max-structured-depth
        ("max_length", "/generate", so({"json": {"type": "string", "maxLength": 20_000_000}}), None),
        ("min_properties", "/generate", so({"json": {"type": "object", "minProperties": 10**9}}), None),
        ("long_regex", "/generate", so({"regex": "." * 30_000}), None),  # ~30 s of compile: past the bound
        ("huge_repeat", "/generate", so({"regex": "x{1,10000000}"}), None),
        ("deep_text", "/generate", so({"json": "[" * 20_000 + "]" * 20_000}), None),
        # a few of each: every new one is a compile (in the API process's one compile process, which the
        # other compiles then wait for); their verdicts are remembered after
        ("invalid_regex", "/generate", so({"regex": "[a-" + str(rng.randrange(8))}), None),
        ("invalid_schema", "/generate", so({"json": {"type": f"objec{rng.randrange(8)}"}}), None),
        ("logprobs_past_cap", "/v1/completions", {**v1, "prompt": [5] * 100, "n": 128, "echo": True,
                                                  "logprobs": 20, "max_tokens": 0}, None),
        ("logit_bias_key", "/v1/completions", {**v1, "logit_bias": {rng.choice([" 5", "\u0663", "+5"]): 1.0}}, None),
        ("choice", "/generate", so({"choice": ["yes", "no", "maybe"]}), r"yes|no|maybe"),
        ("regex", "/generate", so({"regex": "[a-z]{1,6}"}), r"[a-z]{1,6}"),
    ]
    return rng.choice(cases)


class Tally:
    def __init__(self) -> None:
        self.status: dict[str, Counter] = {k: Counter() for k in ("valid", "malformed", "dropped", "burst", "hostile")}
        self.counts = Counter()
        self.examples: dict[str, list] = {}

    def bad(self, key: str, detail) -> None:
        self.counts[key] += 1
        ex = self.examples.setdefault(key, [])
        if len(ex) < 5:
            ex.append(detail)


def check_json(body: dict, req: dict) -> str | None:
    n = len(body.get("token_ids", []))
    if body.get("finish_reason") not in ("stop", "length"):
        return f"finish_reason {body.get('finish_reason')!r}"
    if n > req["max_tokens"] or body["usage"]["completion_tokens"] != n:
        return f"{n} tokens, usage {body['usage']}, max_tokens {req['max_tokens']}"
    if body["finish_reason"] == "length" and n != req["max_tokens"] and req.get("ignore_eos"):
        return f"length with {n} of {req['max_tokens']} tokens"
    return None


def check_events(events: list, req: dict) -> str | None:
    if not events or events[-1] != "[DONE]" or len(events) < 2:
        return "stream not ended by [DONE]"
    final = events[-2]
    if not final.get("finished"):
        return "no final event"
    tokens = [t for e in events[:-2] for t in e["token_ids"]]
    return check_json({"token_ids": tokens, "finish_reason": final.get("finish_reason"),
                       "usage": final.get("usage", {})}, req)


async def one_valid(c: httpx.AsyncClient, req: dict, kind: str, t: Tally) -> None:
    try:
        if req["stream"]:
            async with c.stream("POST", "/generate", json=req) as r:
                if r.status_code != 200:
                    await r.aread()
                    status_of(r, kind, t)
                    return
                events = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
            t.status[kind][200] += 1
            problem = check_events(events, req)
        else:
            r = await c.post("/generate", json=req)
            if r.status_code != 200:
                status_of(r, kind, t)
                return
            t.status[kind][200] += 1
            problem = check_json(r.json(), req)
        if problem:
            t.bad("wrong_responses", {"request": req, "problem": problem})
    except httpx.HTTPError as e:
        t.status[kind]["transport_error"] += 1
        t.bad("lost", {"request": req, "error": repr(e)})


def status_of(r: httpx.Response, kind: str, t: Tally) -> None:
    t.status[kind][r.status_code] += 1
    if r.status_code == 503 and r.headers.get("retry-after"):
        return  # a rejection under load: allowed
    if r.status_code >= 500:
        t.bad("valid_5xx", {"status": r.status_code, "body": r.text[:300]})
    elif r.status_code != 200:
        t.bad("wrong_responses", {"status": r.status_code, "body": r.text[:300]})


async def one_malformed(c: httpx.AsyncClient, name: str, raw: bytes, t: Tally) -> None:
    try:
        r = await c.post("/generate", content=raw, headers={"content-type": "application/json"})
    except httpx.HTTPError as e:
        t.status["malformed"]["transport_error"] += 1
        t.bad("lost", {"malformed": name, "error": repr(e)})
        return
    t.status["malformed"][r.status_code] += 1
    if not 400 <= r.status_code < 500:
        t.bad("malformed_not_4xx", {"malformed": name, "status": r.status_code, "body": r.text[:300]})


async def one_hostile(c: httpx.AsyncClient, case: tuple, t: Tally) -> None:
    name, path, body, pattern = case
    try:
        r = await c.post(path, json=body)
    except httpx.HTTPError as e:
        t.status["hostile"]["transport_error"] += 1
        t.bad("lost", {"hostile": name, "error": repr(e)})
        return
    t.status["hostile"][r.status_code] += 1
    if r.status_code == 503 and r.headers.get("retry-after"):
        return  # turned away under load, as any request may be
    text = r.json().get("text") if r.status_code == 200 else None
    if (pattern is None and r.status_code != 400) or (pattern is not None and (
            r.status_code != 200 or not re.fullmatch(pattern, text or ""))):
        t.bad("hostile_wrong", {"hostile": name, "status": r.status_code, "body": r.text[:300]})


async def one_dropped(c: httpx.AsyncClient, rng: random.Random, a, t: Tally) -> None:
    req = {**valid_body(rng, a), "max_tokens": a.max_tokens, "ignore_eos": True}
    try:
        if rng.random() < 0.5:  # a stream closed after a few events
            req["stream"] = True
            keep = rng.randint(1, 3)
            async with c.stream("POST", "/generate", json=req) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= keep and line != "data: [DONE]":
                        t.status["dropped"]["dropped"] += 1
                        return  # hang up mid-stream
        else:  # a plain request whose client gives up
            req["stream"] = False
            await asyncio.wait_for(c.post("/generate", json=req), timeout=rng.uniform(0.01, 0.3))
        t.status["dropped"]["finished_before_drop"] += 1
    except (asyncio.TimeoutError, httpx.HTTPError):
        t.status["dropped"]["dropped"] += 1


async def soak(url: str, a, t: Tally) -> dict:
    rng = random.Random(a.seed)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    limits = httpx.Limits(max_connections=a.concurrency + a.burst_size + 8, max_keepalive_connections=a.concurrency)
    sem = asyncio.Semaphore(a.concurrency)
    deadline = time.monotonic() + a.time_limit
    sent = 0
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=a.request_timeout) as c:
        tasks: set[asyncio.Task] = set()

        async def gated(coro):
            async with sem:
                await coro

        while sent < a.requests and time.monotonic() < deadline:
            if a.burst_every and sent and sent % a.burst_every == 0 and sent + a.burst_size <= a.requests:
                burst = [one_valid(c, {**valid_body(rng, a), "stream": False}, "burst", t) for _ in range(a.burst_size)]
                sent += len(burst)
                await asyncio.gather(*burst)  # all at once, beyond the queue limit
                continue
            r = rng.random()
            if r < a.malformed:
                name, raw = malformed(rng, a)
                coro = one_malformed(c, name, raw, t)
            elif r < a.malformed + a.dropped:
                coro = one_dropped(c, random.Random(rng.random()), a, t)
            elif r < a.malformed + a.dropped + a.hostile:
                coro = one_hostile(c, hostile(rng, a), t)
            else:
                coro = one_valid(c, valid_body(rng, a), "valid", t)
            await sem.acquire()  # keep `concurrency` in flight
            sem.release()
            task = asyncio.ensure_future(gated(coro))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            sent += 1
            await asyncio.sleep(0)
        if tasks:
            await asyncio.gather(*tasks)
    return {"sent": sent, "stopped_by_time_limit": sent < a.requests}


def wait_idle(url: str, headers: dict, timeout: float = 30.0) -> dict:
    """The server's /debug/kv once nothing is in flight (aborts land at the engine's next step)."""
    deadline = time.monotonic() + timeout
    while True:
        k = httpx.get(url + "/debug/kv", headers=headers, timeout=10).json()
        idle = k["requests_active"] == 0 and k["engine_sequences"] == 0
        if (idle and k["kv_blocks_free"] == k["kv_blocks_total"]) or time.monotonic() > deadline:
            return k
        time.sleep(0.1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_argument_group("server (one of)")
    src.add_argument("--url", help="a running server on 127.0.0.1 (loopback only)")
    src.add_argument("--model", help="start a server on this checkpoint (default: the embedded model, if built)")
    p.add_argument("--pid", type=int, help="with --url: the server's pid, for its resident memory")
    p.add_argument("--api-key", default=os.environ.get("FLASHPAGE_API_KEY"))
    p.add_argument("--requests", type=int, default=3000, help="requests to send (bursts included)")
    p.add_argument("--time-limit", type=float, default=600.0, help="stop sending after this many seconds")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--burst-every", type=int, default=250, help="a burst after every this many requests (0 = none)")
    p.add_argument("--burst-size", type=int, default=48)
    p.add_argument("--malformed", type=float, default=0.1, help="share of malformed requests")
    p.add_argument("--dropped", type=float, default=0.1, help="share of requests dropped by the client")
    p.add_argument("--hostile", type=float, default=0.05,
                   help="share of hostile structured-output specs and large asks (and valid constrained requests)")
    p.add_argument("--max-tokens", type=int, default=32, help="largest max_tokens of a valid request")
    p.add_argument("--request-timeout", type=float, default=120.0, help="client timeout per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=0, help="token ids of valid prompts are below it (0 = ask the server)")
    p.add_argument("--out", help="also write the report here (JSON)")
    own = p.add_argument_group("own server (without --url)")
    own.add_argument("--num-blocks", type=int, default=24, help="a small KV cache: requests must queue and preempt")
    own.add_argument("--max-waiting-requests", type=int, default=16)
    own.add_argument("--max-body-bytes", type=int, default=None,
                     help="the server's limit (own server: 65536; with --url give the server's, default 1 MiB)")
    own.add_argument("--max-prompt-chars", type=int, default=None,
                     help="the server's limit (own server: 4096; with --url give the server's, default 65536)")
    own.add_argument("--server-arg", action="append", default=[], help="extra argument for `python -m server`")
    return p


def report(result: dict) -> str:
    """A soak result file's runs as one table (make_report): what was sent and how it was answered,
    and every count that must be zero."""
    out = [result.get("note", ""), "",
           "| seed | hostile share | sent | completed | 503 | valid 5xx | lost | wrong | leaked blocks | "
           "RSS start → end | exit | ok |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in result["rows"]:
        wrong = r["wrong_responses"] + r["hostile_wrong"] + r["malformed_not_4xx"]
        out.append(f"| {r['seed']} | {r['hostile']} | {r['sent']} | {r['completed']} | {r['rejected_503']} | "
                   f"{r['valid_5xx']} | {r['lost']} | {wrong} | {r['leaked_blocks']} | "
                   f"{r['rss_start_mib']:.0f} → {r['rss_end_mib']:.0f} MiB | {r['server_exit_code']} | {r['ok']} |")
    return "\n".join(out).lstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    server = None
    a.max_body_bytes = a.max_body_bytes or (1 << 20 if a.url else 65536)
    a.max_prompt_chars = a.max_prompt_chars or (65536 if a.url else 4096)
    if a.url:
        host = urlparse(a.url).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            sys.exit("soak.py talks to loopback servers only")
        url, pid = a.url.rstrip("/"), a.pid
    else:
        model = a.model
        if model is None and not (REPO_ROOT / "models" / "embedded" / "config.json").exists():
            sys.exit("give --model PATH (the embedded model is not built) or --url")
        args = (["--model", model] if model else []) + [
            "--num-blocks", str(a.num_blocks), "--max-waiting-requests", str(a.max_waiting_requests),
            "--max-body-bytes", str(a.max_body_bytes), "--max-prompt-chars", str(a.max_prompt_chars),
            *(["--api-key", a.api_key] if a.api_key else []), *a.server_arg]
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"flashpage-soak-{os.getpid()}.log"
        server = ServerProcess.python_server(args, log_path).wait_healthy(180)
        url, pid = server.url, server.pid
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    try:
        models = httpx.get(url + "/v1/models", headers=headers, timeout=10)
        card = models.json()["data"][0] if models.status_code == 200 else {}
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        card = {}
    a.context = int(card.get("max_model_len", 1024))
    a.model_name = card.get("id", "")
    a.vocab_size = a.vocab_size or _vocab_size(url, headers)

    t = Tally()
    rss_start = rss_bytes(pid)
    t0 = time.monotonic()
    try:
        run = asyncio.run(soak(url, a, t))
        elapsed = time.monotonic() - t0
        k = wait_idle(url, headers)
        rss_end = rss_bytes(pid)
    finally:
        exit_code = server.stop(60) if server else None
    t.counts["leaked_blocks"] = k["kv_blocks_total"] - k["kv_blocks_free"]
    t.counts["leaked_requests"] = k["requests_active"] + k["engine_sequences"]
    completed = sum(s[200] for s in t.status.values()) + t.status["dropped"]["finished_before_drop"]
    report = {
        "url": url, "seconds": round(elapsed, 1), **run,
        "completed": completed,
        "rejected_503": t.status["valid"][503] + t.status["burst"][503],
        "status": {kind: {str(code): n for code, n in sorted(c.items(), key=str)} for kind, c in t.status.items()},
        **{key: t.counts[key] for key in MUST_BE_ZERO},
        "kv": k, "preemptions": k.get("preemptions"),
        "rss_start_mib": None if rss_start is None else round(rss_start / 2**20, 1),
        "rss_end_mib": None if rss_end is None else round(rss_end / 2**20, 1),
        "server_exit_code": exit_code,
        "examples": t.examples,
    }
    failed = [key for key in MUST_BE_ZERO if report[key]]
    if server is not None and exit_code != 0:
        failed.append("server_exit_code")
    report["ok"] = not failed
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    if failed:
        print(f"soak FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _vocab_size(url: str, headers: dict) -> int:
    """The largest id the server accepts, found from its own 400 message (no extra endpoint needed)."""
    r = httpx.post(url + "/generate", json={"prompt_token_ids": [10**9], "max_tokens": 1}, headers=headers, timeout=30)
    try:
        msg = r.json()["error"]["message"]  # "... outside the vocabulary [0, V)"
        return int(msg.rsplit(", ", 1)[1].rstrip(")"))
    except (ValueError, KeyError, IndexError):
        sys.exit(f"could not learn the vocabulary size from the server ({r.status_code}: {r.text[:200]}); "
                 "give --vocab-size")


if __name__ == "__main__":
    sys.exit(main())
