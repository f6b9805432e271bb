"""OpenAI-compatible API: POST /v1/completions, GET /v1/models, GET /v1/models/{id}.

Follows the OpenAI (legacy) completions schema: `text_completion` objects with choices (index,
text, logprobs {tokens, token_logprobs, top_logprobs, text_offset}, finish_reason) and usage;
`stream: true` gives `data: {...}` chunks of the same shape, then `data: [DONE]` (with
`stream_options.include_usage`, a last chunk with empty choices carries usage). Errors are
`{"error": {"message", "type", "param", "code"}}`; body validation errors on /v1 are 400 in that
shape, not FastAPI's 422.

- `prompt`: a string, a list of strings, a list of token ids, or a list of token-id lists.
  Choices are ordered prompt by prompt, `n` per prompt (index = prompt * n + choice).
- `n` > 1 runs n separate engine requests; with `seed`, choice j of each prompt uses `seed + j`.
- `stop`: streamed text holds back the last len(longest stop) - 1 characters until they cannot
  start a stop string, so streamed and whole text agree even when a stop string spans tokens.
- `logprobs` (0..20): the chosen token's log-probability and the top alternatives, taken from the
  same sampling step (the model's raw distribution, before temperature / top-p). Tokens are
  decoded one by one, so a token that is part of a multi-byte character shows as U+FFFD.
- `echo`: the prompt text is prepended. With `logprobs`, prompt tokens are listed with
  `null` log-probabilities (the server does not run a second scoring pass).
- Accepted but only at their defaults (other values are a 400): `suffix`, `best_of` (= n),
  `presence_penalty`, `frequency_penalty` (0), `logit_bias` (empty). `user` is logged.
  Extensions (pass with `extra_body`): `top_k`, `ignore_eos`, `stop_token_ids`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import APIRouter, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.engine import RequestError
from server.api.guards import ServerLimits, has_surrogates
from server.logs import request_id_var
from server.api.openai_protocol import (Choice, CompletionRequest, OpenAIError, check_unsupported, from_engine_error,
                                    parse_prompts, usage_dict, validation_error)
from server.sampling_params import SamplingParams

log = logging.getLogger("flashpage.openai")
router = APIRouter(prefix="/v1")
MAX_CHOICES = 1024  # prompts x n in one request
DEFAULTS = SamplingParams()


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@router.post("/completions", responses={  # errors are OpenAI-shaped; validation errors are 400 here, not 422
    400: {"description": "Invalid request"}, 404: {"description": "Unknown model"},
    503: {"description": "Overloaded or shutting down (Retry-After), or the engine is dead"}})
async def completions(body: CompletionRequest, request: Request):
    try:
        return await _completions(body, request)
    except OpenAIError as e:
        return e.response()


async def _completions(body: CompletionRequest, request: Request):
    aengine = request.app.state.engine
    engine = aengine.engine
    rid = request_id_var.get() or request.headers.get("x-request-id") or uuid.uuid4().hex
    if body.model != engine.model_name:
        raise OpenAIError(404, f"The model '{body.model}' does not exist; this server serves '{engine.model_name}'",
                          param="model", code="model_not_found")
    check_unsupported(body)
    limits = getattr(request.app.state, "limits", None) or ServerLimits()
    prompts = parse_prompts(body.prompt, engine.tokenizer, limits)
    if len(prompts) * body.n > MAX_CHOICES:
        raise OpenAIError(400, f"{len(prompts)} prompts x n={body.n} exceeds {MAX_CHOICES} sequences per request",
                          param="n")
    max_tokens = body.max_tokens or DEFAULTS.max_tokens
    stop = [s for s in ([body.stop] if isinstance(body.stop, str) else body.stop or []) if s]
    if any(has_surrogates(s) for s in stop):
        raise OpenAIError(400, "'stop' holds a lone UTF-16 surrogate, which is not text", param="stop")
    choices: list[Choice] = []
    for text, ids in prompts:
        if len(ids) + max_tokens > engine.max_model_len:
            raise OpenAIError(400, f"This model's maximum context length is {engine.max_model_len} tokens, however "
                              f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in your prompt; "
                              f"{max_tokens} for the completion). Please reduce your prompt or completion length.",
                              param="prompt", code="context_length_exceeded")
        for j in range(body.n):
            params = SamplingParams(
                max_tokens=max_tokens, temperature=DEFAULTS.temperature if body.temperature is None else body.temperature,
                top_p=DEFAULTS.top_p if body.top_p is None else body.top_p, top_k=body.top_k,
                seed=None if body.seed is None else body.seed + j, stop=stop,
                stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos, logprobs=body.logprobs)
            try:
                engine.validate(ids, params)
            except RequestError as e:
                raise OpenAIError(400, str(e), param="prompt") from None
            choices.append(Choice(len(choices), text, ids, params, body.echo, engine.tokenizer))
    log.info("completion: %d prompt(s), n=%d, max_tokens=%d, stream=%s%s", len(prompts), body.n, max_tokens,
             body.stream, f", user={body.user}" if body.user else "")

    cid, created = f"cmpl-{rid}", int(time.time())
    head = {"id": cid, "object": "text_completion", "created": created, "model": engine.model_name}
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    queue: asyncio.Queue = asyncio.Queue()
    tag = uuid.uuid4().hex[:8]  # engine ids stay unique even when a client reuses its X-Request-ID

    async def pump(c: Choice) -> None:
        stream = aengine.generate(f"{rid}-{tag}-{c.index}", c.ids, c.params, validated=True)
        try:
            async for out in stream:
                queue.put_nowait((c, out))
        except Exception as e:
            queue.put_nowait((c, e))
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]

    async def cancel() -> None:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    if body.stream:
        try:
            first = await queue.get()  # engine errors before the response starts get a status code
        except BaseException:
            await cancel()
            raise
        if isinstance(first[1], BaseException):
            await cancel()
            raise from_engine_error(first[1])
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        gen = _stream(first, queue, choices, head, include_usage, prompt_tokens, cancel)
        return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    done = 0
    watcher = asyncio.ensure_future(_until_disconnected(request))
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
                raise from_engine_error(out)
            c.piece(out)
            done += out.finished
    finally:
        watcher.cancel()
        await cancel()
    result = [{"index": c.index, "text": "".join(c.texts), "logprobs": c.logprobs, "finish_reason": c.finish_reason}
              for c in choices]
    completion_tokens = sum(c.completion_tokens for c in choices)
    log.info("completion done: prompt_tokens=%d, completion_tokens=%d, finish_reason=%s", prompt_tokens,
             completion_tokens, ",".join(sorted({str(r["finish_reason"]) for r in result})))
    return {**head, "choices": result, "usage": usage_dict(prompt_tokens, completion_tokens)}


async def _stream(first, queue: asyncio.Queue, choices: list[Choice], head: dict, include_usage: bool,
                  prompt_tokens: int, cancel):
    """SSE chunks, one per engine output of any choice; closing the stream aborts what still runs."""
    extra = {"usage": None} if include_usage else {}
    done, item = 0, first
    try:
        while True:
            c, out = item
            if isinstance(out, BaseException):
                yield f"data: {json.dumps(from_engine_error(out).body())}\n\n"
                break
            yield f"data: {json.dumps({**head, 'choices': [c.piece(out)], **extra})}\n\n"
            done += out.finished
            if done == len(choices):
                completion_tokens = sum(ch.completion_tokens for ch in choices)
                log.info("completion done (stream): prompt_tokens=%d, completion_tokens=%d", prompt_tokens,
                         completion_tokens)
                if include_usage:
                    usage = usage_dict(prompt_tokens, completion_tokens)
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
                break
            item = await queue.get()
        yield "data: [DONE]\n\n"
    finally:
        await cancel()


@router.get("/models")
async def list_models(request: Request):
    return {"object": "list", "data": [_model_card(request)]}


@router.get("/models/{model_id:path}", responses={404: {"description": "Unknown model"}})
async def get_model(model_id: str, request: Request):
    card = _model_card(request)
    if model_id != card["id"]:
        return OpenAIError(404, f"The model '{model_id}' does not exist", param="model",
                           code="model_not_found").response()
    return card


def _model_card(request: Request) -> dict:
    engine = request.app.state.engine.engine
    created = getattr(request.app.state, "created", None) or int(time.time())
    return {"id": engine.model_name, "object": "model", "created": created, "owned_by": "flashpage",
            "max_model_len": engine.max_model_len}


def install_openai(app: FastAPI, limits: ServerLimits | None = None) -> None:
    """Include the /v1 routes (bounded by `limits`, as /generate) and make /v1 errors (validation,
    unknown route) OpenAI-shaped, delegating other paths to whatever handled them before."""
    app.state.created = int(time.time())
    app.state.limits = limits
    app.include_router(router)
    prev_validation = app.exception_handlers.get(RequestValidationError, request_validation_exception_handler)
    prev_http = app.exception_handlers.get(StarletteHTTPException, http_exception_handler)

    async def on_validation(request: Request, exc: RequestValidationError):
        if request.url.path.startswith("/v1/"):
            return validation_error(exc).response()
        return await prev_validation(request, exc)

    async def on_http(request: Request, exc: StarletteHTTPException):
        if request.url.path.startswith("/v1/"):
            kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
            return JSONResponse(OpenAIError(exc.status_code, str(exc.detail), kind, code=code).body(),
                                status_code=exc.status_code, headers=getattr(exc, "headers", None))
        return await prev_http(request, exc)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
