"""Connection guards below HTTP parsing, where ASGI middleware cannot reach.

uvicorn with its httptools parser never times out a client that connects and sends nothing, or half
a request, and bounds neither the size of a request's headers nor the number of connections
(issue 23: 20,000 such sockets used up the file descriptors and /health stopped answering; one
200 MiB header was read whole). It has settings for none of these, only `timeout_keep_alive`
between requests, so `GuardedProtocol` is its httptools protocol plus:

- **phase timeouts**: a connection is *idle* (connected, or between requests: no byte of a
  request yet; closed after `keep_alive_timeout`), reading a request's *head* (line and headers:
  complete within `header_timeout` of its first byte), reading its *body* (complete within
  `body_timeout` after the headers), or *busy* (the app answers: no timer; --request-timeout
  bounds a generation). A head or body that runs out of time gets a 408 when no response is under
  way, then the connection is closed.
- **header bytes**: a request line plus headers over `max_header_bytes` gets a 431 and the
  connection is closed: counted as bytes arrive, so an endless header is cut off at the limit
  (plus one read), not buffered.
- **a connection cap**: past `max_connections`, a new connection closes the one that has been
  idle (or reading a head) the longest; when every connection is busy with a request the new one
  gets a 503 and is closed. `raise_fd_limit` makes sure the cap fits the file-descriptor limit.

Only the pieces of uvicorn's protocol that a subclass is meant to hook are used: its parser
callbacks, `connection_made/lost`, `data_received`, `self.cycle` and `self.connections`.
"""

from __future__ import annotations

import json
import logging
import time

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.api.guards import ServerLimits

log = logging.getLogger("flashpage.connections")

IDLE, HEAD, BODY, BUSY = "idle", "head", "body", "busy"
FD_RESERVE = 256  # descriptors the process needs besides client sockets (engine pipes, logs, model files)


def _raw_response(status: int, reason: str, message: str, extra: bytes = b"") -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error"}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n").encode() + extra + b"\r\n" + body


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with phase timeouts, a header size limit and a connection cap
    (module docstring). `protocol_class(limits)` makes one bound to the server's limits."""

    limits: ServerLimits = ServerLimits()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.phase, self.phase_since = IDLE, time.monotonic()
        self._timer = None
        self._head_bytes = 0
        self._closing = False  # closed or answered and closing: what the parser still calls back is ignored

    # -- phases --------------------------------------------------------------------------------
    def _enter(self, phase: str, timeout: float | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.phase, self.phase_since = phase, time.monotonic()
        if timeout is not None:
            self._timer = self.loop.call_later(timeout, self._timed_out, phase)

    def _timed_out(self, phase: str) -> None:
        self._timer = None
        if phase == IDLE:
            self._close()
        elif phase == HEAD:
            self._refuse(408, "Request Timeout", "the request's headers did not arrive within "
                         f"{self.limits.header_timeout:g} s (--header-timeout)")
        else:
            self._refuse(408, "Request Timeout", "the request's body did not arrive within "
                         f"{self.limits.body_timeout:g} s (--body-timeout)")

    def _close(self) -> None:
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def _refuse(self, status: int, reason: str, message: str, extra: bytes = b"") -> None:
        """Answer `status` unless a response is already under way on this connection, then close it."""
        cycle = self.cycle  # while reading a body: its request's; before that, the previous request's
        if self.phase == BODY:
            answer = cycle is not None and not cycle.response_started
            if answer:  # the app reading this body sees http.disconnect, and anything it sends is dropped
                cycle.disconnected = True
                cycle.message_event.set()
        else:
            answer = cycle is None or cycle.response_complete
        if answer and not self.transport.is_closing():
            self.transport.write(_raw_response(status, reason, message, extra))
        log.debug("closing a connection: %s", message)
        self._close()

    # -- uvicorn's protocol --------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._enter(IDLE, self.limits.keep_alive_timeout)
        if len(self.connections) > self.limits.max_connections:
            self._make_room()

    def _make_room(self) -> None:
        waiting = [c for c in self.connections
                   if c is not self and getattr(c, "phase", None) in (IDLE, HEAD) and not c._closing]
        if waiting:
            min(waiting, key=lambda c: c.phase_since)._close()
        else:
            self._refuse(503, "Service Unavailable", f"{self.limits.max_connections} connections are open, all "
                         "busy with requests (--max-connections); retry later", b"retry-after: 1\r\n")

    def connection_lost(self, exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        super().data_received(data)
        if self.phase == HEAD and not self._closing:  # the headers are still incomplete after this read
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._too_large()

    def _too_large(self) -> None:
        self._refuse(431, "Request Header Fields Too Large", "the request line and headers exceed "
                     f"{self.limits.max_header_bytes} bytes (--max-header-bytes)")

    def on_message_begin(self) -> None:
        if self._closing:
            return
        super().on_message_begin()
        self._head_bytes = 0
        self._enter(HEAD, self.limits.header_timeout)

    def on_headers_complete(self) -> None:
        if self._closing:
            return
        # Exact for headers that arrived in one read with more than the limit (data_received counts
        # only reads after which the headers are still incomplete): name, value, ": " and CRLF each.
        if len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers) > self.limits.max_header_bytes:
            self._too_large()
            return
        super().on_headers_complete()
        self._enter(BODY, self.limits.body_timeout)

    def on_body(self, body: bytes) -> None:
        if not self._closing:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._closing:
            return
        super().on_message_complete()
        if self.cycle is not None and self.cycle.response_complete:
            self._enter(IDLE, self.limits.keep_alive_timeout)  # answered before its body ended: idle now
        else:
            self._enter(BUSY, None)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Idle unless a pipelined request (whose headers made it self.cycle) is still to be answered.
        if self.phase == BUSY and not self._closing and self.cycle.response_complete:
            self._enter(IDLE, self.limits.keep_alive_timeout)


def protocol_class(limits: ServerLimits) -> type[GuardedProtocol]:
    """The protocol class to give uvicorn (`uvicorn.Config(http=...)`), bound to `limits`."""
    return type("GuardedProtocol", (GuardedProtocol,), {"limits": limits})


def raise_fd_limit(max_connections: int) -> None:
    """Make sure --max-connections client sockets fit the process's file-descriptor limit, raising
    the soft limit towards the hard one if needed (as Go's runtime does); SystemExit if they cannot."""
    try:
        import resource
    except ImportError:  # not Unix: no such limit to raise
        return
    need = max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise SystemExit(f"--max-connections {max_connections} needs about {need} file descriptors, but this "
                             f"process may open at most {hard} (ulimit -Hn): lower --max-connections to "
                             f"{max(1, hard - FD_RESERVE)} or less, or raise the limit")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        log.info("raised the open-file limit from %d to %d for --max-connections %d", soft, need, max_connections)
