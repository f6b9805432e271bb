"""The OpenAI protocol shared by /v1/completions and /v1/chat/completions (the fields both requests
have, error objects, usage, a choice's stop-string hold-back), and what is the completions' own: its
request schema, prompts, echo and legacy logprobs. Routes: server/api/openai.py; chat:
server/api/openai_chat_protocol.py."""

from __future__ import annotations

import functools
from typing import Annotated

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from server.bridge.async_engine import EngineDeadError
from server.engine import RequestError
from server.api.guards import (MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOKENS_BOUND, MAX_TOP_K,
                           LimitError, ServerLimits, check_prompt_chars, check_prompt_tokens, has_surrogates)
from server.api.controls import ControlFields, ResponseFormat, StructuredOutputs, pick_structured
from server.api.fields import readable_errors
from server.api.tokenize import encode
from server.sampling_params import GREEDY_BELOW, SamplingParams, StructuredOutput

DEFAULTS = SamplingParams()  # the schema's defaults are the engine's

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)  # as /generate: "5" is not 5, no NaN
# A request body: strict as above, but unknown top-level keys are kept for the route to ignore or
# refuse (--unknown-fields, server/api/fields.py).
BODY = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class SamplingRequest(ControlFields):
    """The fields /v1/completions and /v1/chat/completions share (penalties, logit_bias and
    min_tokens from ControlFields); `unsupported` lists the fields that are accepted only at their
    defaults (`check_request`)."""

    model_config = BODY

    model: str
    temperature: float | None = Field(DEFAULTS.temperature, ge=0.0, le=2.0,
                                      description=f"0 = greedy, and so is anything below {GREEDY_BELOW:g}.")
    top_p: float | None = Field(DEFAULTS.top_p, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extension: json (a schema), regex, choice, grammar (EBNF) or json_object
    structured_outputs: StructuredOutputs | None = None
    # flashpage extensions
    top_k: int = Field(DEFAULTS.top_k, ge=0, le=MAX_TOP_K)
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None

    def unsupported(self) -> list[tuple[str, bool]]:
        """(field, at its default) for each field this server accepts only at its default."""
        return []

    def structured(self) -> StructuredOutput | None:
        """The structured-output spec the body asks for (RequestError if it gives two)."""
        return pick_structured(response_format=self.response_format and self.response_format.spec(),
                               structured_outputs=self.structured_outputs and self.structured_outputs.spec())

    def sampling_params(self, max_tokens: int, logprobs: int | None, choice: int,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters for choice `choice` (seeded `seed + choice`)."""
        return SamplingParams(
            max_tokens=max_tokens, temperature=DEFAULTS.temperature if self.temperature is None else self.temperature,
            top_p=DEFAULTS.top_p if self.top_p is None else self.top_p, top_k=self.top_k,
            seed=None if self.seed is None else self.seed + choice, stop=self.stop_strings(),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, structured=self.structured(), **self.control_params())

    def stop_strings(self) -> list[str]:
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop or []) if s]


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(DEFAULTS.max_tokens, ge=0, le=MAX_TOKENS_BOUND,
                                   description="0 only with echo: score the prompt, generate nothing.")
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    return_token_ids: bool | None = None  # vLLM's: each choice's prompt_token_ids and token_ids
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[tuple[str, bool]]:
        return [("suffix", self.suffix is None), ("best_of", self.best_of in (None, self.n)), *super().unsupported()]


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def structured_param(body) -> str:
    """The field a body's structured-output spec came in: what a 400 about that spec names."""
    if getattr(body, "tools", None) and getattr(body, "tool_choice", None) != "none":  # "none": no tool grammar
        return "tools"
    return "structured_outputs" if getattr(body, "structured_outputs", None) is not None else "response_format"


def from_engine_error(e: BaseException, body=None) -> OpenAIError:
    if isinstance(e, (RequestError, LimitError)):
        param = getattr(e, "param", None) or "prompt"
        if param == "structured_outputs" and body is not None:  # the engine's refusal of a spec: the body's field
            param = structured_param(body)
        return OpenAIError(400, str(e), param=param)
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, str(e), "server_error", code="engine_dead")
    status = getattr(e, "status_code", None)  # ServiceUnavailableError (503), RequestFailedError (500)
    if isinstance(status, int):
        return OpenAIError(status, str(e), "server_error" if status >= 500 else "invalid_request_error",
                           headers=getattr(e, "headers", None))
    return OpenAIError(500, f"internal error: {e!r}", "server_error")


def check_request(body: SamplingRequest) -> None:
    for param, ok in body.unsupported():
        if not ok:
            raise OpenAIError(400, f"'{param}' is not supported by this server (only its default value is accepted)",
                              param=param, code="unsupported_parameter")
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if any(has_surrogates(s) for s in body.stop_strings()):
        raise OpenAIError(400, "'stop' holds a lone UTF-16 surrogate, which is not text", param="stop")


def prompt_count(prompt) -> int:
    """How many prompts `prompt` holds, found without looking at each (caps come before any work)."""
    return 1 if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else len(prompt)


async def parse_prompts(prompt, tokenizer, limits: ServerLimits) -> list[tuple[str | None, list[int]]]:
    """[(text or None, token ids)] per prompt, within the server's prompt limits; text is checked
    before it is tokenized, and tokenized off the event loop (server/api/tokenize.py)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif not prompt:
        raise OpenAIError(400, "'prompt' is empty", param="prompt")
    elif isinstance(prompt[0], int):
        prompt = [prompt]
    try:
        for p in prompt:
            if isinstance(p, str):
                if has_surrogates(p):
                    raise LimitError("'prompt' holds a lone UTF-16 surrogate, which is not text")
                check_prompt_chars(p, limits)
        texts = [p for p in prompt if isinstance(p, str)]
        encoded = iter(await encode(tokenizer, texts))
        out = [(p, next(encoded)) if isinstance(p, str) else (None, list(p)) for p in prompt]
        for _, ids in out:
            check_prompt_tokens(len(ids), limits)
    except LimitError as e:
        raise OpenAIError(400, str(e), param="prompt") from None
    return out


class _Logprobs:
    """Builds the OpenAI logprobs object of one choice, piece by piece (text_offset runs on)."""

    def __init__(self, tokenizer, offset: int = 0) -> None:
        self.tokenizer, self.offset = tokenizer, offset

    def _tok(self, tid: int) -> str:
        return token_text(self.tokenizer, tid)

    def _advance(self, text: str) -> int:
        start, self.offset = self.offset, self.offset + len(text)
        return start

    def prompt(self, ids: list[int], scored: list) -> dict:
        """The echoed prompt: every token after the first with its log-probability and top
        alternatives (`scored`, from the engine's prefill), the first with none."""
        toks = [self._tok(t) for t in ids]
        logprobs, top = [None], [None]
        for (tid, lp), *alts in scored:
            logprobs.append(finite(lp))
            entry = {self._tok(t): finite(v) for t, v in alts}
            entry.setdefault(self._tok(tid), finite(lp))
            top.append(entry)
        return {"tokens": toks, "token_logprobs": logprobs[: len(ids)], "top_logprobs": top[: len(ids)],
                "text_offset": [self._advance(t) for t in toks]}

    def sampled(self, entries: list) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for (tid, lp), *alts in entries:
            tok = self._tok(tid)
            top = {self._tok(t): finite(v) for t, v in alts}
            top.setdefault(tok, finite(lp))
            out["tokens"].append(tok)
            out["token_logprobs"].append(finite(lp))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self._advance(tok))
        return out


@functools.lru_cache(maxsize=1 << 18)
def token_text(tokenizer, tid: int) -> str:
    """One token decoded alone, remembered: a response with logprobs decodes each alternative of
    each token (20 a token: hundreds of thousands of decodes for one large answer)."""
    return tokenizer.decode([tid])


def finite(v: float) -> float:
    return max(float(v), -9999.0)  # JSON has no -inf


def _merge(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ChoiceBase:
    """One choice (one engine request) of either route. Its text goes out from the engine's cumulative
    (stop-truncated) text, holding back a tail that could still become a stop string, so a stop
    string spanning tokens never leaks and streamed and whole text agree. A route's subclass turns
    each output into its choice objects: `chunks(out)` for a stream, `result()` for the whole."""

    def __init__(self, index: int, ids: list[int], params: SamplingParams) -> None:
        self.index, self.ids, self.params = index, ids, params
        self.started = False
        self.completion_tokens = 0
        self.texts: list[str] = []  # what a non-streamed response accumulates
        self.finish_reason: str | None = None
        self.emitted, self.hold = 0, max((len(s) for s in params.stop), default=1) - 1

    @property
    def engine_free(self) -> bool:
        """Its answer needs no engine step (a completions echo of max_tokens 0 without logprobs)."""
        return False

    def advance(self, out) -> str:
        """The new text of `out` that can go out now (all that is left once it is finished)."""
        end = len(out.text) if out.finished else max(self.emitted, len(out.text) - self.hold)
        text, self.emitted = out.text[self.emitted:end], end
        self.completion_tokens = out.completion_tokens
        self.finish_reason = out.finish_reason if out.finished else None
        return text

    def chunks(self, out) -> list[dict]:
        raise NotImplementedError

    def result(self) -> dict:
        raise NotImplementedError


def echo_only(echo: bool, max_tokens: int, logprobs: int | None) -> bool:
    """A completion whose answer is its prompt's text alone (echo, max_tokens 0, no logprobs): the
    engine has nothing to compute for it."""
    return echo and max_tokens == 0 and logprobs is None


class Choice(ChoiceBase):
    """A completions choice: text (the first piece carries the echoed prompt) and legacy logprobs;
    with `token_ids`, vLLM's prompt_token_ids (the first piece) and token_ids (each piece's own)."""

    def __init__(self, index: int, text: str | None, ids: list[int], params: SamplingParams, echo: bool, tokenizer,
                 token_ids: bool = False):
        super().__init__(index, ids, params)
        self.echo = echo
        self.token_ids: list[int] | None = [] if token_ids else None
        self.prompt_text = (text if text is not None else tokenizer.decode(ids)) if echo else ""
        self.lp = _Logprobs(tokenizer) if params.logprobs is not None else None
        self.logprobs: dict | None = None

    @property
    def engine_free(self) -> bool:
        # (its params carry prompt_logprobs 0 only to pass the engine's validation of max_tokens 0)
        return echo_only(self.echo, self.params.max_tokens, self.params.logprobs)

    def chunks(self, out) -> list[dict]:
        text, logprobs = self.advance(out), None
        if self.lp is not None:
            head = self.lp.prompt(self.ids, out.prompt_logprobs or []) if self.echo and not self.started else None
            logprobs = _merge(head, self.lp.sampled(out.new_logprobs))
        if self.echo and not self.started:
            text = self.prompt_text + text
        piece = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": self.finish_reason}
        if self.token_ids is not None:
            if not self.started:
                piece["prompt_token_ids"] = self.ids
            piece["token_ids"] = out.new_token_ids
            self.token_ids.extend(out.new_token_ids)
        self.started = True
        self.texts.append(text)
        self.logprobs = _merge(self.logprobs, logprobs)
        return [piece]

    def result(self) -> dict:
        out = {"index": self.index, "text": "".join(self.texts), "logprobs": self.logprobs,
               "finish_reason": self.finish_reason}
        if self.token_ids is not None:
            out.update(prompt_token_ids=self.ids, token_ids=self.token_ids)
        return out


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """A /v1 body that does not validate, as OpenAI reports it: a 400 naming the first bad field."""
    errors = readable_errors(exc.errors())
    err = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    if err.get("type") == "json_invalid":
        return OpenAIError(400, "We could not parse the JSON body of your request.")
    where = ".".join(loc)  # a nested field by its path: messages.0.role
    if err.get("type") == "extra_forbidden":
        return OpenAIError(400, f"Unrecognized request argument supplied: {where}", param=param)
    if err.get("type") == "missing":
        return OpenAIError(400, f"'{where}' is a required property" if param else "a JSON body is required",
                           param=param)
    if param == "prompt":
        return OpenAIError(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of "
                           "token-id lists", param="prompt")
    return OpenAIError(400, f"{where or 'body'}: {err.get('msg')}", param=param)
