"""What /v1/completions and /v1/chat/completions do alike once a body is parsed: the model check,
the caps on a request's sequences (prompts x n: `admit_choices`, before any per-prompt work), each
choice's SamplingParams (checked against the engine before anything runs), one engine request per
choice, admitted together, and the response: one JSON object, or SSE chunks then `data: [DONE]`.

- Engine errors before the response starts keep their status code (a stream waits for the first
  output before it answers 200); a failure mid-stream is a last `data: {"error": ...}` chunk.
- A non-streaming client that disconnects has all its choices aborted (499 in the access log);
  closing a stream aborts whatever still runs.
- Each route's `ChoiceBase` subclass (server/api/openai_protocol.py) shapes its choice objects.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.controls import check_structured
from server.api.fields import refusal, unknown_fields, warn_ignored
from server.api.guards import (MAX_CHOICES, LimitError, ServerLimits, check_request_tokens, request_tokens,
                               wait_disconnect)
from server.api.request_id import DIRECT_SEND
from server.api.openai_protocol import (ChoiceBase, OpenAIError, SamplingRequest, check_request, from_engine_error,
                                        structured_param, usage_dict, validation_error)
from server.bridge.async_engine import AsyncEngine, ServiceUnavailableError
from server.engine import RequestError, RequestOutput
from server.logs import request_id_var
from server.sampling_params import SamplingParams

log = logging.getLogger("flashpage.openai")
ROUTE_ERRORS = {  # errors are OpenAI-shaped; validation errors are 400 here, not 422
    400: {"description": "Invalid request"}, 404: {"description": "Unknown model"},
    503: {"description": "Overloaded or shutting down (Retry-After), or the engine is dead"}}


# SSE events are encoded with msgspec: ~10x faster than json.dumps (issue 20: JSON was 9% of the API
# process under 256 streams); compact (no spaces) and UTF-8 where json.dumps wrote \u escapes.
encode_json = msgspec.json.Encoder().encode
DONE = b"data: [DONE]\n\n"
BUILD_ON_LOOP = 4096  # request_tokens up to which a whole (not streamed) answer is built on the event loop
_BUILDERS = ThreadPoolExecutor(2, thread_name_prefix="flashpage-answer")  # where larger answers are built
T = TypeVar("T")
# msgspec leaves U+0085, U+2028 and U+2029 raw in a JSON string. An SSE line ends at CR or LF, but
# clients that split a stream as str.splitlines does (httpx's iter_lines, and so many a Python
# client) end lines at these three too, and cut the event's JSON in two: a generated token may be one
# (a CI run's JSONDecodeError, 2026-11-28). Escaped they are the same JSON string, on one line. (In
# UTF-8 these byte runs are those characters and nothing else: C2 and E2 only start a character.)
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def event_json(obj) -> bytes:
    """encode_json(obj) with no character that any line splitter takes for a line break."""
    data = encode_json(obj)
    if b"\xc2\x85" in data or b"\xe2\x80\xa8" in data or b"\xe2\x80\xa9" in data:
        for raw, escaped in _LINE_BREAKS:
            data = data.replace(raw, escaped)
    return data


def sse(obj) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + event_json(obj) + b"\n\n"


async def built(size: int, build: Callable[[], T]) -> T:
    """build()'s result, built here if `size` (tokens with their logprobs, as guards.request_tokens
    counts them) is at most BUILD_ON_LOOP, else on a thread (issue 44: 76 MB of JSON held /health up
    6.1 s; a 12.5k-token prompt's scores expand to 262k pairs), whose GIL the event loop gets back
    every switch interval."""
    if size <= BUILD_ON_LOOP:
        return build()
    return await asyncio.get_running_loop().run_in_executor(_BUILDERS, build)


class EventStream(Response):
    """The SSE response of /generate and /v1: pre-encoded events streamed as Starlette's
    StreamingResponse streams them, the stream stopped (which aborts its requests) when the client
    disconnects, but each body chunk sent straight to the `send` that RequestIdMiddleware was given
    (server/api/request_id.py), past the layers inside it that only look out for the start message
    (Starlette's exception handlers, twice, and the request-id wrapper: 5-9% of the API process's
    samples under 256 streams, benchmarks/profiling/bench_api_events.py). The start takes the whole way, and
    only if it reached RequestIdMiddleware at once (no middleware in between held it back, as a
    compressing one would) do the chunks skip it."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: dict | None = None) -> None:
        self.events, self.status_code, self.background = events, 200, None
        self.init_headers(headers)

    async def __call__(self, scope, receive, send) -> None:
        streaming = asyncio.ensure_future(self._stream(scope, send))
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait((streaming, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            streaming.cancel()  # unless it is done: the client went away (or this task was cancelled)
            await asyncio.wait((streaming,))
        if not streaming.cancelled():
            streaming.result()  # raises what the stream raised
        if self.background is not None:
            await self.background()

    async def _stream(self, scope, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        send = scope.get(DIRECT_SEND) or send
        try:
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await self.events.aclose()  # at once, even when cancelled between two chunks: it aborts
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@dataclass(frozen=True)
class Route:
    name: str  # for the log lines
    id_prefix: str  # the response id is id_prefix + the request id
    object: str  # of the whole response
    chunk_object: str  # of each streamed chunk


def openai_errors(app: FastAPI, applies: Callable[[str], bool],
                  to_error: Callable[[RequestValidationError], OpenAIError] = validation_error) -> None:
    """Make validation errors (a 400, not 422) and unknown routes or methods OpenAI-shaped on the
    paths `applies` accepts, leaving every other path to the handlers installed before."""
    prev_validation = app.exception_handlers.get(RequestValidationError, request_validation_exception_handler)
    prev_http = app.exception_handlers.get(StarletteHTTPException, http_exception_handler)

    async def on_validation(request: Request, exc: RequestValidationError):
        if applies(request.url.path):
            return to_error(exc).response()
        return await prev_validation(request, exc)

    async def on_http(request: Request, exc: StarletteHTTPException):
        if applies(request.url.path):
            kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
            return JSONResponse(OpenAIError(exc.status_code, str(exc.detail), kind, code=code).body(),
                                status_code=exc.status_code, headers=getattr(exc, "headers", None))
        return await prev_http(request, exc)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)


async def answer(handling: Awaitable):
    """A route's answer: what its handler returns, or the OpenAIError it raised as a response."""
    try:
        return await handling
    except OpenAIError as e:
        return e.response()


def begin(body: SamplingRequest, request: Request) -> tuple[object, ServerLimits]:
    """The checks every body gets first (unknown fields, the model, fields at their defaults); the
    engine and limits."""
    engine = request.app.state.engine.engine
    limits = getattr(request.app.state, "limits", None) or ServerLimits()
    check_unknown(body, request, limits)
    if body.model != engine.model_name:
        raise OpenAIError(404, f"The model '{body.model}' does not exist; this server serves '{engine.model_name}'",
                          param="model", code="model_not_found")
    check_request(body)
    return engine, limits


def check_unknown(body, request: Request, limits: ServerLimits) -> None:
    """The body's top-level fields no route knows: refused or warned about (--unknown-fields)."""
    if extra := unknown_fields(body):
        if limits.unknown_fields == "reject":
            raise validation_error(refusal(extra))
        warn_ignored(request.url.path, extra, request.app.state.ignored_fields)


def _admit(aengine: AsyncEngine, count: int) -> None:
    try:
        aengine.admit(count)
    except RequestError as e:  # more than may ever wait: a 400, which clients do not retry
        raise OpenAIError(400, str(e), param="n") from None
    except ServiceUnavailableError as e:  # the queue is full now: 503 with Retry-After
        raise from_engine_error(e) from None


def admit_choices(request: Request, prompts: int, n: int) -> None:
    """Caps on the sequences a request asks for, checked before any per-prompt work (tokenizing,
    rendering): at most MAX_CHOICES, and no more than may wait for the batch (400 if they never
    could, 503 if the queue is full now; `respond` checks the queue again once they are built)."""
    cap_choices(prompts, n)
    _admit(request.app.state.engine, prompts * n)


def cap_choices(prompts: int, n: int) -> None:
    """At most MAX_CHOICES sequences (prompts x n) per request: a 400."""
    if prompts * n > MAX_CHOICES:
        raise OpenAIError(400, f"{prompts} prompt(s) x n={n} = {prompts * n} sequences; at most {MAX_CHOICES} are "
                          "allowed per request", param="n")


async def check_structured_output(request: Request, engine, body: SamplingRequest) -> None:
    """A 400 saying what is wrong with the body's structured-output spec, before anything is queued
    (compiled off the event loop: server/api/controls.py)."""
    try:
        await check_structured(request.app.state, engine, body.structured())
    except RequestError as e:
        raise OpenAIError(400, str(e), param=structured_param(body)) from None
    except ServiceUnavailableError as e:  # too many compiles wait already: 503 with Retry-After
        raise from_engine_error(e) from None


def choice_params(engine, body: SamplingRequest, ids: list[int], max_tokens: int, logprobs: int | None,
                  param: str, prompt_logprobs: int | None = None) -> list[SamplingParams]:
    """The parameters of the `body.n` choices of one prompt, validated as the engine will."""
    if len(ids) + max_tokens > engine.max_model_len:
        raise OpenAIError(400, f"This model's maximum context length is {engine.max_model_len} tokens, however "
                          f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in your prompt; "
                          f"{max_tokens} for the completion). Please reduce your prompt or completion length.",
                          param=param, code="context_length_exceeded")
    try:
        out = [body.sampling_params(max_tokens, logprobs, j, prompt_logprobs) for j in range(body.n)]
    except RequestError as e:  # a logit_bias key that is not a token id
        raise OpenAIError(400, str(e), param="logit_bias") from None
    try:
        engine.validate(ids, out[0])  # choices differ only in their seeds, which validation does not read
    except RequestError as e:  # the field it names (the prompt is the route's: prompt or messages)
        raise OpenAIError(400, str(e), param=param if e.param in (None, "prompt") else e.param) from None
    return out


def cap_request_tokens(limits: ServerLimits, choices: list[ChoiceBase]) -> None:
    """400 if the choices together may return more than --max-request-tokens (guards.request_tokens):
    one small request cannot occupy the engine for minutes, nor build a response of gigabytes."""
    total = sum(request_tokens(c.params.max_tokens, c.params.logprobs, len(c.ids), c.params.prompt_logprobs)
                for c in choices)
    p = choices[0].params
    what = (f"{len(choices)} choice(s) of up to {p.max_tokens} tokens"
            + (f" with {p.logprobs} logprobs each" if p.logprobs else "")
            + (f", each scoring {len(choices[0].ids)} prompt tokens" if p.prompt_logprobs is not None else ""))
    try:
        check_request_tokens(total, limits, what)
    except LimitError as e:
        raise OpenAIError(400, str(e), param="max_tokens") from None


def request_id(request: Request) -> str:
    """The request's id (RequestIdMiddleware's, else the client's header, else a fresh one)."""
    return request_id_var.get() or request.headers.get("x-request-id") or uuid.uuid4().hex


async def respond(request: Request, route: Route, body: SamplingRequest, choices: list[ChoiceBase],
                  prompt_tokens: int, extra: dict | None = None):
    """Run every choice on the engine and answer: a JSON response, or an SSE stream. `extra`: fields
    of the whole response, and of a stream's first chunk (vLLM's prompt_token_ids)."""
    aengine = request.app.state.engine
    rid = request_id(request)
    head = {"id": route.id_prefix + rid, "object": route.chunk_object if body.stream else route.object,
            "created": int(time.time()), "model": aengine.engine.model_name}
    tag = uuid.uuid4().hex[:8]  # engine ids stay unique even when a client reuses its X-Request-ID

    def generate(c: ChoiceBase):
        if c.engine_free:
            return _prompt_only(c)
        return aengine.generate(f"{rid}-{tag}-{c.index}", c.ids, c.params, validated=True, admitted=True)

    # all of them or none (a request half admitted could only fail); those the engine never sees take no place
    _admit(aengine, sum(not c.engine_free for c in choices))
    if body.stream and len(choices) == 1:
        # One choice streamed (the common case): its outputs straight from its engine stream, with
        # no task and queue between them (a task wake-up per event).
        [one] = choices
        stream = generate(one)

        async def take() -> tuple:
            try:
                return one, await anext(stream)
            except Exception as e:
                return one, e

        close = stream.aclose
    else:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: ChoiceBase) -> None:
            stream = generate(c)
            try:
                async for out in stream:
                    queue.put_nowait((c, out))
            except Exception as e:
                queue.put_nowait((c, e))
            finally:
                await stream.aclose()

        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        take = queue.get

        async def close() -> None:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    if body.stream:
        try:
            first = await take()  # engine errors before the response starts get a status code
        except BaseException:
            await close()
            raise
        if isinstance(first[1], BaseException):
            await close()
            raise from_engine_error(first[1], body)
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        gen = _stream(route, first, take, choices, head, include_usage, prompt_tokens, close, extra)
        return EventStream(gen, headers={"Cache-Control": "no-cache"})

    done, arrived = 0, []
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        while done < len(choices):
            getter = asyncio.ensure_future(queue.get())
            finished, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in finished:
                getter.cancel()
                log.info("client disconnected; aborting %d sequence(s)", len(choices))
                return JSONResponse(OpenAIError(499, "client disconnected").body(), status_code=499)
            c, out = getter.result()
            if isinstance(out, BaseException):
                raise from_engine_error(out, body)
            arrived.append((c, out))
            done += out.finished
    finally:
        watcher.cancel()
        await close()

    def build() -> bytes:  # the choices' text and logprobs, then the JSON of {**head, choices, usage, **extra},
        for c, out in arrived:  # a choice at a time (each encode holds the GIL throughout)
            c.chunks(out)
        tail = {"usage": usage_dict(prompt_tokens, sum(c.completion_tokens for c in choices)), **(extra or {})}
        return b"".join((encode_json(head)[:-1], b',"choices":[', b",".join(encode_json(c.result()) for c in choices),
                         b"],", encode_json(tail)[1:]))

    size = sum(request_tokens(c.params.max_tokens, c.params.logprobs, len(c.ids), c.params.prompt_logprobs)
               for c in choices)
    body = await built(size, build)  # a large answer on a thread; a small one here, without the hop
    log.info("%s done: prompt_tokens=%d, completion_tokens=%d, finish_reason=%s", route.name, prompt_tokens,
             sum(c.completion_tokens for c in choices), ",".join(sorted({str(c.finish_reason) for c in choices})))
    return Response(body, media_type="application/json")


async def _prompt_only(c: ChoiceBase) -> AsyncIterator[RequestOutput]:
    """The engine's answer to a choice that generates and scores nothing: finished at once, at its length."""
    yield RequestOutput("", "", [], True, "length", prompt_tokens=len(c.ids))


async def _stream(route: Route, first, take: Callable[[], Awaitable[tuple]], choices: list[ChoiceBase], head: dict,
                  include_usage: bool, prompt_tokens: int, close: Callable[[], Awaitable], extra: dict | None = None):
    """SSE chunks as bytes, one per choice object of each engine output (an output's chunks go out
    in one write; the last ones with the usage chunk and [DONE]); closing the stream aborts what
    still runs. The fixed part of a chunk (id, object, created, model) is encoded once per request:
    a chunk is `prefix + the choice object + suffix`, the same JSON as a fresh dict's, keys in order."""
    prefix = b"data: " + event_json(head)[:-1] + b',"choices":['
    suffix = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"
    done, item = 0, first
    try:
        while True:
            c, out = item
            if isinstance(out, BaseException):
                tail = sse(from_engine_error(out).body())
                break
            if out.prompt_logprobs is None:
                pieces = c.chunks(out)
            else:  # an echo's first piece expands the prompt's scores (logprobs): a large one on a thread
                pieces = await built(out.prompt_logprobs.pairs, functools.partial(c.chunks, out))
            events = [prefix + event_json(piece) + suffix for piece in pieces]
            if extra and events:  # the first chunk carries them
                events[0] = sse({**head, "choices": pieces[:1], **({"usage": None} if include_usage else {}), **extra})
                extra = None
            done += out.finished
            if done == len(choices):
                completion_tokens = sum(ch.completion_tokens for ch in choices)
                log.info("%s done (stream): prompt_tokens=%d, completion_tokens=%d", route.name, prompt_tokens,
                         completion_tokens)
                if include_usage:
                    events.append(sse({**head, "choices": [], "usage": usage_dict(prompt_tokens, completion_tokens)}))
                tail = b"".join(events)
                break
            if events:
                yield events[0] if len(events) == 1 else b"".join(events)
            item = await take()
        yield tail + DONE
    finally:
        await close()
