"""OpenAI-compatible API: POST /v1/completions, GET /v1/models, GET /v1/models/{id}; `install_openai`
also adds POST /v1/chat/completions (server/api/openai_chat.py). What both routes share once a body
is parsed (engine requests, streaming, disconnects) is in server/api/openai_serving.py.

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
- `echo`: the prompt text is prepended. With `logprobs`, every prompt token after the first has
  its real log-probability and top alternatives, computed in the same prefill pass (such requests
  take no prefix-cache hits: every position is computed); `max_tokens: 0` with `echo` scores the
  prompt and generates nothing (what lm-evaluation-harness sends for log-likelihoods); without
  `logprobs` it answers with the prompt's text and runs nothing on the engine.
- `presence_penalty`, `frequency_penalty` (-2..2), `logit_bias` (token id -> bias, clamped to
  +-100; ids checked against the vocabulary) and the extensions `repetition_penalty`, `min_tokens`:
  applied on the device for the whole batch (server/worker/logits.py).
- Structured output: `response_format` ({"type": "json_object"} or {"type": "json_schema",
  "json_schema": {"schema": ...}}) or vLLM's `structured_outputs` ({json | regex | choice | grammar
  | json_object}); compiled with XGrammar before the request is queued (an invalid one is a 400
  saying what is wrong); output ends when the grammar is complete.
- Accepted but only at their defaults (other values are a 400): `suffix`, `best_of` (= n).
  `user` is logged. Extensions (pass with `extra_body`): `top_k`, `ignore_eos`, `stop_token_ids`.
"""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter, FastAPI, Request

from server.api.guards import ServerLimits
from server.api.openai_protocol import (DEFAULTS, Choice, CompletionRequest, OpenAIError, echo_only, parse_prompts,
                                        prompt_count)
from server.api.openai_chat import chat_completions
from server.api.openai_serving import (ROUTE_ERRORS, Route, admit_choices, answer, begin, cap_choices, cap_request_tokens,
                                       check_structured_output, choice_params, openai_errors, respond)
from server.logs import clip

log = logging.getLogger("flashpage.openai")
router = APIRouter(prefix="/v1")
COMPLETION = Route("completion", "cmpl-", "text_completion", "text_completion")


@router.post("/completions", responses=ROUTE_ERRORS)
async def completions(body: CompletionRequest, request: Request):
    return await answer(_completions(body, request))


async def _completions(body: CompletionRequest, request: Request):
    engine, limits = begin(body, request)
    max_tokens = completion_max_tokens(body)
    if echo_only(body.echo, max_tokens, body.logprobs):  # answered without the engine: no place to wait for
        cap_choices(prompt_count(body.prompt), body.n)
    else:
        admit_choices(request, prompt_count(body.prompt), body.n)  # before any per-prompt work
    choices = await completion_choices(engine, limits, body, max_tokens)
    await check_structured_output(request, engine, body)  # after the cheap checks (prompts, context)
    log.info("completion: %d prompt(s), n=%d, max_tokens=%d, stream=%s%s", len(choices) // body.n, body.n,
             max_tokens, body.stream, f", user={clip(body.user)}" if body.user else "")
    return await respond(request, COMPLETION, body, choices, sum(len(c.ids) for c in choices[::body.n]))


def completion_max_tokens(body: CompletionRequest) -> int:
    max_tokens = DEFAULTS.max_tokens if body.max_tokens is None else body.max_tokens
    if max_tokens == 0 and not body.echo:
        raise OpenAIError(400, "'max_tokens' may be 0 only with 'echo': true (to score the prompt)",
                          param="max_tokens")
    return max_tokens


async def completion_choices(engine, limits: ServerLimits, body: CompletionRequest, max_tokens: int) -> list[Choice]:
    """The body's choices, prompt by prompt (`body.n` each): its prompts tokenized and each choice's
    parameters validated, as /v1/completions runs them and /v1/completions/render shows them."""
    prompts = await parse_prompts(body.prompt, engine.tokenizer, limits)
    # echo with logprobs scores the prompt in the prefill pass (0 alternatives suffice for echo alone)
    scored = (body.logprobs if body.logprobs is not None else 0) if body.echo and (
        body.logprobs is not None or max_tokens == 0) else None
    choices: list[Choice] = []
    for text, ids in prompts:
        for params in choice_params(engine, body, ids, max_tokens, body.logprobs, "prompt", scored):
            choices.append(Choice(len(choices), text, ids, params, body.echo, engine.tokenizer,
                                  bool(body.return_token_ids)))
    cap_request_tokens(limits, choices)
    return choices


router.add_api_route("/chat/completions", chat_completions, methods=["POST"], responses=ROUTE_ERRORS)


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
    # quantization: the weights' format (null for 16-bit), weight_bytes: their size on the device
    return {"id": engine.model_name, "object": "model", "created": created, "owned_by": "flashpage",
            "max_model_len": engine.max_model_len, "quantization": engine.quantization,
            "weight_bytes": engine.weight_bytes}


def install_openai(app: FastAPI, limits: ServerLimits | None = None) -> None:
    """Include the /v1 routes (bounded by `limits`, as /generate) and make /v1 errors (validation,
    unknown route) OpenAI-shaped, delegating other paths to whatever handled them before."""
    app.state.created = int(time.time())
    app.state.limits = limits
    app.include_router(router)
    openai_errors(app, lambda path: path.startswith("/v1/"))
