"""The connection guards (server/api/connections.py) on a bare uvicorn server in this process, with
a two-route ASGI app (no model): the phase timeouts and their 408s, the exact header-size check,
the connection cap (eviction of the longest-idle connection, 503 when all are busy), and that
pipelined requests are not cut off by the idle timer. The flood itself, against the real server:
tests/server/api/test_adversarial.py."""

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn

from benchmarks.shared.common import free_port
from server.api.connections import protocol_class
from server.api.guards import ServerLimits


async def app(scope, receive, send):
    """Reads the body and answers 200: /slow after 0.4 s, /slower after 0.8 s (longer than the
    keep-alive timeout), anything else at once."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await asyncio.sleep({"/slow": 0.4, "/slower": 0.8}.get(scope["path"], 0))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def port():
    limits = ServerLimits(max_connections=4, keep_alive_timeout=0.6, header_timeout=0.4, body_timeout=0.5,
                          max_header_bytes=2048)
    p = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=p, http=protocol_class(limits),
                                           timeout_keep_alive=limits.keep_alive_timeout, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield p
    server.should_exit = True
    thread.join(10)


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def read_until_closed(s: socket.socket) -> tuple[bytes, float]:
    """What the server sent until it closed the connection, and how long that took."""
    t0, data = time.monotonic(), b""
    while chunk := s.recv(65536):
        data += chunk
    return data, time.monotonic() - t0


def test_phase_timeouts(port):
    idle = connect(port)
    head = connect(port)
    head.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # never finished
    body = connect(port)
    body.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12345")  # half the body
    data, took = read_until_closed(idle)
    assert data == b"" and 0.4 < took < 2  # closed quietly after the keep-alive timeout
    for s, flag in ((head, b"--header-timeout"), (body, b"--body-timeout")):
        data, _ = read_until_closed(s)
        assert data.startswith(b"HTTP/1.1 408") and flag in data, data
        s.close()
    idle.close()


def test_headers_over_the_limit_in_one_read_are_431(port):
    with connect(port) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 3000 + b"\r\n\r\n")
        data, _ = read_until_closed(s)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431") and "--max-header-bytes" in json.loads(body)["error"]["message"]
    with connect(port) as s:  # under it: served, and the connection stays open for the next request
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 1500 + b"\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")


def test_pipelined_requests_are_all_answered(port):
    with connect(port) as s:  # the second is answered 0.8 s after the first: never idle meanwhile
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /slower HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while data.count(b"HTTP/1.1 200") < 2:
            data += s.recv(4096) or pytest.fail(f"closed after {data!r}")


def test_at_the_cap_the_longest_idle_connection_makes_room(port):
    time.sleep(0.7)  # earlier tests' connections are gone
    oldest = connect(port)
    time.sleep(0.05)
    others = [connect(port) for _ in range(3)]
    time.sleep(0.05)
    new = connect(port)  # the fifth: over the cap of 4
    assert read_until_closed(oldest)[0] == b""
    new.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert new.recv(4096).startswith(b"HTTP/1.1 200")
    for s in (oldest, new, *others):
        s.close()


def test_at_the_cap_with_every_connection_busy_a_new_one_gets_503(port):
    time.sleep(0.7)
    busy = [connect(port) for _ in range(4)]
    for s in busy:
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.1)
    with connect(port) as late:
        data, _ = read_until_closed(late)
    assert data.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in data and b"--max-connections" in data
    for s in busy:
        assert s.recv(4096).startswith(b"HTTP/1.1 200")  # the busy ones were left alone
        s.close()
