"""Issue 44, hardening round two: what an adversarial client still broke (structured outputs, several
API processes, large answers), each case re-run against a real server on loopback.

During each case a bystander probes the server: GET /health every 20 ms, each answered within
100 ms, and plain completions one after another, each within 2 s of its time alone (measured just
before the case). After each case /health answers and every KV block is free.

One server for all: two API processes (case 2 kills one), the tiny checkpoint, and structured-output
bounds raised past issue 44's crasher (a $ref chain 4,000 deep, which must reach XGrammar to show
that a crash there costs only its own request) with a short compile deadline.
"""

import json
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import psutil
import pytest

from benchmarks.common import ServerProcess
from tests.server.engine.test_grammar_bounds import ref_chain

COMPILE_TIMEOUT = 5.0  # the server's --structured-compile-timeout (seconds)
DEPTH = 12_500  # its --max-structured-depth: issue 44's crasher nests 12,003 deep
PLAIN = {"prompt_token_ids": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
HEALTH_BOUND_S, PLAIN_SLACK_S = 0.1, 2.0


@pytest.fixture(scope="module")
def srv(tiny_ckpt):
    s = ServerProcess.python_server([
        "--model", str(tiny_ckpt), "--device", "cpu", "--num-blocks", "64", "--api-server-count", "2",
        "--max-structured-depth", str(DEPTH), "--max-structured-spec-bytes", "1MiB",
        "--structured-compile-timeout", str(COMPILE_TIMEOUT)]).wait_healthy(180)
    yield s
    s.stop(30, must_exit=True)


@pytest.fixture(scope="module")
def url(srv):
    """The server, warmed: each API process's compile process and the engine's grammar process
    started (seconds of imports each, which would otherwise land in the first case's window)."""
    deadline = time.monotonic() + 300
    for i in range(100):
        r = httpx.post(srv.url + "/generate", json={"prompt": "hi", "max_tokens": 2, "structured_outputs": {
            "regex": f"[a-z]{{{i + 1}}}"}}, headers={"connection": "close"}, timeout=300)
        assert r.status_code == 200, r.text
        if len(compile_processes(srv)) == 2 or time.monotonic() > deadline:
            break
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


def api_processes(srv) -> list[psutil.Process]:
    kids = psutil.Process(srv.pid).children(recursive=True)
    return [p for p in kids if any(c.status == psutil.CONN_LISTEN for c in p.net_connections("tcp"))]


def compile_processes(srv) -> list[psutil.Process]:
    return [p for p in psutil.Process(srv.pid).children(recursive=True)
            if "grammar_compile" in " ".join(p.cmdline())]


def plain_time(url: str) -> float:
    """A plain completion's time alone, now: the median of three."""
    times = []
    with httpx.Client(base_url=url, timeout=60) as c:
        for _ in range(3):
            t = time.perf_counter()
            assert c.post("/generate", json=PLAIN).status_code == 200
            times.append(time.perf_counter() - t)
    return sorted(times)[1]


_BYSTANDER = r"""
import json, sys, threading, time
import httpx
url, plain, stop = sys.argv[1], json.loads(sys.argv[2]), time.monotonic() + 600
seen = {"health": [], "plain": [], "lost": 0}
def timed(name, call):
    c = httpx.Client(base_url=url, timeout=60)
    while time.monotonic() < stop:
        t = time.perf_counter()
        try:
            ok = call(c).status_code == 200
        except httpx.TransportError:  # its connection's process was killed (case 2): a new connection
            seen["lost"] += 1
            c.close()
            c = httpx.Client(base_url=url, timeout=60)
            continue
        seen[name].append(time.perf_counter() - t if ok else None)
        time.sleep(0.02 if name == "health" else 0)
    c.close()
threading.Thread(target=timed, args=("health", lambda c: c.get("/health")), daemon=True).start()
threading.Thread(target=timed, args=("plain", lambda c: c.post("/generate", json=plain)), daemon=True).start()
print("started", flush=True)
sys.stdin.readline()  # until the test is done with the case
stop = 0
time.sleep(0.05)
print(json.dumps(seen), flush=True)
"""


@contextmanager
def bystanders(url: str, connections_may_drop: bool = False):
    """While the block runs, in a process of their own (so that the test's own work never delays
    them): GET /health every 20 ms and plain completions one after another, each timed (None: not
    answered 200). After it: every /health within HEALTH_BOUND_S, every completion within
    PLAIN_SLACK_S of its time alone, and no connection lost (unless `connections_may_drop`: a killed
    API process takes its own connections with it; the bystander then connects again)."""
    normal = plain_time(url)
    proc = subprocess.Popen([sys.executable, "-c", _BYSTANDER, url, json.dumps(PLAIN)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        time.sleep(0.1)
        yield
        proc.stdin.write("\n")
        proc.stdin.flush()
        seen = json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    health, plain = seen["health"], seen["plain"]
    assert health and None not in health and max(health) < HEALTH_BOUND_S, sorted(health)[-5:]
    assert plain and None not in plain and max(plain) < normal + PLAIN_SLACK_S, (normal, plain)
    assert connections_may_drop or not seen["lost"], seen["lost"]


def structured(url: str, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


# -- 1: a schema that crashes XGrammar is a 400; nothing else notices -------------------------------
def test_a_schema_that_crashes_the_compiler_fails_alone(srv, url, model):
    before = {p.pid for p in api_processes(srv)}
    deep = ref_chain(4200)  # nests 12,603 deep: over --max-structured-depth, refused before any compile
    crasher = ref_chain(4000)  # 12,003: within it here, and XGrammar overflows its stack on it
    with bystanders(url):
        r = structured(url, "/generate", {"prompt": "hi", "max_tokens": 4, "structured_outputs": {"json": deep}})
        assert r.status_code == 400 and "--max-structured-depth" in r.json()["error"]["message"], r.text
        r = structured(url, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}],
                       "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": crasher}}})
        err = r.json()["error"]
        assert r.status_code == 400 and "crashed the grammar compiler" in err["message"], r.text
        assert err["param"] == "response_format"
        text = "[" * 20_000 + "]" * 20_000  # as text it escapes the body's nesting bound: Python's json gave up (500)
        r = structured(url, "/generate", {"prompt": "hi", "structured_outputs": {"json": text}})
        assert r.status_code == 400 and "nests too deep" in r.json()["error"]["message"], r.text
        for _ in range(2):  # again (at once where that process remembers it), on any route
            r = structured(url, "/v1/completions", {"model": model, "prompt": "hi", "structured_outputs": {"json": crasher}})
            assert r.status_code == 400 and "crashed" in r.json()["error"]["message"], r.text
        ok = structured(url, "/generate", {"prompt": "hi", "max_tokens": 8, "temperature": 0,
                                           "structured_outputs": {"choice": ["yes", "no"]}})
        assert ok.status_code == 200 and ok.json()["text"] in ("yes", "no"), ok.text
    assert srv.proc.poll() is None and {p.pid for p in api_processes(srv)} == before  # no process died


# -- 2: a dead API process is replaced; the engine and the other process serve on -----------------------
def test_a_dead_api_process_is_replaced_and_nothing_else_is_lost(srv, url):
    """Before: the engine's next write to the dead process's pipe raised BrokenPipeError, the engine
    exited, and the other API process with it, its streams cut off."""
    before = api_processes(srv)
    body = {"prompt": "hi", "max_tokens": 60, "ignore_eos": True, "stream": True}
    results: list = []

    def stream():
        try:
            with httpx.stream("POST", url + "/generate", json=body, timeout=120) as r:
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
            results.append(len(events))
        except httpx.TransportError:  # on the killed process
            results.append("cut")

    with bystanders(url, connections_may_drop=True):
        streams = [threading.Thread(target=stream) for _ in range(8)]
        for t in streams:
            t.start()
        deadline = time.monotonic() + 60
        while httpx.get(url + "/debug/kv").json()["requests_running"] < 8:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        before[0].kill()
        for t in streams:
            t.join()
        while {p.pid for p in api_processes(srv)} in ({p.pid for p in before[1:]}, {p.pid for p in before}):
            assert time.monotonic() < deadline + 120, "no API process started in place of the dead one"
            time.sleep(0.2)
    # every stream on the live process ran to its end (60 tokens, the final event, [DONE]); those on
    # the dead one were cut, and the engine aborted them (the autouse check: every block free)
    assert set(results) <= {62, "cut"} and results.count(62) >= 1, results
    after = api_processes(srv)
    assert len(after) == 2 and srv.proc.poll() is None and before[1].pid in {p.pid for p in after}
