"""tests/server/api/bystanders.py's own check: what it takes out of a probe's time (the run-queue
waits, HEALTH_BOUND_S) cannot hide an event loop blocked by its own work."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.api.bystanders import bystanders

_BLOCKING_SERVER = r"""
import sys, time
import uvicorn
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    if scope["path"] == "/block":  # the event loop works 200 ms of CPU before it answers
        t = time.thread_time()
        while time.thread_time() - t < 0.2:
            pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", lifespan="off")
"""


def test_the_health_bound_fails_on_a_loop_blocked_for_200_ms():
    """Against a server whose event loop works 200 ms of CPU on each POST /block (two of them in
    the window), `bystanders` fails on the own-time bound, having seen ~200 ms of server time: the
    run-queue waits it takes out (HEALTH_BOUND_S) do not hide the block, also when the server's other
    "API process" (here a process that only spins, so that it waits for a CPU on a loaded host) is
    listed beside the one holding the probe's connection."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fake = subprocess.Popen([sys.executable, "-c", _BLOCKING_SERVER, str(port)])
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        srv = type("Fake", (), {"url": f"http://127.0.0.1:{port}", "pid": fake.pid})
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(srv.url + "/health")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        for loops in ([fake.pid], [spinner.pid, fake.pid]):
            with pytest.raises(AssertionError, match=r"/health took (\d\.\d+) s of server time") as e:
                with bystanders(srv, loops=loops):
                    for _ in range(2):
                        time.sleep(0.2)
                        httpx.post(srv.url + "/block", timeout=10)
            assert float(re.search(r"took (\d\.\d+) s", str(e.value))[1]) > 0.15, str(e.value)
    finally:
        for p in (fake, spinner):
            p.kill()
            p.wait()
