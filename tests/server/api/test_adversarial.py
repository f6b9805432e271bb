"""Issue 23, hardening: what an adversarial client still broke, each case re-run against a real
server (a subprocess on loopback, a random tiny checkpoint) and answered as docs/api.md documents;
after each, /health answers 200 and every KV block is free. (Case 8, impossible settings, is the
CLI's: tests/server/test_cli.py; the sampler's side of case 1 is in tests/server/worker/test_sampler.py.)

One server for all: a waiting queue of 8 and 4 sequences a step (case 3 can fill it), short
connection timeouts (case 6), log level info (case 5 reads the log back); body and header limits
at their defaults (1 MiB, 16 KiB).
"""

import asyncio
import json
import socket
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from benchmarks.serving import slow_clients
from benchmarks.shared.common import ServerProcess

KEEP_ALIVE, HEADER, BODY = 2.0, 1.0, 3.0  # the server's connection timeouts (seconds)


@pytest.fixture(scope="module")
def srv(tiny_ckpt):
    s = ServerProcess.python_server([
        "--model", str(tiny_ckpt), "--device", "cpu", "--num-blocks", "64", "--max-waiting-requests", "8",
        "--max-num-seqs", "4", "--keep-alive-timeout", str(KEEP_ALIVE), "--header-timeout", str(HEADER),
        "--body-timeout", str(BODY), "--log-level", "info"]).wait_healthy(120)
    yield s
    s.stop(30, must_exit=True)


@pytest.fixture(scope="module")
def url(srv):
    return srv.url


@pytest.fixture(scope="module")
def model(url):
    return httpx.get(url + "/v1/models").json()["data"][0]["id"]


@pytest.fixture(autouse=True)
def healthy_and_all_free(url):
    """After each case: /health 200, no request in flight, every KV block free."""
    yield
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 15
    while True:  # aborts land at the engine's next step
        k = httpx.get(url + "/debug/kv", timeout=10).json()
        if k["kv_blocks_free"] == k["kv_blocks_total"] and k["requests_active"] == k["engine_sequences"] == 0:
            return
        assert time.monotonic() < deadline, f"blocks or requests leaked: {k}"
        time.sleep(0.05)


@contextmanager
def health_latencies(url: str):
    """Times GET /health every 20 ms while the block runs: the list of seconds it yields fills in
    (None for an answer other than 200)."""
    out: list = []
    done = threading.Event()

    def probe():
        with httpx.Client(base_url=url, timeout=30) as c:
            while not done.is_set():
                t = time.perf_counter()
                ok = c.get("/health").status_code == 200
                out.append(time.perf_counter() - t if ok else None)
                time.sleep(0.02)

    thread = threading.Thread(target=probe)
    thread.start()
    time.sleep(0.1)  # a probe or two before the load
    try:
        yield out
    finally:
        done.set()
        thread.join()


# -- 1: a tiny positive temperature is greedy, never NaN -> token 0 -----------------------------------
def test_sub_epsilon_temperature_is_greedy(url, model):
    body = {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 8, "ignore_eos": True}
    greedy = httpx.post(url + "/generate", json={**body, "temperature": 0}).json()["token_ids"]
    assert greedy != [0] * 8
    for t in (1e-40, 1e-38, 1e-6):
        r = httpx.post(url + "/generate", json={**body, "temperature": t})
        assert r.status_code == 200 and r.json()["token_ids"] == greedy, (t, r.text)
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).completions.create(
        model=model, prompt=[5, 6, 7, 8], max_tokens=8, temperature=1e-40, extra_body={"ignore_eos": True})
    assert c.choices[0].text == httpx.post(url + "/generate", json={**body, "temperature": 0}).json()["text"]


# -- 2: every oversized body gets its 413, also under concurrency ------------------------------------
def test_oversized_bodies_get_413_not_a_reset(url):
    big = json.dumps({"prompt": "x" * (2 << 20)}).encode()  # 2 MiB: still being sent when the 413 is due

    async def burst():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            async def one(kw):
                try:
                    return (await c.post("/generate", **kw)).status_code
                except httpx.HTTPError as e:
                    return type(e).__name__  # before the fix: ReadError (connection reset) for most
            over = {"content": big, "headers": {"content-type": "application/json"}}
            normal = {"json": {"prompt_token_ids": [5, 6], "max_tokens": 2}}
            return await asyncio.gather(*[one(over) for _ in range(16)], *[one(normal) for _ in range(4)])

    codes = asyncio.run(burst())
    assert Counter(codes) == Counter({413: 16, 200: 4}), codes

    def chunks():  # no Content-Length: refused once past the limit, the rest read and dropped
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)]
    r = httpx.post(url + "/generate", content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]

    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as s:
        # A client that waits for "100 Continue" is answered at once, and the body is never sent.
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 5000000\r\nExpect: 100-continue\r\n\r\n")
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower()


# -- 3: a request that can never be admitted is a 400; one that cannot be now, a 503 -------------------
def test_choices_beyond_the_waiting_queue_are_400_and_a_full_queue_503(url, model):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=2)  # the SDK retries 503s, not 400s
    hi = [{"role": "user", "content": "hi"}]
    for call in (lambda: client.completions.create(model=model, prompt=["a", "b", "c"], n=3, max_tokens=1),
                 lambda: client.chat.completions.create(model=model, n=9, messages=hi)):  # before any rendering
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert "--max-waiting-requests" in str(e.value) and "8" in str(e.value)
    assert len(client.completions.create(model=model, prompt=["a", "b"], n=4, max_tokens=1).choices) == 8  # fits

    async def full_queue():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            first = asyncio.ensure_future(c.post("/v1/completions", json={
                "model": model, "prompt": [5, 6], "n": 8, "max_tokens": 100, "ignore_eos": True}))
            while (await c.get("/debug/kv")).json()["requests_waiting"] < 4:  # 4 sequences run, 4 wait
                await asyncio.sleep(0.01)
            now = await c.post("/v1/completions", json={"model": model, "prompt": "hi", "n": 5, "max_tokens": 1})
            # an echo of the prompt alone needs no place in the queue: answered while it is full
            echo = await c.post("/v1/completions", json={"model": model, "prompt": "hi", "n": 5, "max_tokens": 0,
                                                         "echo": True})
            return now, echo, await first

    now, echo, first = asyncio.run(full_queue())
    assert echo.status_code == 200 and [ch["text"] for ch in echo.json()["choices"]] == ["hi"] * 5, echo.text
    assert now.status_code == 503 and int(now.headers["retry-after"]) >= 1, now.text
    assert "waiting" in now.json()["error"]["message"]
    assert first.status_code == 200 and len(first.json()["choices"]) == 8


# -- 4: caps before any per-prompt work; tokenizing off the event loop --------------------------------
def test_caps_come_before_work_and_tokenizing_never_stalls_the_loop(url, model):
    many = json.dumps({"model": model, "prompt": [""] * 300_000, "max_tokens": 1}, separators=(",", ":")).encode()
    assert len(many) < 1 << 20  # within --max-body-bytes: the prompt count is what must stop it
    with health_latencies(url) as latencies:
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", content=many, headers={"content-type": "application/json"}, timeout=60)
        took = time.monotonic() - t0
    assert r.status_code == 400 and "1024" in r.json()["error"]["message"], r.text
    assert took < 2.0  # was 18 s: 300,000 prompts tokenized before the count was checked
    assert None not in latencies and max(latencies) < 0.3, latencies

    # 3 requests x 8 prompts of 60,000 characters: ~0.3 s of tokenizing each, which on the event loop
    # held /health up for 0.57 s here (off it: 10-30 ms). Each then is a 400 (over the context).
    words = "The quick brown fox jumps over the lazy dog . Return a new list of the items naïve café".split()
    text = " ".join(words[(i * 7) % len(words)] for i in range(12_000))[:60_000]
    body = {"model": model, "prompt": [text] * 8, "max_tokens": 1}

    async def together():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(3)])

    with health_latencies(url) as latencies:
        rs = asyncio.run(together())
    assert all(r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded" for r in rs)
    assert None not in latencies and max(latencies) < 0.3, latencies


# -- 5: client strings reach the log escaped and bounded -------------------------------------------------
def test_client_strings_in_the_log_are_escaped_and_bounded(srv, url, model):
    forged = "FORGED 2026-01-01 00:00:00,000 INFO flashpage.http: POST /admin 200"
    for user in (f"x\n{forged}", "u" * 200_000, "bell\x07\x1b[31mred\u2028sep"):
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1, "user": user})
        assert r.status_code == 200
    assert httpx.get(url + "/nowhere%0A" + forged.replace(" ", "%20")).status_code == 404
    time.sleep(0.3)  # the lines reach the log
    lines = srv.log_text().splitlines()
    assert not [line for line in lines if line.startswith("FORGED")]
    assert all(len(line) < 5000 for line in lines), max(map(len, lines))
    text = "\n".join(lines)
    assert f"user=x\\n{forged}" in text and "/nowhere\\nFORGED" in text  # escaped, on the line it belongs to
    assert "user=" + "u" * 200 + "...(+199800 chars)" in text
    assert "\x07" not in text and "\x1b" not in text and "\u2028" not in text


# -- 6: idle and half-sent connections are timed out; /health keeps answering -----------------------------
def test_slow_and_idle_connections_are_closed_in_time(url, tmp_path):
    out = tmp_path / "slow.json"
    rc = slow_clients.main(["--url", url, "--connections", "200", "--keep-alive-timeout", str(KEEP_ALIVE),
                            "--header-timeout", str(HEADER), "--body-timeout", str(BODY), "--trickle", "0.3",
                            "--health-budget-ms", "500", "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["ok"], report
    assert report["health_failed"] == 0 and report["health_probes"] > 0
    assert all(n == 0 for n in report["left_open"].values())


# -- 7: request line and headers are bounded -----------------------------------------------------------
def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_headers_over_the_limit_are_431_and_never_buffered(srv, url):
    assert httpx.get(url + "/health", headers={"x-pad": "a" * 8000}).status_code == 200
    for size in (17_000, 1 << 20):
        r = httpx.get(url + "/health", headers={"x-pad": "a" * size})
        assert r.status_code == 431 and "--max-header-bytes" in r.json()["error"]["message"]
    assert httpx.get(url + "/health", params={"q": "a" * 20_000}).status_code == 431  # the request line counts
    rss = _rss_bytes(srv.pid)
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # a header that never ends
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        sent = 0
        with pytest.raises(OSError):  # the server answers 431 and closes: the sender hits a closed socket
            while sent < 64 << 20:
                s.sendall(b"a" * (1 << 20))
                sent += 1 << 20
    assert sent < 16 << 20
    assert _rss_bytes(srv.pid) - rss < 32 << 20  # was +388 MiB for a 200 MiB header


# -- 9: JSON nested too deep is a 400 that says so --------------------------------------------------
def test_deeply_nested_json_is_400_saying_how_deep(url, model):
    for path, raw in (("/generate", b"[" * 1000 + b"]" * 1000),
                      ("/v1/completions", b'{"model": "m", "prompt": ' + b"[" * 70 + b"1" + b"]" * 70 + b"}")):
        r = httpx.post(url + path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "levels deep" in message and "64" in message, message
    # Brackets inside strings are text, not nesting.
    r = httpx.post(url + "/generate", json={"prompt": "[" * 100, "max_tokens": 1})
    assert r.status_code == 200, r.text
