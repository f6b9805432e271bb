"""Logs people can operate with: a request id on every line about a request, text or JSON lines.

- `request_id_var` (a context variable) holds the id of the HTTP request being served; the front
  end's `RequestIdMiddleware` (server/api/request_id.py) sets it for the whole request. Code off the
  request's task (the engine thread) passes `extra={"request_id": ...}`.
- `setup_logging(level, "text" | "json")` installs one stderr handler on the root logger. Text:
  `2026-01-01 12:00:00,123 INFO flashpage.api [3f2a...]: message`. JSON: one object per line,
  `{"ts", "level", "logger", "message", "request_id"?, ...extra fields}`.
- One record, one line, of bounded length, whatever a client sends (issue 23: a newline in the
  OpenAI `user` field forged a whole log line, a 1 MB `user` wrote a 1 MB line). `clip(value)` is
  how a client-supplied string goes into a message: escaped and cut to CLIENT_VALUE_CHARS. Both
  formatters also cut every message to MAX_MESSAGE_CHARS, and the text formatter escapes line
  breaks and control characters in it (JSON escapes them itself); tracebacks keep their lines.
"""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import datetime, timezone

request_id_var: ContextVar[str | None] = ContextVar("flashpage_request_id", default=None)

CLIENT_VALUE_CHARS = 200  # of one client-supplied string in a log message
MAX_MESSAGE_CHARS = 4096  # of a whole log message (a traceback after it is not counted)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}...(+{len(text) - limit} chars)"


def _escaped(text: str) -> str:
    """`text` with line breaks and other non-printable characters as escapes (repr's), so that it
    stays on one line and cannot carry terminal control sequences."""
    return text if text.isprintable() else repr(text)[1:-1]


def clip(value: object, limit: int = CLIENT_VALUE_CHARS) -> str:
    """A client-supplied string as a log message may carry it: at most `limit` characters of it
    (and how many more there were), escaped."""
    text = str(value)
    return _escaped(text[:limit]) + (f"...(+{len(text) - limit} chars)" if len(text) > limit else "")


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

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = _escaped(_cut(record.message, MAX_MESSAGE_CHARS))
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name,
               "message": _cut(record.getMessage(), MAX_MESSAGE_CHARS)}
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
