"""Request limits and HTTP guards: what a request may be, who may send it, and what happens when
its client goes away.

- `ServerLimits`: the bounds on a request (body bytes, prompt characters and tokens), the
  admission bounds the engine applies (waiting-queue length, per-request deadline), the shutdown
  grace period, the optional API key and the `--chat-template` override (its flag is in
  server/cli.py); `add_arguments` puts the others on the CLI.
- `GuardMiddleware` (pure ASGI, streaming-safe), in front of every route:
  1. bearer-token auth when an API key is set (`/health` stays open): 401 with `WWW-Authenticate`;
     the comparison is constant-time (`hmac.compare_digest`);
  2. body size: a `Content-Length` over the limit is a 413 before a byte of the body is read; a
     chunked body is read up to the limit and is a 413 past it;
  3. a body that is not UTF-8 is a 400 that says where, before any JSON parsing.
  The body is replayed to the app, then `receive` goes back to the client's, so handlers still see
  `http.disconnect`.
- `check_prompt_chars` / `check_prompt_tokens`: the configurable prompt bounds (HTTP 400).
- `until_disconnected(request, stream)`: relays engine outputs to a non-streaming handler and
  closes the stream (which aborts the request and frees its KV blocks) if the client disconnects.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

# Fixed bounds, part of the OpenAPI schema (server/api/app.py).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_TOKENS_BOUND = 1 << 20  # schema cap on max_tokens; the model's context is the real limit (400)
MAX_TOP_K = 1 << 20

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def parse_bytes(text: str) -> int:
    """'512MiB', '1m', '2GiB' or plain bytes."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


@dataclass
class ServerLimits:
    max_body_bytes: int = 1 << 20
    max_prompt_chars: int = 65536
    max_prompt_tokens: int | None = None  # None: the model's context is the limit
    max_waiting_requests: int | None = 512  # None: unbounded
    request_timeout: float | None = None  # seconds; None: no deadline
    shutdown_grace: float = 30.0
    api_key: str | None = None
    chat_template: str | None = None  # --chat-template's text, in place of the tokenizer's own template

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerLimits:
        return cls(max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
                   max_prompt_tokens=args.max_prompt_tokens or None,
                   max_waiting_requests=None if args.max_waiting_requests < 0 else args.max_waiting_requests,
                   request_timeout=args.request_timeout or None, shutdown_grace=args.shutdown_grace,
                   api_key=args.api_key or os.environ.get("FLASHPAGE_API_KEY") or None,
                   chat_template=getattr(args, "chat_template", None))


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ServerLimits()
    g = p.add_argument_group("limits and reliability")
    g.add_argument("--max-body-bytes", type=parse_bytes, default=d.max_body_bytes,
                   help="largest request body (e.g. 1MiB); larger ones get 413 before they are read")
    g.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars,
                   help="longest text prompt in characters (checked before tokenizing)")
    g.add_argument("--max-prompt-tokens", type=int, default=0,
                   help="longest prompt in tokens (0 = the model's context)")
    g.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                   help="requests that may wait for a slot; beyond it 503 with Retry-After (-1 = unbounded)")
    g.add_argument("--request-timeout", type=float, default=0.0,
                   help="per-request deadline in seconds (0 = none); a request past it is aborted and "
                        "ends with finish_reason 'timeout' and the text generated so far")
    g.add_argument("--shutdown-grace", type=float, default=d.shutdown_grace,
                   help="on SIGTERM, seconds that running requests get to finish before they are aborted")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (or set FLASHPAGE_API_KEY)")


class LimitError(ValueError):
    """A request over a configured bound (HTTP 400; the message names the bound)."""

    status_code = 400


def check_prompt_chars(prompt: str, limits: ServerLimits, name: str = "prompt") -> None:
    if len(prompt) > limits.max_prompt_chars:
        raise LimitError(f"'{name}' has {len(prompt)} characters; the limit is {limits.max_prompt_chars} "
                         "(--max-prompt-chars)")


def check_prompt_tokens(n: int, limits: ServerLimits, name: str = "prompt") -> None:
    if limits.max_prompt_tokens is not None and n > limits.max_prompt_tokens:
        raise LimitError(f"'{name}' has {n} tokens; the limit is {limits.max_prompt_tokens} (--max-prompt-tokens)")


def has_surrogates(text: str) -> bool:
    """Lone UTF-16 surrogates (JSON "\\ud800") are not text: no tokenizer can encode them."""
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


# -- ASGI middleware ------------------------------------------------------------------------------
async def _reply(send, status: int, message: str, kind: str, headers: list | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": kind}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """Auth, body-size and UTF-8 checks in front of every route (see the module docstring)."""

    def __init__(self, app, limits: ServerLimits) -> None:
        self.app = app
        self.limits = limits
        self._key = limits.api_key.encode() if limits.api_key else None

    def _authorized(self, scope) -> bool:
        auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._key is not None and scope.get("path") not in OPEN_PATHS and not self._authorized(scope):
            await _reply(send, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                         "authentication_error", [(b"www-authenticate", b'Bearer realm="flashpage"')])
            return
        if scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None:
            if not length.strip().isdigit():
                await _reply(send, 400, "invalid Content-Length header", "invalid_request_error")
                return
            if int(length) > limit:
                await _reply(send, 413, f"request body of {int(length)} bytes exceeds the limit of {limit} bytes "
                             "(--max-body-bytes)", "invalid_request_error", [(b"connection", b"close")])
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before it finished sending: nothing to serve
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _reply(send, 413, f"request body exceeds the limit of {limit} bytes (--max-body-bytes)",
                             "invalid_request_error", [(b"connection", b"close")])
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            await _reply(send, 400, f"request body is not valid UTF-8 (byte {e.start})", "invalid_request_error")
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's own messages (http.disconnect)

        await self.app(scope, replay, send)


# -- client disconnects ---------------------------------------------------------------------------
class ClientDisconnected(Exception):
    pass


async def wait_disconnect(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request, stream: AsyncIterator) -> AsyncIterator:
    """Yield from `stream` until it ends; if the client disconnects first, close `stream` (the
    engine aborts the request and frees its blocks at its next step) and raise ClientDisconnected."""
    watcher = asyncio.ensure_future(wait_disconnect(request))
    nxt = None
    try:
        while True:
            nxt = asyncio.ensure_future(anext(stream))
            done, _ = await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                raise ClientDisconnected()
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        watcher.cancel()
        if nxt is not None and not nxt.done():
            nxt.cancel()  # unwinds the engine stream, which aborts the request
            await asyncio.gather(nxt, return_exceptions=True)
        await stream.aclose()
