"""HTTP API (FastAPI): POST /generate, GET /health.

Bodies are validated by pydantic before anything reaches the engine (422 names the field);
requests the model cannot serve as asked get a 400 that says the numbers. With `stream: true` the
response is server-sent events: one event per engine step that produced tokens, then a final event
carrying `finish_reason` and usage, then `data: [DONE]`.
"""

from __future__ import annotations

import json
import uuid
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.async_engine import AsyncEngine, EngineDeadError
from server.engine import RequestError
from server.sampling import SamplingParams


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(None, description="Text prompt (give this or prompt_token_ids).")
    prompt_token_ids: list[int] | None = Field(None, description="Pre-tokenized prompt.")
    max_tokens: int = Field(16, ge=1, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 = no top-k filter.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Per-request seed: same seed, same tokens.")
    stop: list[str] | str | None = Field(None, description="Stop strings; not included in the output.")
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of 'prompt' or 'prompt_token_ids'")
        return self

    def sampling_params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=[s for s in stop if s],
                              stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class GenerateResponse(BaseModel):
    id: str
    text: str
    token_ids: list[int]
    finish_reason: Literal["stop", "length"] | None
    usage: Usage


def error(status: int, message: str, kind: str = "invalid_request_error", headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status, headers=headers)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def create_app(engine: AsyncEngine) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.stop()

    app = FastAPI(title="flashpage", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine
    tokenizer = engine.engine.tokenizer

    @app.get("/health")
    async def health():
        if engine.dead is not None:
            return error(503, f"engine failed: {engine.dead!r}", "engine_dead")
        return {"status": "ok"}

    @app.post("/generate", response_model=GenerateResponse,
              responses={400: {"description": "The request does not fit the model or the cache"}})
    async def generate(body: GenerateRequest, request: Request):
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"X-Request-ID": rid}
        ids = body.prompt_token_ids if body.prompt_token_ids is not None else tokenizer.encode(body.prompt)
        params = body.sampling_params()
        try:
            stream = engine.generate(rid, ids, params)
            first = await anext(stream)  # surfaces validation errors before any response starts
        except RequestError as e:
            return error(400, str(e), headers=headers)
        except EngineDeadError as e:
            return error(503, str(e), "engine_dead", headers=headers)

        if body.stream:
            return StreamingResponse(_sse(rid, first, stream), media_type="text/event-stream", headers=headers)
        last = first
        try:
            async for last in stream:
                pass
        finally:
            await stream.aclose()
        return JSONResponse({"id": rid, "text": last.text, "token_ids": last.token_ids,
                             "finish_reason": last.finish_reason,
                             "usage": _usage(last.prompt_tokens, last.completion_tokens)}, headers=headers)

    return app


async def _sse(rid: str, first, stream):
    """One SSE event per engine step's tokens, then the final event and [DONE]. Closing the stream
    (the client went away) aborts the request."""
    last = first
    try:
        while True:
            event = {"id": rid, "text": last.new_text, "token_ids": last.new_token_ids, "finished": False}
            yield f"data: {json.dumps(event)}\n\n"
            if last.finished:
                break
            last = await anext(stream)
    finally:
        await stream.aclose()
    final = {"id": rid, "text": "", "token_ids": [], "finished": True, "finish_reason": last.finish_reason,
             "usage": _usage(last.prompt_tokens, last.completion_tokens)}
    yield f"data: {json.dumps(final)}\n\n"
    yield "data: [DONE]\n\n"
