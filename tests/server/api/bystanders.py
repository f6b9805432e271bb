"""The bystander of the hardening tests (tests/server/api/test_hardening.py): while a case runs, a
process of its own probes the server, GET /health every 20 ms and plain completions one after
another, and afterwards `bystanders` asserts what the issue asks of them (HEALTH_BOUND_S says how a
probe's time is counted on a shared host). Its own check, that the count cannot hide a blocked
event loop: tests/server/api/test_bystanders.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
import psutil

PLAIN = {"prompt_token_ids": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
# /health: the issue asks that a concurrent probe stay under 100 ms during each case. Here a probe's
# time is the host's too: ~8 engineers share its 2 cores (load 3-10), and a thread ready to run waits
# in the kernel's run queue for one. So every probe must answer within HEALTH_BOUND_S of server time:
# its whole time less the run-queue waits, during that probe, of the probing thread and of the event
# loop's thread in the API process that holds the probe's connection (/proc/<tid>/schedstat's second
# field; nothing is taken out where there is none). Nothing else is: a loop thread that runs (its own
# work) or sleeps (a blocking call, the GIL, a lock) accrues no run-queue wait, so a loop blocked by
# 200 ms of its own work still shows ~200 ms (test_the_health_bound_fails_on_a_loop_blocked_for_200_ms;
# 0.18-0.20 s seen here, idle and beside 3-4 processes spinning on the 2 cores), less at most the
# probing thread's wait before its request went out (while it waits for the answer it sleeps). Only
# the serving process's loop counts: with two API processes, taking out the other's waits as well hid
# a 200 ms block beside 3 spinning processes (3 tries of 3). Measured on the shared host (load 3-10;
# then every API loop's waits were taken out, which for one API process is the same): server time
# was at most 27 ms in 162 cases; whole probes passed 100 ms in 5 of 210 cases on the one-process
# server (cases 1, 3 and 8; at most 335 ms, of which the probing thread had waited 333 ms for a
# CPU), and the API loop's longest stalls were 70-90% run-queue wait. Whole probes must still be
# within 100 ms at the median and 1 s each: a blocked event loop shows seconds (issue 44: 6.1 s).
HEALTH_BOUND_S, HEALTH_WORST_S, PLAIN_SLACK_S = 0.1, 1.0, 2.0


def server_processes(srv) -> list[psutil.Process]:
    return [psutil.Process(srv.pid)] + psutil.Process(srv.pid).children(recursive=True)


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
import httpx, psutil
url, plain, loops = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
stop = time.monotonic() + 600
seen = {"health": [], "plain": [], "lost": 0}
sys.setswitchinterval(0.0005)  # the two threads share a GIL: a probe must not wait 5 ms for it
def queued(tids):  # seconds each of these threads has waited for a CPU so far
    waits = {}
    for tid in tids:
        try:
            with open(f"/proc/{tid}/task/{tid}/schedstat") as f:
                waits[tid] = int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):  # gone (a killed API process), or no schedstat
            pass
    return waits
def holder(port):  # the API process (its pid: its loop's thread) holding our connection from `port`
    if len(loops) == 1:
        return loops[0]
    for pid in loops:
        try:
            if any(k.raddr and k.raddr.port == port for k in psutil.Process(pid).net_connections("tcp")):
                return pid
        except psutil.Error:
            pass
    return None  # not found: only the probing thread's waits are taken out
def timed(name, call):
    me = threading.get_native_id()
    c, port, loop = httpx.Client(base_url=url, timeout=60), None, None
    while time.monotonic() < stop:
        t, q = time.perf_counter(), queued([me, *loops])
        try:
            r = call(c)
        except httpx.TransportError:  # counted: the case fails on it
            seen["lost"] += 1
            c.close()
            c = httpx.Client(base_url=url, timeout=60)
            continue
        took, now = time.perf_counter() - t, queued([me, *loops])
        if name == "health" and (p := r.extensions["network_stream"].get_extra_info("client_addr")[1]) != port:
            port, loop = p, holder(p)  # a new connection (the first, or one after a lost one)
        waited = sum(now[k] - q[k] for k in (me, loop) if k in q and k in now)
        seen[name].append(None if r.status_code != 200 else [took, took - waited] if name == "health" else took)
        time.sleep(0.02 if name == "health" else 0)
    c.close()
threading.Thread(target=timed, args=("health", lambda c: c.get("/health")), daemon=True).start()
threading.Thread(target=timed, args=("plain", lambda c: c.post("/generate", json=plain)), daemon=True).start()
print("started", flush=True)
sys.stdin.readline()  # until the test is done with the case
while not seen["plain"] and time.monotonic() < stop:  # at least one completion ran alongside
    time.sleep(0.02)
stop = 0
time.sleep(0.05)
print(json.dumps(seen), flush=True)
"""


def settle(srv, timeout: float = 30.0) -> None:
    """Until the server's processes are idle (under a quarter of a core together over a quarter of
    a second): a compile process replaced in the case before is still importing, and its CPU is not
    this case's."""
    procs = server_processes(srv)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = 0.0
        for p in procs:
            try:
                p.cpu_percent()
            except psutil.Error:
                pass
        time.sleep(0.25)
        for p in procs:
            try:
                busy += p.cpu_percent()
            except psutil.Error:
                pass
        if busy < 25:
            return


@contextmanager
def bystanders(srv, loops: list[int] | None = None, lost: int = 0):
    """While the block runs, in a process of their own (so that the test's own work never delays
    them): GET /health every 20 ms and plain completions one after another, each timed. After it:
    every probe answered 200 within HEALTH_BOUND_S less the run-queue waits of its thread and of the
    event loop of the one of `loops` (the API processes' pids; default: the server's own) holding
    its connection (see HEALTH_BOUND_S), whole probes within
    HEALTH_BOUND_S at the median and HEALTH_WORST_S each; at least one completion, each answered 200
    within PLAIN_SLACK_S of its time alone; at most `lost` connections lost. It starts once the server
    is idle (`settle`)."""
    url = srv.url
    settle(srv)
    normal = plain_time(url)
    proc = subprocess.Popen([sys.executable, "-c", _BYSTANDER, url, json.dumps(PLAIN), json.dumps(loops or [srv.pid])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
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
    assert health and None not in health, health
    whole = sorted(took for took, _ in health)
    worst = sorted(health, key=lambda h: h[1])[-3:]  # [whole, own]
    assert worst[-1][1] < HEALTH_BOUND_S, (f"/health took {worst[-1][1]:.3f} s of server time; "
                                           f"worst [whole, own]: {worst}")
    assert whole[len(whole) // 2] < HEALTH_BOUND_S and whole[-1] < HEALTH_WORST_S, whole[-5:]
    assert plain and None not in plain and max(plain) < normal + PLAIN_SLACK_S, (normal, plain)
    assert seen["lost"] <= lost, seen["lost"]
