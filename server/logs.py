"""Logs people can operate with: a request id on every line about a request, text or JSON lines.

- `request_id_var` (a context variable) holds the id of the HTTP request being served. The
  `RequestIdMiddleware` sets it for the whole request (handlers, streaming bodies, the access line),
  injects it into the request headers when the client sent none (so handlers that read
  `X-Request-ID` see the same id) and returns it in the `X-Request-ID` response header of every
  endpoint. Code off the request's task (the engine thread) passes `extra={"request_id": ...}`.
- `setup_logging(level, "text" | "json")` installs one stderr handler on the root logger. Text:
  `2026-01-01 12:00:00,123 INFO flashpage.api [3f2a...]: message`. JSON: one object per line,
  `{"ts", "level", "logger", "message", "request_id"?, ...extra fields}`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import uuid
from contextvars import ContextVar
from datetime import datetime, timezone

request_id_var: ContextVar[str | None] = ContextVar("flashpage_request_id", default=None)

access_log = logging.getLogger("flashpage.http")

# Attributes every LogRecord has; anything else on a record came from `extra=` and is emitted as a field.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "request_id", "taskName", "rid", "color_message"}


class RequestIdFilter(logging.Filter):
    """Puts the current request id on the record (unless `extra` already gave one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(rid)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", None)
        record.rid = f" [{rid}]" if rid else ""
        return super().format(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        rid = getattr(record, "request_id", None)
        if rid:
            out["request_id"] = rid
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """One handler on the root logger; uvicorn's loggers propagate to it (run uvicorn with
    log_config=None). Python warnings are routed through logging so JSON output stays JSON."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.captureWarnings(True)


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
                message = {**message, "headers": headers}
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
            access_log.log(level, "%s %s %s %.3fs", scope.get("method"), path, status, time.perf_counter() - t0)
            request_id_var.reset(token)
