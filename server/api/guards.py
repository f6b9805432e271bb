"""Request limits and HTTP guards: what a request may be, who may send it, and what happens when
its client goes away.

- `ServerLimits`: the bounds on a request (body bytes, prompt characters and tokens), on a
  connection (count, keep-alive, header and body timeouts, header bytes: enforced below HTTP
  parsing by server/api/connections.py), the admission bounds the engine applies (waiting-queue
  length, per-request deadline), the shutdown grace period, the optional API key and the
  `--chat-template` override (its flag is in server/cli.py); server/api/limit_flags.py puts the
  others on the CLI, each checked against its range.
- `GuardMiddleware` (pure ASGI, streaming-safe), in front of every route:
  1. bearer-token auth when an API key is set (`/health` stays open): 401 with `WWW-Authenticate`;
     the comparison is constant-time (`hmac.compare_digest`);
  2. body size: a `Content-Length` over the limit is a 413 before the body is parsed; a chunked
     body is read up to the limit and is a 413 past it. The rest of an oversized body is read and
     thrown away before the 413 goes out (see `_refuse_body`);
  3. a body that is not UTF-8 is a 400 that says where, and JSON nested deeper than
     MAX_JSON_DEPTH is a 400 that says how deep, both before any JSON parsing.
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
from dataclasses import dataclass, field

import numpy as np

from server.api.tools.request import ToolSettings

# Fixed bounds, part of the OpenAPI schema (server/api/app.py).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_TOKENS_BOUND = 1 << 20  # schema cap on max_tokens; the model's context is the real limit (400)
MAX_TOP_K = 1 << 20
MAX_CHOICES = 1024  # prompts x n in one /v1 request
# Arrays and objects inside each other in a request body (the deepest valid request nests 5).
# Python's json parser gives up near its recursion limit (~1000, depending on the stack), which
# FastAPI reports as "There was an error parsing the body"; this bound is checked on the raw bytes.
MAX_JSON_DEPTH = 64

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


@dataclass
class ServerLimits:
    max_body_bytes: int = 1 << 20
    max_prompt_chars: int = 65536
    max_prompt_tokens: int | None = None  # None: the model's context is the limit
    # What one request may return: each choice's tokens, and its scored prompt tokens, each counted
    # once more for every logprob alternative (`request_tokens`). Issue 44: chat with n 128,
    # top_logprobs 20 and no max_tokens ran 600 s and built ~80 MB of JSON.
    max_request_tokens: int = 262144
    # None: unbounded (vLLM's only mode). 512 shed a third of the requests of 1024 streaming clients on
    # an H100 (256 run, the rest wait; issue 45's side by side) where vLLM queued them all; a waiting
    # request holds only its token ids (--max-request-tokens bounds them), so the bound is set for
    # overload, not for ordinary bursts.
    max_waiting_requests: int | None = 4096
    request_timeout: float | None = None  # seconds; None: no deadline
    shutdown_grace: float = 30.0
    api_key: str | None = None
    chat_template: str | None = None  # --chat-template's text, in place of the tokenizer's own template
    unknown_fields: str = "ignore"  # top-level body fields no route knows: "ignore" (warned once) or "reject"
    tokenizer_backend: str = "auto"  # prompts encoded by fastokens where it agrees with the tokenizer (fast_encoder.py)
    # --tool-call-parser, --enable-auto-tool-choice, --reasoning-parser (server/api/tools/request.py)
    tools: ToolSettings = field(default_factory=ToolSettings)
    # Connections (server/api/connections.py). uvicorn bounds none of these with its httptools parser.
    max_connections: int = 2048  # at the cap a new connection closes the longest-idle one
    keep_alive_timeout: float = 5.0  # no byte of a request yet (new, or between requests): closed (uvicorn's default)
    header_timeout: float = 10.0  # from a request's first byte to the end of its headers: else 408
    body_timeout: float = 30.0  # from the end of the headers to the end of the body: else 408
    max_header_bytes: int = 16 << 10  # request line and headers: else 431 (h11's default, uvicorn's with h11)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerLimits:
        return cls(max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
                   max_prompt_tokens=args.max_prompt_tokens or None,
                   max_request_tokens=getattr(args, "max_request_tokens", cls.max_request_tokens),
                   max_waiting_requests=None if args.max_waiting_requests < 0 else args.max_waiting_requests,
                   request_timeout=args.request_timeout or None, shutdown_grace=args.shutdown_grace,
                   api_key=args.api_key or os.environ.get("FLASHPAGE_API_KEY") or None,
                   chat_template=getattr(args, "chat_template", None), max_connections=args.max_connections,
                   keep_alive_timeout=args.keep_alive_timeout, header_timeout=args.header_timeout,
                   body_timeout=args.body_timeout, max_header_bytes=args.max_header_bytes,
                   unknown_fields=args.unknown_fields,
                   tokenizer_backend=getattr(args, "tokenizer_backend", cls.tokenizer_backend),
                   tools=ToolSettings(getattr(args, "tool_call_parser", None),
                                      getattr(args, "enable_auto_tool_choice", False),
                                      getattr(args, "reasoning_parser", None)))


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


def request_tokens(max_tokens: int, logprobs: int | None, prompt_tokens: int = 0,
                   prompt_logprobs: int | None = None) -> int:
    """What one choice may return, in tokens counted once more for every logprob alternative: its
    generated tokens, and the prompt tokens it scores (`max_request_tokens`)."""
    scored = 0 if prompt_logprobs is None else prompt_tokens * (1 + prompt_logprobs)
    return max_tokens * (1 + (logprobs or 0)) + scored


def check_request_tokens(total: int, limits: ServerLimits, what: str) -> None:
    """LimitError (400) if a request's `total` (the sum of its choices' request_tokens) is over
    --max-request-tokens; `what` says how it was counted."""
    if total > limits.max_request_tokens:
        raise LimitError(f"this request may return {total} tokens and log-probabilities ({what}); at most "
                         f"{limits.max_request_tokens} are allowed per request (--max-request-tokens): ask for "
                         "fewer choices, tokens or logprobs")


def has_surrogates(text: str) -> bool:
    """Lone UTF-16 surrogates (JSON "\\ud800") are not text: no tokenizer can encode them."""
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


_NESTING = np.zeros(256, dtype=np.int8)  # +1 for each byte that opens an array or object, -1 for a close
_NESTING[list(b"[{")], _NESTING[list(b"]}")] = 1, -1
_QUOTE, _BACKSLASH = ord('"'), ord("\\")


def json_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep arrays and objects nest in the JSON `body` if deeper than `limit`, else 0. At C speed
    (bytes.count, numpy) on the event loop, and exact only when needed: a body cannot nest deeper
    than it has opening brackets; past that, a bracket counts unless an odd number of unescaped
    quotes come before it (it is inside a string), and a running sum gives the depth. (A regular
    expression dropping the strings took 4x to 16x as long: 93 ms for a 1.1 MB chat body, 14 ms for
    issue 44's 234 KB schema, against 25 and 1 ms.)"""
    if body.count(b"[") + body.count(b"{") <= limit:
        return 0
    b = np.frombuffer(body, dtype=np.uint8)
    quotes = b == _QUOTE
    if b"\\" in body:  # a quote after an odd run of backslashes is escaped
        at = np.arange(1, len(b) + 1, dtype=np.int32)
        run = at - np.maximum.accumulate(np.where(b == _BACKSLASH, 0, at))  # backslashes ending at each byte
        quotes[1:] &= (run[:-1] & 1) == 0
    outside = (np.cumsum(quotes, dtype=np.int32) & 1) == 0  # a string's opening quote is inside it
    depth = int(np.cumsum(np.where(outside, _NESTING[b], 0), dtype=np.int32).max(initial=0))
    return depth if depth > limit else 0


# -- ASGI middleware ------------------------------------------------------------------------------
async def _reply(send, status: int, message: str, kind: str, headers: list | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": kind}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope["headers"] if k == name), None)


async def _refuse_body(scope, receive, send, message: str, more_body: bool = True) -> None:
    """413 for a body over the limit. A client still sending it must be allowed to finish: a socket
    closed with unread data makes the kernel send a reset, which destroys the 413 the client has
    not read yet (issue 23: 36 of 48 oversized posts under load lost their answer that way). So the
    rest is read and thrown away first (the connection guard's --body-timeout bounds how long) and
    the connection stays open. A client that waits for `100 Continue` has sent nothing: it is
    answered at once and the connection closed, so that the body is never sent."""
    if (_header(scope, b"expect") or b"").lower() == b"100-continue":
        await _reply(send, 413, message, "invalid_request_error", [(b"connection", b"close")])
        return
    while more_body:
        m = await receive()
        if m["type"] == "http.disconnect":
            return
        more_body = m.get("more_body", False)
    await _reply(send, 413, message, "invalid_request_error")


class GuardMiddleware:
    """Auth, body-size, UTF-8 and JSON-depth checks in front of every route (see the module docstring)."""

    def __init__(self, app, limits: ServerLimits) -> None:
        self.app = app
        self.limits = limits
        self._key = limits.api_key.encode() if limits.api_key else None

    def _authorized(self, scope) -> bool:
        auth = _header(scope, b"authorization") or b""
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
        length = _header(scope, b"content-length")
        if length is not None:
            if not length.strip().isdigit():
                await _reply(send, 400, "invalid Content-Length header", "invalid_request_error")
                return
            if int(length) > limit:
                await _refuse_body(scope, receive, send, f"request body of {int(length)} bytes exceeds the limit "
                                   f"of {limit} bytes (--max-body-bytes)")
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before it finished sending: nothing to serve
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _refuse_body(scope, receive, send, f"request body exceeds the limit of {limit} bytes "
                                   "(--max-body-bytes)", message.get("more_body", False))
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
        depth = json_too_deep(body)
        if depth:
            await _reply(send, 400, f"the JSON body nests arrays and objects {depth} levels deep; at most "
                         f"{MAX_JSON_DEPTH} are allowed", "invalid_request_error")
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


async def wait_disconnect(receive) -> None:
    """Until the client goes away; `receive`: the ASGI one (a Request's `receive`)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request, stream: AsyncIterator) -> AsyncIterator:
    """Yield from `stream` until it ends; if the client disconnects first, close `stream` (the
    engine aborts the request and frees its blocks at its next step) and raise ClientDisconnected."""
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))
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
