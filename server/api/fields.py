"""Request fields a route does not know: ignored with a warning (the default, as vLLM does) or
refused (as OpenAI does), by `--unknown-fields`.

Routers and gateways add fields of their own to the bodies they forward: vllm-router sends
`no_stop_trim` to /v1/completions and `return_logprob`, `return_hidden_states` to /generate, and a
server that refuses them answers every routed request with an error. So the top-level request
models keep extra keys (pydantic `extra="allow"`) instead of refusing them, every field we know is
validated exactly as before, and the route asks `unknown_fields` what is left over. Nested objects
(chat messages, stream_options) stay strict: a key there changes what the object means.

A warning names each distinct set of ignored fields once per route (a router adds the same ones to
every request; a log line each would flood the log), for at most MAX_LOGGED sets.
"""

from __future__ import annotations

import logging
import re

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel

from server.logs import clip

log = logging.getLogger("flashpage.api")

UNKNOWN_FIELDS = ("ignore", "reject")  # --unknown-fields choices; the default is ServerLimits.unknown_fields
MAX_LOGGED = 64  # distinct (route, names) warnings, then one line saying that no more are logged
_NAMES_SHOWN = 16


def unknown_fields(body: BaseModel) -> list[str]:
    """The body's top-level keys that its model does not define, sorted."""
    return sorted(body.__pydantic_extra__ or ())


def refusal(names: list[str]) -> RequestValidationError:
    """What pydantic's extra="forbid" raised for these fields, for a route's usual error handler
    (FastAPI's 422 on /generate, OpenAI's 400 on /v1)."""
    return RequestValidationError([{"type": "extra_forbidden", "loc": ("body", name),
                                    "msg": "Extra inputs are not permitted", "input": None} for name in names])


def warn_ignored(route: str, names: list[str], logged: set) -> None:
    """One warning per distinct (route, names) in `logged` (the app's own set)."""
    key = (route, tuple(names))
    if key in logged or len(logged) > MAX_LOGGED:
        return
    logged.add(key)
    if len(logged) > MAX_LOGGED:
        log.warning("more than %d distinct sets of unknown request fields seen: no more are logged", MAX_LOGGED)
        return
    shown = ", ".join(clip(n, 64) for n in names[:_NAMES_SHOWN])
    more = f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
    log.warning("ignoring unknown request fields on %s: %s%s (logged once per set; --unknown-fields reject "
                "refuses them)", route, shown, more)


# Pydantic names the branches of a union in an error's location ("stop.constrained-str",
# "stop.list[constrained-str]"): how it validated, not where the client's mistake is.
_BRANCH = re.compile(r"(constrained|function|tagged|nullable)-[\w-]*(\[.*\])?|[a-z]+\[.*\]|str|int|float|bool|dict|list")


def readable_errors(errors: list[dict]) -> list[dict]:
    """Validation errors as a client reads them: union branches dropped from each location, and a
    branch's "not this type" left last when another error names the same field (issue 44: 17 stop
    strings were reported as "stop.constrained-str: Input should be a valid string", the string
    branch of `stop`, instead of the list branch's "at most 16 items")."""
    out = []
    for e in errors:
        loc = [x for x in e.get("loc", ()) if not (isinstance(x, str) and _BRANCH.fullmatch(x))]
        out.append({**e, "loc": tuple(loc)})
    fields = {}
    for e in out:
        fields.setdefault(e["loc"], []).append(e)

    def noise(e: dict) -> bool:
        return str(e.get("type", "")).endswith("_type") and any(
            not str(o.get("type", "")).endswith("_type") for o in fields[e["loc"]])

    return sorted(out, key=noise)
