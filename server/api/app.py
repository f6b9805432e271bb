"""HTTP API (FastAPI): POST /generate, GET /health, GET /get_load.

Bodies are validated by pydantic before anything reaches the engine (422 names the field);
requests the model cannot serve as asked get a 400 that says the numbers. With `stream: true` the
response is server-sent events: one event per engine step that produced tokens, then a final event
carrying `finish_reason` and usage, then `data: [DONE]`.

Reliability (issue 8; bounds and guards in server/api/guards.py): every field is bounded (schema bounds
here, configurable prompt bounds checked before the engine sees the prompt: 400), bodies over
--max-body-bytes are a 413 before parsing, non-UTF-8 bodies a 400; a full waiting queue or a
draining server is a 503 with Retry-After; a failed engine step is a 500 carrying the request id
(for a stream: a final event with finish_reason "error" and an `error` object); a non-streaming
client that disconnects has its request aborted. `GET /debug/kv` reports KV blocks free / total.
"""

from __future__ import annotations

import uuid
from contextlib import asynccontextmanager
from typing import Annotated, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.bridge.async_engine import AsyncEngine, EngineDeadError, RequestFailedError, ServiceUnavailableError
from server.engine import RequestError
from server.api.guards import (MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOKENS_BOUND, MAX_TOP_K,
                           ClientDisconnected, GuardMiddleware, LimitError, ServerLimits, check_prompt_chars,
                           check_prompt_tokens, check_request_tokens, has_surrogates, request_tokens,
                           until_disconnected)
from server.api.controls import ControlFields, Spec, StructuredOutputs, check_structured, pick_structured
from server.api.fields import readable_errors, refusal, unknown_fields, warn_ignored
from server.api.request_id import RequestIdMiddleware
from server.api.metrics import install_metrics
from server.api.openai import install_openai
from server.api.render import router as render_router
from server.api.responses.serving import router as responses_router
from server.api.openai_serving import DONE, EventStream, built, encode_json, event_json, sse
from server.api.tokens import install_tokens
from server.api.tokenize import encode, use_backend
from server.sampling_params import GREEDY_BELOW, SamplingParams, StructuredOutput

DEFAULTS = SamplingParams()  # the schema's defaults are the engine's


StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class SGLangSampling(BaseModel):
    """SGLang's `sampling_params` of a /generate body (what vllm-router forwards of one)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    max_new_tokens: int = Field(DEFAULTS.max_tokens, ge=1, le=MAX_TOKENS_BOUND)
    temperature: float = Field(DEFAULTS.temperature, ge=0.0, le=100.0)
    top_p: float = Field(DEFAULTS.top_p, gt=0.0, le=1.0)
    top_k: int = Field(DEFAULTS.top_k, ge=-1, le=MAX_TOP_K, description="0 or -1 (SGLang's 'off') = no top-k filter.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | StopString | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(DEFAULTS.presence_penalty, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(DEFAULTS.frequency_penalty, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(DEFAULTS.repetition_penalty, gt=0.0, le=10.0)
    min_new_tokens: int = Field(DEFAULTS.min_tokens, ge=0)
    json_schema: Spec | None = Field(None, description="A JSON schema, as JSON text.")
    regex: Spec | None = None
    ebnf: Spec | None = None

    def structured(self) -> StructuredOutput | None:
        return pick_structured(json_schema=self.json_schema and StructuredOutputs(json=self.json_schema).spec(),
                               regex=self.regex and StructuredOutput("regex", self.regex),
                               ebnf=self.ebnf and StructuredOutput("grammar", self.ebnf))


# The sampling fields of our own shape, which SGLang's nests in `sampling_params` (max_tokens there
# is max_new_tokens).
_TOP_LEVEL_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
                       "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                       "structured_outputs")


class GenerateRequest(ControlFields):
    # strict: JSON types as the schema says ("5" is not 5, true is not 1); NaN and Infinity are refused.
    # extra="allow": unknown top-level keys are the route's to ignore or refuse (server/api/fields.py)
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False, json_schema_extra={"examples": [
        {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0},
        {"prompt_token_ids": [464, 50, 51], "max_tokens": 4, "top_p": 0.9, "seed": 1, "stream": True},
        {"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}]})

    prompt: str | None = Field(None, description="Text prompt (give this or prompt_token_ids); at most "
                                                 "--max-prompt-chars characters.")
    prompt_token_ids: list[int] | None = Field(None, description="Pre-tokenized prompt, ids in the vocabulary; at "
                                                                 "most --max-prompt-tokens of them.")
    max_tokens: int = Field(DEFAULTS.max_tokens, ge=0, le=MAX_TOKENS_BOUND, description="Most tokens to generate (prompt + "
                            "max_tokens must fit the context); 0 only with prompt_logprobs.")
    temperature: float = Field(DEFAULTS.temperature, ge=0.0, le=100.0,
                               description=f"0 = greedy, and so is anything below {GREEDY_BELOW:g} (dividing the "
                                           "logits by less would overflow).")
    top_p: float = Field(DEFAULTS.top_p, gt=0.0, le=1.0)
    top_k: int = Field(DEFAULTS.top_k, ge=0, le=MAX_TOP_K, description="0 = no top-k filter.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Per-request seed: same seed, same tokens.")
    stop: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | StopString | None = Field(
        None, description="Stop strings; not included in the output.")
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description="Token ids that end generation (in the vocabulary).")
    ignore_eos: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description=(
        "Score the prompt: every token after the first with its log-probability and this many alternatives."))
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's: exactly one of json (a schema), regex, choice, grammar (EBNF), json_object.")
    stream: bool = False
    # SGLang's shape of the same request. Routers of the SGLang / vLLM ecosystem forward /generate
    # bodies in it: vllm-router keeps `text`, `input_ids` and `sampling_params` and drops our
    # top-level sampling fields, so a routed request must carry them here to keep them.
    text: str | None = Field(None, description="SGLang's name for 'prompt'.")
    input_ids: list[int] | None = Field(None, description="SGLang's name for 'prompt_token_ids'.")
    sampling_params: SGLangSampling | None = Field(
        None, description="SGLang's nesting of the sampling fields (max_new_tokens = max_tokens); give them here "
                          "or at the top level, not both.")

    @model_validator(mode="after")
    def _one_prompt(self):
        given = [name for name in ("prompt", "prompt_token_ids", "text", "input_ids") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'prompt' or 'prompt_token_ids' (or SGLang's 'text' or "
                             f"'input_ids'){'; got ' + ', '.join(given) if given else ''}")
        if self.sampling_params is not None and (both := self.model_fields_set.intersection(_TOP_LEVEL_SAMPLING)):
            raise ValueError(f"give sampling fields at the top level or in 'sampling_params', not both "
                             f"(top level: {', '.join(sorted(both))})")
        if self.text is not None:
            self.prompt = self.text
        if self.input_ids is not None:
            self.prompt_token_ids = self.input_ids
        s = self.sampling_params or self
        stops = [s.stop] if isinstance(s.stop, str) else list(s.stop or [])
        for name, text in [("prompt", self.prompt)] + [("stop", stop) for stop in stops]:
            if text is not None and has_surrogates(text):
                raise ValueError(f"'{name}' holds a lone UTF-16 surrogate, which is not text")
        return self

    def engine_params(self) -> SamplingParams:
        """The engine's SamplingParams, from the top-level fields or SGLang's sampling_params
        (RequestError for a logit_bias key that is no token id, or two kinds of structured output)."""
        controls = self.control_params()
        if (s := self.sampling_params) is not None:
            max_tokens, top_k = s.max_new_tokens, max(s.top_k, 0)
            controls.update(presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                            repetition_penalty=s.repetition_penalty, min_tokens=s.min_new_tokens)
            structured = s.structured()
        else:
            s, max_tokens, top_k = self, self.max_tokens, self.top_k
            structured = self.structured_outputs and self.structured_outputs.spec()
        stop = [s.stop] if isinstance(s.stop, str) else list(s.stop or [])
        return SamplingParams(max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=top_k,
                              seed=s.seed, stop=[x for x in stop if x], stop_token_ids=list(s.stop_token_ids or []),
                              ignore_eos=s.ignore_eos, prompt_logprobs=self.prompt_logprobs, structured=structured,
                              **controls)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class GenerateResponse(BaseModel):
    id: str
    text: str
    token_ids: list[int]
    prompt_logprobs: list[list[tuple[int, float]] | None] | None = Field(
        None, description="With prompt_logprobs: per prompt token, null for the first, then [[id, logprob], "
                          "[alternative id, logprob], ...]")
    finish_reason: Literal["stop", "length", "timeout", "abort"] | None = Field(
        description="timeout: past --request-timeout; abort: cut off by shutdown (text so far in both)")
    usage: Usage


class ErrorBody(BaseModel):
    message: str
    type: str
    request_id: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class KVDebug(BaseModel):
    kv_blocks_total: int
    kv_blocks_free: int
    kv_cache_dtype: str  # the cache's storage: the model's dtype, or fp8_e4m3 / fp8_e5m2 (--kv-cache-dtype)
    kv_tokens_total: int  # tokens the cache holds (blocks x block size): twice as many with fp8
    kv_bytes_per_token: int  # every layer's K and V of one token
    requests_active: int
    requests_running: int
    requests_waiting: int
    engine_sequences: int
    preemptions: int
    generated_tokens: int


_ERRORS = {400: "The request breaks a limit or does not fit the model or the cache",
           401: "Missing or wrong API key (--api-key)", 413: "Body larger than --max-body-bytes",
           500: "The engine step running the request failed (the id is in the body and X-Request-ID)",
           503: "Shutting down, too many requests waiting (see Retry-After), or the engine is dead"}
_SSE_EVENT = {  # OpenAPI 3.1: the schema of one event. data: a JSON chunk ({id, text, token_ids, finished}; the
    # last one adds finish_reason, usage, and after a failure `error`), then the literal [DONE].
    "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
_GENERATE_RESPONSES = {200: {"content": {"text/event-stream": {"schema": _SSE_EVENT}},
                             "description": "JSON, or with stream: true server-sent events"},
                       **{k: {"model": ErrorResponse, "description": v} for k, v in _ERRORS.items()}}


def error(status: int, message: str, kind: str = "invalid_request_error", headers=None, rid=None) -> JSONResponse:
    body = {"message": message, "type": kind, **({"request_id": rid} if rid else {})}
    return JSONResponse({"error": body}, status_code=status, headers=headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 shape, without echoing the input (it may be huge, or NaN, which is not JSON)."""
    detail = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
              for e in readable_errors(exc.errors())]
    return JSONResponse({"detail": detail}, status_code=422)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def create_app(engine: AsyncEngine, limits: ServerLimits | None = None) -> FastAPI:
    limits = limits or ServerLimits()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.stop()
        if (compiler := getattr(app.state, "spec_compiler", None)) is not None:
            compiler.close()  # its compile processes (server/api/controls.py)

    app = FastAPI(title="flashpage", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine
    app.state.ignored_fields = set()  # (route, field names) already warned about (server/api/fields.py)
    tokenizer = engine.engine.tokenizer
    app.state.tokenizer_backend = use_backend(tokenizer, limits.tokenizer_backend)  # fastokens or the tokenizer's
    app.add_exception_handler(RequestValidationError, _validation_error)

    @app.get("/health", responses={503: {"model": ErrorResponse, "description": "Draining or engine dead"}})
    async def health():
        if engine.dead is not None:
            return error(503, f"engine failed: {engine.dead!r}", "engine_dead")
        if engine.draining:
            return error(503, "shutting down", "draining")
        return {"status": "ok"}

    @app.get("/get_load")
    async def get_load():
        """Requests in flight (running or waiting), what vllm-router's power_of_two policy polls."""
        return {"load": engine.load}

    @app.get("/debug/kv", response_model=KVDebug)
    async def debug_kv():
        """KV-cache occupancy and request counts: cheap, read-only (leak tests poll it)."""
        s = engine.engine.snapshot()
        return {"kv_blocks_total": s.kv_blocks_total, "kv_blocks_free": s.kv_blocks_free,
                "kv_cache_dtype": s.kv_cache_dtype, "kv_tokens_total": s.kv_blocks_total * s.kv_block_size,
                "kv_bytes_per_token": s.kv_bytes_per_token,
                "requests_active": engine.num_active, "requests_running": s.running,
                "requests_waiting": s.waiting, "engine_sequences": s.sequences,
                "preemptions": s.preemptions, "generated_tokens": s.generation_tokens}

    @app.post("/generate", response_model=GenerateResponse, responses=_GENERATE_RESPONSES)
    async def generate(body: GenerateRequest, request: Request):
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"X-Request-ID": rid}
        if extra := unknown_fields(body):
            if limits.unknown_fields == "reject":
                return await _validation_error(request, refusal(extra))
            warn_ignored("/generate", extra, app.state.ignored_fields)
        try:
            if body.prompt is not None:
                check_prompt_chars(body.prompt, limits)  # before the tokenizer sees it
                [ids] = await encode(tokenizer, [body.prompt])
            else:
                ids = body.prompt_token_ids
            check_prompt_tokens(len(ids), limits)
            params = body.engine_params()
            check_request_tokens(request_tokens(params.max_tokens, None, len(ids), params.prompt_logprobs), limits,
                                 f"{params.max_tokens} tokens" + ("" if params.prompt_logprobs is None else
                                 f", {len(ids)} prompt tokens scored with {params.prompt_logprobs} alternatives"))
            engine.engine.validate(ids, params)  # the cheap checks (vocabulary, context) before any compile
            await check_structured(app.state, engine.engine, params.structured)
            # A client may reuse its X-Request-ID while the earlier request still runs.
            erid = rid if not engine.in_use(rid) else f"{rid}-{uuid.uuid4().hex[:8]}"
            stream = engine.generate(erid, ids, params, validated=True)
            first = await anext(stream)  # surfaces validation errors before any response starts
        except (RequestError, LimitError) as e:
            return error(400, str(e), headers=headers)
        except ServiceUnavailableError as e:
            return error(503, str(e), "unavailable", headers={**headers, **e.headers})
        except EngineDeadError as e:
            return error(503, str(e), "engine_dead", headers=headers)
        except RequestFailedError as e:
            return error(500, str(e), "internal_error", headers=headers, rid=rid)

        if body.stream:
            return EventStream(_sse(rid, first, stream), headers=headers)
        last, prompt_logprobs = first, first.prompt_logprobs
        try:
            async for last in until_disconnected(request, stream):  # a client that leaves aborts it
                prompt_logprobs = prompt_logprobs or last.prompt_logprobs
        except ClientDisconnected:
            return error(499, "client disconnected", headers=headers)
        except EngineDeadError as e:
            return error(503, str(e), "engine_dead", headers=headers)
        except RequestFailedError as e:
            return error(500, str(e), "internal_error", headers=headers, rid=rid)
        result = {"id": rid, "text": last.text, "token_ids": last.token_ids, "finish_reason": last.finish_reason,
                  "usage": _usage(last.prompt_tokens, last.completion_tokens)}

        def build() -> bytes:  # msgspec: ~10x faster than the json.dumps of JSONResponse
            if body.prompt_logprobs is not None:  # the engine's packed scores, expanded here
                result["prompt_logprobs"] = [None] + (prompt_logprobs.entries() if prompt_logprobs else [])
            return encode_json(result)

        # prompt scores are up to --max-request-tokens pairs: a large answer is built on a thread
        size = len(last.token_ids) + (prompt_logprobs.pairs if prompt_logprobs else 0)
        return Response(await built(size, build), media_type="application/json", headers=headers)

    app.add_middleware(GuardMiddleware, limits=limits)  # API key, body size, UTF-8 (server/api/guards.py)
    install_openai(app, limits)  # /v1/completions, /v1/chat/completions, /v1/models, OpenAI errors
    install_tokens(app, limits)  # POST /tokenize, /detokenize (vLLM's shapes), OpenAI errors
    app.include_router(render_router)  # POST /v1/completions/render, /v1/chat/completions/render (vLLM's)
    app.include_router(responses_router)  # POST /v1/responses (stateless)
    install_metrics(app, engine.engine)  # GET /metrics
    app.add_middleware(RequestIdMiddleware)  # last added = outermost: X-Request-ID on every response
    return app


async def _sse(rid: str, first, stream):
    """One SSE event per engine step's tokens, then the final event and [DONE], as bytes (the part
    of an event that never changes encoded once per request). Closing the stream (the client went
    away) aborts the request."""
    head = b'data: {"id":' + event_json(rid) + b',"text":'
    last, failure = first, None
    try:
        while True:
            if last.prompt_logprobs is None:  # the same JSON as the dict below, built without one
                yield b"".join((head, event_json(last.new_text), b',"token_ids":', encode_json(last.new_token_ids),
                                b',"finished":false}\n\n'))
            else:  # on the first event only, expanded from the engine's packed scores (a large one on a thread)
                event = {"id": rid, "text": last.new_text, "token_ids": last.new_token_ids, "finished": False}
                scores = last.prompt_logprobs
                yield await built(scores.pairs, lambda: sse({**event, "prompt_logprobs": [None] + scores.entries()}))
            if last.finished:
                break
            try:
                last = await anext(stream)
            except Exception as e:  # the step failed or the engine died: an error event, then [DONE]
                failure = e
                break
    finally:
        await stream.aclose()
    final = {"id": rid, "text": "", "token_ids": [], "finished": True, "finish_reason": last.finish_reason,
             "usage": _usage(last.prompt_tokens, last.completion_tokens)}
    if failure is not None:
        kind = "engine_dead" if isinstance(failure, EngineDeadError) else "internal_error"
        final.update(finish_reason="error", error={"message": str(failure), "type": kind, "request_id": rid})
    yield sse(final) + DONE  # one write
