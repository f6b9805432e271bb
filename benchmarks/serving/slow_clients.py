"""Slow and idle clients: does the server stay available, and does it close them in time? Loopback only.

    python -m benchmarks.serving.slow_clients --model PATH              # starts its own server (default flags)
    python -m benchmarks.serving.slow_clients --url http://127.0.0.1:8000 --keep-alive-timeout 5 ...
    python -m benchmarks.serving.slow_clients --connections 2000 --out slow.json

Opens `--connections` sockets at once, a third of each kind, and keeps them as an attacker would
(server/api/connections.py names the phases and their timeouts):
- idle: connected, sending nothing (closed after --keep-alive-timeout);
- head: half a request line and headers, then one more byte every `--trickle` seconds, so that
  the connection is never quiet (408 and closed --header-timeout after its first byte);
- body: whole headers announcing a 1000-byte body, part of it, then a byte every `--trickle`
  seconds (408 and closed --body-timeout after its headers).
Meanwhile a probe on a thread of its own (so that this process's own event loop, busy with the
slow clients, does not delay it) opens a fresh connection for `GET /health` every 100 ms and times
the answer.
Reported (JSON on stdout, and to --out): /health latency (p50, p90, p99, max), and per kind the longest time
until the server closed a connection and how many it left open past their timeout + `--slack`.
Exits 1 if /health failed or took over `--health-budget-ms`, or any connection outlived its timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from benchmarks.shared.common import REPO_ROOT, ServerProcess, percentile  # noqa: E402
from server.api.guards import ServerLimits  # noqa: E402  (the server's defaults are the expectations)

KINDS = ("idle", "head", "body")
HEAD = b"POST /generate HTTP/1.1\r\nHost: flashpage\r\nContent-Type: application/json\r\n"
BODY = HEAD + b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "'


async def slow_client(host: str, port: int, kind: str, trickle: float, opened: asyncio.Event,
                      stop_at: float) -> float | None:
    """Seconds from the start of its phase until the server closed the connection; None if it was
    still open at `stop_at` (monotonic)."""
    reader, writer = await asyncio.open_connection(host, port)
    if kind != "idle":
        writer.write(HEAD if kind == "head" else BODY)
    t0 = time.monotonic()
    opened.set()
    wait = random.uniform(0, trickle)  # the clients' bytes spread out in time, as unrelated clients' are
    try:
        while time.monotonic() < stop_at:
            try:
                data = await asyncio.wait_for(reader.read(65536), timeout=wait)
            except asyncio.TimeoutError:
                if kind != "idle":
                    writer.write(b"a")  # never quiet: only a deadline on the whole head or body ends it
                wait = trickle
                continue
            if not data:  # EOF: closed by the server (after a 408, for head and body)
                return time.monotonic() - t0
        return None
    except (ConnectionError, OSError):
        return time.monotonic() - t0
    finally:
        writer.close()


def probe_health(host: str, port: int) -> float | None:
    """Seconds for GET /health on a new connection; None if it failed or did not answer 200."""
    t0 = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: flashpage\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
    except OSError:
        return None
    return time.perf_counter() - t0 if data.startswith(b"HTTP/1.1 200") else None


def probe_while(host: str, port: int, seconds: float) -> list[float | None]:
    """/health latencies, one probe every 100 ms for `seconds`."""
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        out.append(probe_health(host, port))
        time.sleep(0.1)
    return out


async def run(url: str, a) -> dict:
    host, port = urlparse(url).hostname, urlparse(url).port
    timeouts = {"idle": a.keep_alive_timeout, "head": a.header_timeout, "body": a.body_timeout}
    stop_at = time.monotonic() + max(timeouts.values()) + a.slack + 5
    events = [asyncio.Event() for _ in range(a.connections)]
    kinds = [KINDS[i % 3] for i in range(a.connections)]
    clients = [asyncio.ensure_future(slow_client(host, port, k, a.trickle, e, stop_at)) for k, e in zip(kinds, events)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout=60)  # every one connected
    # Probed while every kind is still open.
    latencies = await asyncio.to_thread(probe_while, host, port, min(timeouts.values()) * 0.8)
    closed = await asyncio.gather(*clients, return_exceptions=True)
    ok = sorted(x for x in latencies if x is not None)
    report = {"url": url, "connections": {k: kinds.count(k) for k in KINDS}, "timeouts_s": timeouts,
              "health_probes": len(latencies), "health_failed": len(latencies) - len(ok),
              "health_ms": {**{f"p{q}": round(percentile(ok, q) * 1e3, 1) for q in (50, 90, 99)},
                            "max": round(ok[-1] * 1e3, 1)} if ok else None,
              "closed_after_s": {}, "left_open": {}}
    for kind in KINDS:
        times = [t for k, t in zip(kinds, closed) if k == kind]
        late = [t for t in times if not isinstance(t, float) or t > timeouts[kind] + a.slack]
        done = [t for t in times if isinstance(t, float)]
        report["closed_after_s"][kind] = {"min": round(min(done), 2), "max": round(max(done), 2)} if done else None
        report["left_open"][kind] = len(late)
    report["ok"] = bool(ok) and not report["health_failed"] and ok[-1] * 1e3 <= a.health_budget_ms and not any(
        report["left_open"].values())
    return report


def build_parser() -> argparse.ArgumentParser:
    d = ServerLimits()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", help="a running server on 127.0.0.1 (give its timeouts below)")
    p.add_argument("--model", help="start a server on this checkpoint (default: the embedded model)")
    p.add_argument("--connections", type=int, default=2000, help="slow connections, a third of each kind")
    p.add_argument("--trickle", type=float, default=1.0, help="seconds between the bytes a slow client sends")
    p.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout, help="the server's")
    p.add_argument("--header-timeout", type=float, default=d.header_timeout, help="the server's")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout, help="the server's")
    p.add_argument("--slack", type=float, default=1.5, help="seconds past its timeout a connection may take to close")
    p.add_argument("--health-budget-ms", type=float, default=100.0, help="slowest /health answer allowed")
    p.add_argument("--out", help="also write the report here (JSON)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    server = None
    if a.url:
        if urlparse(a.url).hostname not in ("127.0.0.1", "localhost"):
            sys.exit("slow_clients.py talks to loopback servers only")
        url = a.url.rstrip("/")
    else:
        args = (["--model", a.model] if a.model else []) + [
            "--keep-alive-timeout", str(a.keep_alive_timeout), "--header-timeout", str(a.header_timeout),
            "--body-timeout", str(a.body_timeout)]
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"flashpage-slow-clients-{os.getpid()}.log"
        server = ServerProcess.python_server(args, log_path, cwd=REPO_ROOT).wait_healthy(180)
        url = server.url
    try:
        report = asyncio.run(run(url, a))
    finally:
        exit_code = server.stop(60) if server is not None else None
    if server is not None:
        report["server_exit_code"] = exit_code
        report["ok"] = report["ok"] and exit_code == 0
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
