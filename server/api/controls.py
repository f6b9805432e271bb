"""The request fields that steer sampling beyond temperature and top-k/p, shared by /generate,
/v1/completions and /v1/chat/completions: penalties, `logit_bias`, `min_tokens`, and structured
output (OpenAI's `response_format`, vLLM's `structured_outputs`, SGLang's `json_schema` / `regex` /
`ebnf`), turned into the engine's `SamplingParams` fields.

A structured-output spec is checked here before the request is queued (`check_structured`):
bounded first, then compiled in a sacrificial process under a deadline, awaited off the event loop
(server/engine/grammar_bounds.py, grammar_compile.py). A spec over a bound, invalid, crashing the
compiler or too slow to compile is a 400 that says which, and the engine never sees it. Verdicts
are remembered by spec, so a schema shared by many requests compiles once in this process's worker
(and once more in the engine's grammar process).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.bridge.async_engine import ServiceUnavailableError
from server.engine import RequestError
from server.engine.grammar_compile import CompilerBusy, CompileSetup, SpecCompiler
from server.sampling_params import LOGIT_BIAS_BOUND, SamplingParams, StructuredOutput

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
MAX_SPEC_CHARS = 65_536  # a regular expression, grammar or choice; schemas are bounded by the body size
MAX_CHOICES_LISTED = 1024
MAX_LOGIT_BIAS = 1024  # entries (OpenAI allows 300)
Spec = Annotated[str, Field(max_length=MAX_SPEC_CHARS)]
_TOKEN_ID = re.compile(r"0|[1-9][0-9]*")  # ASCII digits only ([0-9] is not \d)
DEFAULTS = SamplingParams()


class ControlFields(BaseModel):
    """Penalties, logit_bias and min_tokens as OpenAI and vLLM name them (mixed into request bodies)."""

    presence_penalty: float | None = Field(DEFAULTS.presence_penalty, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(DEFAULTS.frequency_penalty, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(DEFAULTS.repetition_penalty, gt=0.0, le=10.0,
                                             description="vLLM's: > 1 discourages tokens of the prompt and output.")
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description="Token id (as a string) -> bias added to its logit, clamped to [-100, 100].")
    min_tokens: int = Field(DEFAULTS.min_tokens, ge=0, description="EOS and stop ids are held back until this many.")

    def control_params(self) -> dict:
        """The SamplingParams fields these set (RequestError for a logit_bias key that is no id)."""
        return dict(presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                    repetition_penalty=DEFAULTS.repetition_penalty if self.repetition_penalty is None
                    else self.repetition_penalty, logit_bias=logit_bias(self.logit_bias), min_tokens=self.min_tokens)


def logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's string keys as token ids, values clamped to +-100 as OpenAI does. A key is a token
    id written as a plain decimal number (Python's int() also took " 5", "+5", "5_0" and "٣"). Ids
    are checked against the vocabulary by the engine's validation."""
    out = {}
    for key, value in (bias or {}).items():
        if not _TOKEN_ID.fullmatch(key):
            raise RequestError(f"logit_bias key {key[:32]!r} is not a token id (a decimal number such as \"50256\")",
                               "logit_bias")
        out[int(key)] = max(-LOGIT_BIAS_BOUND, min(LOGIT_BIAS_BOUND, value))
    return out


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)
    name: str = Field("response", max_length=256)
    description: str | None = Field(None, max_length=MAX_SPEC_CHARS)
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, a JSON object, or JSON matching a schema."""

    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("'json_schema' is required when type is 'json_schema'")
        return self

    def spec(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.type == "json_schema":
            schema = self.json_schema.schema_
            return StructuredOutput("json_object") if schema in (None, True, {}) else _json(schema)
        return None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    model_config = STRICT
    json_: dict | Spec | None = Field(None, alias="json")
    regex: Spec | None = None
    choice: Annotated[list[Spec], Field(min_length=1, max_length=MAX_CHOICES_LISTED)] | None = None
    grammar: Spec | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one(self):
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar or json_object"
                             + (f" (got {', '.join(g.rstrip('_') for g in given)})" if given else ""))
        return self

    def spec(self) -> StructuredOutput:
        if self.json_ is not None:
            return _json(self.json_)
        if self.regex is not None:
            return StructuredOutput("regex", self.regex)
        if self.choice is not None:
            return StructuredOutput("choice", json.dumps(self.choice, ensure_ascii=False))
        if self.grammar is not None:
            return StructuredOutput("grammar", self.grammar)
        return StructuredOutput("json_object")


def _json(schema: dict | str) -> StructuredOutput:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise RequestError(f"invalid JSON schema: not JSON ({e})") from None
        except RecursionError:  # given as text, it escaped the body's nesting bound (server/api/guards.py)
            raise RequestError("invalid JSON schema: it nests too deep to be read") from None
    if not isinstance(schema, dict):
        raise RequestError("invalid JSON schema: it must be a JSON object")
    # Canonical text: the same schema written in another key order is the same cached grammar.
    return StructuredOutput("json", json.dumps(schema, sort_keys=True, ensure_ascii=False))


def pick_structured(**specs: StructuredOutput | None) -> StructuredOutput | None:
    """The one structured-output spec a body gives (RequestError naming the fields if several)."""
    given = {k: v for k, v in specs.items() if v is not None}
    if len(given) > 1:
        raise RequestError(f"give one kind of structured output, not {' and '.join(sorted(given))}")
    return next(iter(given.values()), None)


def spec_compiler(app_state, engine) -> SpecCompiler:
    """This process's SpecCompiler (made on first use; its workers start when a spec first needs one)."""
    compiler = getattr(app_state, "spec_compiler", None)
    if compiler is None:
        bounds, limits = engine.limits(), engine.config.structured
        setup = CompileSetup(engine.model_path, bounds.vocab_size, tuple(bounds.eos_token_ids),
                             limits.structured_cache_memory)
        compiler = app_state.spec_compiler = SpecCompiler(setup, limits)
    return compiler


async def check_structured(app_state, engine, spec: StructuredOutput | None) -> None:
    """RequestError (400) if the spec is over a bound, invalid, crashes the compiler or does not
    compile within the deadline; ServiceUnavailableError (503) if too many compiles wait already. A
    spec seen before is answered at once; a new one is bounded here, then compiled in a worker,
    awaited on the compiler's own threads (never the loop's default pool)."""
    if spec is None:
        return
    compiler = spec_compiler(app_state, engine)
    if compiler.cached(spec):
        return
    try:
        with compiler.slot():  # its bounds too off the loop: reading a spec costs time in its size
            await asyncio.get_running_loop().run_in_executor(compiler.executor, compiler.check_new, spec)
    except CompilerBusy as e:
        raise ServiceUnavailableError(str(e), retry_after=2) from None
