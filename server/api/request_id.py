"""Request ids on the HTTP side: the `RequestIdMiddleware` sets `request_id_var` (server/logs.py) for
the whole request (handlers, streaming bodies, the access line), injects the id into the request
headers when the client sent none (so handlers that read `X-Request-ID` see the same id) and
returns it in the `X-Request-ID` response header of every endpoint."""

from __future__ import annotations

import json
import logging
import time
import uuid

from server.logs import clip, request_id_var

access_log = logging.getLogger("flashpage.http")
# Scope key: the `send` this middleware was given, set once a response's start has gone through it.
# A streaming response (server/api/openai_serving.EventStream) sends its body chunks there directly,
# past the layers between (they only watch for the start); one whose start was held back or
# replaced on the way (a compressing middleware) finds no key and sends through them.
DIRECT_SEND = "flashpage.send"


def _valid_id(value: str) -> bool:
    return 0 < len(value) <= 128 and value.isprintable() and value.isascii()


class RequestIdMiddleware:
    """Pure ASGI middleware (streaming-safe): request id in, `X-Request-ID` out, one access line
    per request (`METHOD path status seconds`; /health and /metrics at DEBUG). An exception that
    escapes before the response started becomes a logged 500 that still carries the id."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), None)
        if rid is None or not _valid_id(rid):
            rid = uuid.uuid4().hex
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"x-request-id"]
            scope["headers"].append((b"x-request-id", rid.encode()))
        scope.setdefault("state", {})["request_id"] = rid
        token = request_id_var.set(rid)
        status: int | None = None
        t0 = time.perf_counter()

        async def send_with_id(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    headers.append((b"x-request-id", rid.encode()))
                await send({**message, "headers": headers})
                scope[DIRECT_SEND] = send
                return
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            if status is not None:
                raise
            access_log.exception("unhandled error")
            body = json.dumps({"error": {"message": "Internal Server Error", "type": "server_error",
                                         "param": None, "code": None}}).encode()
            await send_with_id({"type": "http.response.start", "status": 500,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
        finally:
            path = scope.get("path", "")
            level = logging.DEBUG if path in ("/health", "/metrics") else logging.INFO
            # The path is the client's (percent-decoded: %0A is a newline), hence clipped.
            access_log.log(level, "%s %s %s %.3fs", scope.get("method"), clip(path), status, time.perf_counter() - t0)
            request_id_var.reset(token)
