"""POST /v1/chat/completions: OpenAI's chat schema over the same machinery as /v1/completions
(server/api/openai_serving.py).

- `messages`: roles system, user and assistant; `content` a string or a list of text parts
  (joined with newlines). Other part types (images, audio) and other roles (tool) are a 400.
- The prompt is the conversation rendered by the model's chat template, or `--chat-template FILE`
  in its place, with the assistant's generation prompt, then tokenized without adding special
  tokens (the template writes them): server/api/chat_template.py, off the event loop. No template
  at all is a 400 naming `--chat-template`; a template that fails to render is a 400 with its error.
- `max_completion_tokens` or the deprecated `max_tokens` (both given and different: 400); neither:
  the rest of the model's context, or less where the `n` choices and their logprobs would return
  more than --max-request-tokens together (then each gets its share).
- `logprobs: true` gives each token's log-probability, its bytes (of the token decoded alone) and
  `top_logprobs` (0..20) alternatives, from the sampling step as /v1/completions does.
- `n`, `seed` (choice j uses seed + j), `stop` (held back while streaming, so streamed and whole
  text agree), `stream` with `stream_options.include_usage`, `user` (logged), and the extensions
  `top_k`, `ignore_eos`, `stop_token_ids` behave as in /v1/completions, and so do the penalties,
  `logit_bias`, `min_tokens`, `response_format` and `structured_outputs`. Accepted only at their
  defaults: `tools`, `tool_choice`, `parallel_tool_calls`, `functions`, `function_call`, `store`,
  `modalities` (["text"]).
- Whole: a `chat.completion` whose choices hold `message: {role: "assistant", content}`. Streamed:
  `chat.completion.chunk`s; a choice's first chunk has `delta: {role: "assistant", content: ""}`,
  then content deltas, then an empty delta with `finish_reason`; then the usage chunk (when asked)
  and `data: [DONE]`.
"""

from __future__ import annotations

import logging

from fastapi import Request

from server.api.assistant import AssistantReply
from server.api.chat_template import ChatTemplateError, chat_prompt_ids
from server.api.guards import LimitError, ServerLimits, check_prompt_tokens
from server.api.openai_chat_protocol import ChatChoice, ChatCompletionRequest
from server.api.openai_protocol import OpenAIError, SamplingRequest
from server.api.openai_serving import (Route, admit_choices, answer, begin, cap_request_tokens, check_structured_output,
                                       choice_params, respond)
from server.api.reasoning import REASONING_PARSERS, ThinkSplitter
from server.api.tools.request import ToolError, plan_tools, template_tools
from server.api.tools.tags import as_format, reasoning_block, structural
from server.engine import RequestError
from server.logs import clip

log = logging.getLogger("flashpage.openai")
CHAT = Route("chat completion", "chatcmpl-", "chat.completion", "chat.completion.chunk")


async def chat_completions(body: ChatCompletionRequest, request: Request):
    """POST /v1/chat/completions, on the /v1 router of server/api/openai.py."""
    return await answer(_chat_completions(body, request))


async def _chat_completions(body: ChatCompletionRequest, request: Request):
    engine, limits = begin(body, request)
    admit_choices(request, 1, body.n)  # before rendering and tokenizing
    messages = body.conversation(limits)
    choices = await chat_choices(engine, limits, body, messages)
    await check_structured_output(request, engine, body)  # the reply's grammar, tools' included; after the cheap checks
    ids, max_tokens = choices[0].ids, choices[0].params.max_tokens
    log.info("chat completion: %d message(s), %d prompt tokens, n=%d, max_tokens=%d, stream=%s%s%s",
             len(messages), len(ids), body.n, max_tokens, body.stream,
             f", tools={len(body.tools)}" if body.tools else "", f", user={clip(body.user)}" if body.user else "")
    return await respond(request, CHAT, body, choices, len(ids),
                         {"prompt_token_ids": ids} if body.return_token_ids else None)


async def chat_choices(engine, limits: ServerLimits, body: ChatCompletionRequest, messages: list[dict]
                       ) -> list[ChatChoice]:
    """The body's `n` choices: the conversation rendered by the chat template (with the tools it may
    call and chat_template_kwargs; or the body's prompt_token_ids as they are) and tokenized, the
    reply's grammar (tool calls, reasoning first) set, each choice's parameters validated, as
    /v1/chat/completions runs them and its /render shows them."""
    limit, top_n = body.completion_limit(), body.top_n()
    settings = limits.tools
    try:
        wanted = SamplingRequest.structured(body)  # response_format or structured_outputs
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, settings, wanted is not None)
    except RequestError as e:
        raise OpenAIError(400, str(e), param="response_format") from None
    except ToolError as e:
        raise OpenAIError(400, str(e), param=e.param) from None
    try:
        if body.prompt_token_ids is not None:  # rendered before (a router's or an RL loop's /render)
            ids = list(body.prompt_token_ids)
        else:
            ids = await chat_prompt_ids(engine.tokenizer, messages, limits.chat_template,
                                        template_tools(body.tools, body.tool_choice), body.template_kwargs())
        check_prompt_tokens(len(ids), limits, "messages")
    except (ChatTemplateError, LimitError) as e:
        raise OpenAIError(400, str(e), param="messages") from None
    think = REASONING_PARSERS.get(settings.reasoning) if settings.reasoning else None
    state = think.state(engine.tokenizer.decode(ids[-32:])) if think is not None else None
    block = reasoning_block(think.grammar_mode(state), think.start, think.end) if think is not None else None
    if plan is not None:
        body._grammar = plan.grammar(wanted, block)
    elif wanted is not None and block is not None:
        body._grammar = structural(as_format(wanted), block)  # the answer's format, after reasoning
    if limit is None:  # the rest of the context, as far as --max-request-tokens allows the n choices
        share = limits.max_request_tokens // (body.n * (1 + (top_n or 0)))
        max_tokens = max(1, min(engine.max_model_len - len(ids), share))
    else:
        max_tokens = limit

    def reply() -> AssistantReply | None:
        if think is None and plan is None:
            return None
        return AssistantReply(ThinkSplitter(think, state) if think else None, plan.parser() if plan else None)

    choices = [ChatChoice(j, ids, params, engine.tokenizer, reply(), bool(body.return_token_ids))
               for j, params in enumerate(choice_params(engine, body, ids, max_tokens, top_n, "messages"))]
    cap_request_tokens(limits, choices)
    return choices
