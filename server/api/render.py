"""POST /v1/completions/render and POST /v1/chat/completions/render, in vLLM's shapes: a request
prepared as its route would prepare it (model checked, chat template rendered, prompts tokenized,
sampling fields validated), answered with the token ids and parameters instead of being run.

Why a server needs them: prefix-aware routers tokenize every request before they choose a replica.
vllm-router's `cache_aware` policy asks each replica's /v1/completions/render (or
/v1/chat/completions/render) for the prompt's tokens, and only where that is a 404 falls back to
/tokenize, on every replica, for every request: without these routes each routed request cost
each replica a 404 and a /tokenize before the request itself was sent.

The answer is a list, one entry per prompt (a chat has one): {request_id, token_ids,
sampling_params, model, stream}, where `sampling_params` are the parameters the engine would run
the prompt's first choice with (server/sampling_params.py; the `n` choices differ only in their
seeds) plus `n`. Errors are the routes' own, with the same status codes. Nothing is queued, so the
waiting-queue bound does not apply, and a structured-output spec is not compiled here (the route
that runs the request compiles it and answers its 400).
"""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from server.api.openai import completion_choices, completion_max_tokens
from server.api.openai_chat import chat_choices
from server.api.openai_chat_protocol import ChatCompletionRequest
from server.api.openai_protocol import ChoiceBase, CompletionRequest, prompt_count
from server.api.openai_serving import ROUTE_ERRORS, answer, begin, cap_choices, encode_json, request_id

router = APIRouter(prefix="/v1")


class RenderedRequest(BaseModel):
    """One prompt, prepared: what the engine would be given for it."""

    request_id: str
    token_ids: list[int]
    sampling_params: dict
    model: str
    stream: bool


@router.post("/completions/render", response_model=list[RenderedRequest], responses=ROUTE_ERRORS)
async def render_completions(body: CompletionRequest, request: Request):
    """The token ids and sampling parameters /v1/completions would run this body with, per prompt."""
    return await answer(_render_completions(body, request))


@router.post("/chat/completions/render", response_model=list[RenderedRequest], responses=ROUTE_ERRORS)
async def render_chat_completions(body: ChatCompletionRequest, request: Request):
    """The token ids (the conversation rendered by the chat template) and sampling parameters
    /v1/chat/completions would run this body with."""
    return await answer(_render_chat(body, request))


async def _render_completions(body: CompletionRequest, request: Request) -> Response:
    engine, limits = begin(body, request)
    cap_choices(prompt_count(body.prompt), body.n)  # the route's cap, before any tokenizing
    choices = await completion_choices(engine, limits, body, completion_max_tokens(body))
    return _answer(request, "cmpl-", engine.model_name, body, choices[::body.n])


async def _render_chat(body: ChatCompletionRequest, request: Request) -> Response:
    engine, limits = begin(body, request)
    choices = await chat_choices(engine, limits, body, body.conversation(limits))
    return _answer(request, "chatcmpl-", engine.model_name, body, choices[:1])


def _answer(request: Request, prefix: str, model: str, body, firsts: list[ChoiceBase]) -> Response:
    rid = request_id(request)
    # Encoded here, not returned as the models: FastAPI would validate every id list against them
    # again. msgspec, as the SSE events: a router asks every replica for this before each request.
    prepared = [{"request_id": f"{prefix}{rid}-{i}", "token_ids": c.ids,
                 "sampling_params": {**dataclasses.asdict(c.params), "n": body.n},
                 "model": model, "stream": body.stream} for i, c in enumerate(firsts)]
    return Response(encode_json(prepared), media_type="application/json")
