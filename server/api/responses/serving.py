"""POST /v1/responses: the request becomes a chat request (protocol.py) and runs as one: rendered by
the chat template with its tools, its grammar set (tool calls, a JSON format, reasoning first) and
its parameters validated by the chat route's `chat_choices`; the reply is read into reasoning,
content and calls (server/api/assistant.py) and answered as output items, whole or as the
Responses stream's events (output.py), each SSE event named by its type. A reply cut off by
`max_output_tokens` is `status: "incomplete"` with `incomplete_details.reason: "max_output_tokens"`."""

from __future__ import annotations

import logging
import time
import uuid

import msgspec
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from server.api.assistant import AssistantReply
from server.api.guards import ClientDisconnected, ServerLimits, until_disconnected
from server.api.openai_chat import chat_choices
from server.api.openai_chat_protocol import ChatCompletionRequest
from server.api.openai_protocol import OpenAIError, from_engine_error, validation_error
from server.api.openai_serving import (ROUTE_ERRORS, EventStream, admit_choices, answer, begin,
                                       check_structured_output, check_unknown, request_id)
from server.api.responses.output import OutputBuilder, response_object, usage
from server.api.responses.protocol import ResponsesRequest
from server.logs import clip

log = logging.getLogger("flashpage.openai")
router = APIRouter(prefix="/v1")
_encode = msgspec.json.Encoder().encode
_INCOMPLETE = {"length": "max_output_tokens"}  # other ends (timeout, abort) are named as they are


@router.post("/responses", responses=ROUTE_ERRORS)
async def create_response(body: ResponsesRequest, request: Request):
    """OpenAI's Responses API (stateless): input items in, output items out."""
    return await answer(_create(body, request))


def event_bytes(event: dict) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + _encode(event) + b"\n\n"


async def _create(body: ResponsesRequest, request: Request):
    check_unknown(body, request, getattr(request.app.state, "limits", None) or ServerLimits())
    body.refused()
    try:
        chat = ChatCompletionRequest.model_validate(body.chat_body())
    except ValidationError as e:
        raise validation_error(RequestValidationError(e.errors())) from None
    engine, limits = begin(chat, request)
    admit_choices(request, 1, 1)
    messages = chat.conversation(limits)
    [choice] = await chat_choices(engine, limits, chat, messages)
    await check_structured_output(request, engine, chat)
    reply = choice.reply or AssistantReply()
    log.info("response: %d message(s), %d prompt tokens, max_output_tokens=%d, stream=%s%s%s", len(messages),
             len(choice.ids), choice.params.max_tokens, body.stream, f", tools={len(body.tools)}" if body.tools else "",
             f", user={clip(body.user)}" if body.user else "")
    aengine, rid = request.app.state.engine, request_id(request)
    admit_choices(request, 1, 1)  # again, now that it is built (as the chat route does)
    stream = aengine.generate(f"{rid}-{uuid.uuid4().hex[:8]}", choice.ids, choice.params, validated=True,
                              admitted=True)
    resp_id, created, builder = f"resp_{uuid.uuid4().hex}", int(time.time()), OutputBuilder()

    def finish(out) -> dict:
        status = "completed" if choice.finish_reason in ("stop", "tool_calls") else "incomplete"
        reason = None if status == "completed" else _INCOMPLETE.get(choice.finish_reason, choice.finish_reason)
        return response_object(resp_id, body, builder.items, status,
                               usage(len(choice.ids), out.cached_prompt_tokens, out.completion_tokens), created, reason)

    def step(out) -> list[dict]:
        text = choice.advance(out)
        parts = (reply.feed(text) if text else []) + (reply.end() if out.finished else [])
        if reply.calls and choice.finish_reason == "stop":
            choice.finish_reason = "tool_calls"
        return builder.add(parts) + (builder.close() if out.finished else [])

    try:
        first = await anext(stream)  # engine errors before the response starts keep their status code
    except Exception as e:
        await stream.aclose()
        raise from_engine_error(e, chat) from None
    if body.stream:
        return EventStream(_events(first, stream, step, finish, builder, resp_id, body, created),
                           headers={"Cache-Control": "no-cache"})
    last = first
    try:
        step(first)
        if not first.finished:
            async for last in until_disconnected(request, stream):
                step(last)
    except ClientDisconnected:
        return JSONResponse(OpenAIError(499, "client disconnected").body(), status_code=499)
    except Exception as e:
        raise from_engine_error(e, chat) from None
    finally:
        await stream.aclose()
    return finish(last)


async def _events(first, stream, step, finish, builder: OutputBuilder, resp_id: str, body, created: int):
    """The Responses stream: created, in_progress, each item's events, then completed (or incomplete,
    or failed with the error). Closing it (the client went away) aborts the request."""
    head = response_object(resp_id, body, [], "in_progress", None, created)
    try:
        yield event_bytes(builder.event("response.created", response=head)) + event_bytes(
            builder.event("response.in_progress", response=head))
        out = first
        while True:
            events = step(out)
            if out.finished:
                final = finish(out)
                kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
                events.append(builder.event(kind, response=final))
            if events:
                yield b"".join(event_bytes(e) for e in events)
            if out.finished:
                return
            try:
                out = await anext(stream)
            except Exception as e:  # the step failed or the engine died: the response failed
                error = from_engine_error(e).body()["error"]
                failed = response_object(resp_id, body, builder.items, "failed", None, created,
                                         error={"code": error["code"] or "server_error", "message": error["message"]})
                yield event_bytes(builder.event("response.failed", response=failed))
                return
    finally:
        await stream.aclose()

