"""POST /tokenize and POST /detokenize, in vLLM's request and response shapes, so that clients can
count tokens (and see them) without generating anything.

- /tokenize takes a completion body {model?, prompt, add_special_tokens (true), return_token_strs
  (false)} or a chat body {model?, messages, add_generation_prompt (true), continue_final_message
  (false), add_special_tokens (false), return_token_strs (false), and the chat route's tools and
  chat_template_kwargs}, told apart by `messages`, and
  answers {count, max_model_len, tokens, token_strs (null unless asked for)}. A chat body's
  `messages` are read as /v1/chat/completions reads them and rendered by the same chat template
  (server/api/chat_template.py), so with the defaults its tokens are exactly that route's prompt
  (with tool_choice "none" the route shows the template no tools).
  `continue_final_message: true` leaves the generation prompt off (vLLM's rule: giving both as
  true is a 400). The count is not checked against the context: `max_model_len` is there for
  the client to compare.
- /detokenize takes {model?, tokens} and answers {prompt}: the ids decoded as the tokenizer
  decodes them, special tokens included. An id outside the tokenizer's vocabulary is a 400 that
  names it and the vocabulary's size.
- As on /v1: `model`, when given, must be the served name (404 otherwise); unknown top-level
  fields are ignored with a warning or refused (--unknown-fields); --max-prompt-chars and
  --max-prompt-tokens bound what is tokenized (and --max-prompt-tokens the ids to decode); long
  inputs are encoded and decoded off the event loop (server/api/tokenize.py); every error,
  a body that does not validate included, is OpenAI's {"error": {...}} with a 400, not FastAPI's 422.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Discriminator, Field, Tag

from server.api.chat_template import ChatTemplateError, render_chat
from server.api.fields import refusal, unknown_fields, warn_ignored
from server.api.guards import LimitError, ServerLimits, check_prompt_chars, check_prompt_tokens, has_surrogates
from server.api.openai_chat_protocol import ChatCompletionRequest, ChatMessage
from server.api.openai_protocol import BODY, OpenAIError, validation_error
from server.api.openai_serving import answer, openai_errors
from server.api.tokenize import decode, encode, encode_now, token_strings
from server.api.tools.request import Tools, template_tools

PATHS = frozenset({"/tokenize", "/detokenize"})
ERRORS = {400: {"description": "Invalid request, or over a prompt limit"}, 404: {"description": "Unknown model"}}


class TokenizeCompletionRequest(BaseModel):
    model_config = BODY  # strict, unknown top-level fields kept for --unknown-fields (server/api/fields.py)

    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (BOS, for one).")
    return_token_strs: bool | None = Field(False, description="Also return each token as the vocabulary spells it.")


class TokenizeChatRequest(BaseModel):
    model_config = BODY

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = Field(True, description="End with the assistant's generation prompt, as "
                                                          "/v1/chat/completions does.")
    continue_final_message: bool = Field(False, description="Leave the last message open, for the model to "
                                                            "continue (no generation prompt then).")
    add_special_tokens: bool = Field(False, description="Add the tokenizer's special tokens on top of what the "
                                                        "template writes (a second BOS, as a rule).")
    return_token_strs: bool | None = Field(False, description="Also return each token as the vocabulary spells it.")
    tools: Tools | None = Field(None, description="The tools the template shows, as the chat route's.")
    chat_template_kwargs: dict | None = None

    # The chat route's own reading of `messages` (text parts joined, surrogates refused, and
    # --max-prompt-chars over the contents), so that both count the same conversation.
    conversation = ChatCompletionRequest.conversation
    template_kwargs = ChatCompletionRequest.template_kwargs


def _body_kind(body: object) -> str:
    # Chosen by a key rather than by trying both models: a body that fails as a chat body is
    # reported as one (messages.0.role), not as a completion body missing `prompt`.
    return "chat" if isinstance(body, dict) and "messages" in body else "completion"


TokenizeRequest = Annotated[Annotated[TokenizeCompletionRequest, Tag("completion")]
                            | Annotated[TokenizeChatRequest, Tag("chat")], Discriminator(_body_kind)]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = BODY

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def _begin(body: BaseModel, request: Request, limits: ServerLimits):
    """The checks /v1's `begin` makes, for these bodies (which carry no sampling fields): unknown
    fields, then the model when one is named. The engine (tokenizer, model_name, max_model_len)."""
    if isinstance(body, TokenizeChatRequest) and "prompt" in (body.__pydantic_extra__ or {}):
        # Not an unknown field to ignore: the client meant one of the two and would count the wrong one.
        raise OpenAIError(400, "give 'prompt' (text) or 'messages' (a chat), not both", param="prompt")
    if extra := unknown_fields(body):
        if limits.unknown_fields == "reject":
            raise validation_error(refusal(extra))
        warn_ignored(request.url.path, extra, request.app.state.ignored_fields)
    engine = request.app.state.engine.engine
    if body.model is not None and body.model != engine.model_name:
        raise OpenAIError(404, f"The model '{body.model}' does not exist; this server serves '{engine.model_name}'",
                          param="model", code="model_not_found")
    return engine


async def _prompt_ids(body: TokenizeCompletionRequest, tokenizer, limits: ServerLimits) -> list[int]:
    if has_surrogates(body.prompt):  # no tokenizer can encode them
        raise OpenAIError(400, "'prompt' holds a lone UTF-16 surrogate, which is not text", param="prompt")
    try:
        check_prompt_chars(body.prompt, limits)  # before the tokenizer sees it
        [ids] = await encode(tokenizer, [body.prompt], body.add_special_tokens)
        check_prompt_tokens(len(ids), limits)
    except LimitError as e:
        raise OpenAIError(400, str(e), param="prompt") from None
    return ids


def _render(tokenizer, messages: list[dict], template: str | None, generation_prompt: bool,
            continue_final: bool, special: bool, tools: list[dict] | None = None,
            kwargs: dict | None = None) -> list[int]:
    """The conversation's ids. Blocking (Jinja and the tokenizer): run it off the event loop."""
    if generation_prompt or (template is None and not getattr(tokenizer, "chat_template", None)):
        # The chat route's own rendering: the same prompt, and the same 400 without a template.
        text, ids = render_chat(tokenizer, messages, template, tools, kwargs)
    else:
        # render_chat always adds the generation prompt; this is its rendering without it.
        try:
            text = tokenizer.apply_chat_template(messages, chat_template=template, tools=tools, tokenize=False,
                                                 add_generation_prompt=False, continue_final_message=continue_final,
                                                 **(kwargs or {}))
        except Exception as e:  # as render_chat: jinja2 errors, raise_exception(...), no final message to continue
            raise ChatTemplateError(f"the chat template failed to render: {type(e).__name__}: {e}") from None
        return encode_now(tokenizer, [text], add_special_tokens=special)[0]
    return encode_now(tokenizer, [text], add_special_tokens=True)[0] if special else ids


async def _chat_ids(body: TokenizeChatRequest, tokenizer, limits: ServerLimits) -> list[int]:
    if body.continue_final_message and body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
        raise OpenAIError(400, "'continue_final_message' and 'add_generation_prompt' cannot both be true",
                          param="continue_final_message")
    messages = body.conversation(limits)  # checked before any rendering
    generation_prompt = body.add_generation_prompt and not body.continue_final_message
    try:
        ids = await asyncio.to_thread(_render, tokenizer, messages, limits.chat_template, generation_prompt,
                                      body.continue_final_message, body.add_special_tokens,
                                      template_tools(body.tools, None), body.template_kwargs())
        check_prompt_tokens(len(ids), limits, "messages")
    except (ChatTemplateError, LimitError) as e:
        raise OpenAIError(400, str(e), param="messages") from None
    return ids


async def _tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request,
                    limits: ServerLimits) -> JSONResponse:
    engine = _begin(body, request, limits)
    tokenizer = engine.tokenizer
    if isinstance(body, TokenizeChatRequest):
        ids = await _chat_ids(body, tokenizer, limits)
    else:
        ids = await _prompt_ids(body, tokenizer, limits)
    strs = await token_strings(tokenizer, ids) if body.return_token_strs else None
    # A JSONResponse, not the dict: FastAPI would validate a long id list against the model again.
    return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                         "token_strs": strs})


async def _detokenize(body: DetokenizeRequest, request: Request, limits: ServerLimits) -> JSONResponse:
    engine = _begin(body, request, limits)
    tokenizer = engine.tokenizer
    try:
        check_prompt_tokens(len(body.tokens), limits, "tokens")
    except LimitError as e:
        raise OpenAIError(400, str(e), param="tokens") from None
    # The tokenizer's vocabulary, added tokens included: the ids it can decode. (A model's may be
    # padded past it; the tokenizer would decode those ids to nothing, or fail on negative ones.)
    vocab = len(tokenizer)
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise OpenAIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return JSONResponse({"prompt": await decode(tokenizer, body.tokens)})


def install_tokens(app: FastAPI, limits: ServerLimits | None = None) -> None:
    """Add POST /tokenize and POST /detokenize (bounded by `limits`, as the other routes), and make
    their validation and HTTP errors OpenAI-shaped, leaving other paths to the handlers before."""
    limits = limits or ServerLimits()

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(body: TokenizeRequest, request: Request):
        """Token ids of a prompt, or of a chat as /v1/chat/completions renders it (vLLM's shape)."""
        return await answer(_tokenize(body, request, limits))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: DetokenizeRequest, request: Request):
        """The text of token ids (vLLM's shape)."""
        return await answer(_detokenize(body, request, limits))

    openai_errors(app, PATHS.__contains__, _validation_error)  # a 405 for a GET, as /v1 answers one


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """/v1's 400 for a body that does not validate, with the union's tag taken out of each location
    (body.chat.messages.0 -> body.messages.0) so that it names the field as the client wrote it."""
    errors = []
    for e in exc.errors():
        loc = tuple(e.get("loc", ()))
        if loc[:1] == ("body",) and loc[1:2] in (("chat",), ("completion",)):
            loc = loc[:1] + loc[2:]
        errors.append({**e, "loc": loc})
    first = errors[0] if errors else {}
    if first.get("loc") == ("body", "prompt") and first.get("type") not in ("missing", "extra_forbidden"):
        # validation_error's own words for a bad prompt list the completions' four shapes
        return OpenAIError(400, "'prompt' must be a string", param="prompt")
    return validation_error(RequestValidationError(errors))
