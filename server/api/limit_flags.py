"""The request and connection limits' command-line flags (server/api/guards.py's ServerLimits holds
what they set): `add_arguments` puts them on the server's parser, each value checked against its
range by a `Bound` (also the type of server/cli.py's other bounded flags), sizes read by
`parse_bytes`, the API key by `api_key`."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from server.api.fields import UNKNOWN_FIELDS
from server.api.guards import ServerLimits


def parse_bytes(text: str) -> int:
    """'512MiB', '1m', '2GiB' or plain bytes."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


class Bound:
    """An argparse `type`: the flag's text parsed by `parse`, then checked against a range, so that a
    setting the server cannot run with stops it at start, before anything loads, with the flag's
    name and the range (`argument --max-num-seqs: 0 is out of range: it must be an integer >= 1`).

    `low` / `high` are inclusive, `above` an exclusive lower bound; NaN and infinities never pass;
    `also` maps values outside the range that the flag still takes to what they mean (-1: no bound)."""

    def __init__(self, parse: Callable = int, low: float | None = None, high: float | None = None, *,
                 above: float | None = None, power_of_two: bool = False, also: dict | None = None,
                 what: str | None = None) -> None:
        self.parse, self.low, self.high, self.above = parse, low, high, above
        self.power_of_two, self.also = power_of_two, also or {}
        self.what = what or {int: "an integer", float: "a number"}.get(parse, "a value")

    def describe(self) -> str:
        if self.power_of_two:
            text = f"a power of two from {self.low} to {self.high}"
        elif self.low is not None and self.high is not None:
            text = f"{self.what} from {self.low} to {self.high}"
        else:
            parts = ([f">= {self.low}"] if self.low is not None else []) + (
                [f"> {self.above}"] if self.above is not None else []) + (
                [f"<= {self.high}"] if self.high is not None else [])
            text = " ".join([self.what, " and ".join(parts)]).strip()
        return text + "".join(f", or {v} ({meaning})" for v, meaning in self.also.items())

    def allows(self, value) -> bool:
        if value in self.also:
            return True
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return ((self.low is None or value >= self.low) and (self.above is None or value > self.above)
                and (self.high is None or value <= self.high)
                and (not self.power_of_two or (value > 0 and value & (value - 1) == 0)))

    def __call__(self, text: str):
        try:
            value = self.parse(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.describe()}") from None
        if not self.allows(value):
            raise argparse.ArgumentTypeError(f"{text} is out of range: it must be {self.describe()}")
        return value


def api_key(text: str) -> str:
    """--api-key: visible ASCII without spaces (a bearer token); empty is refused rather than taken
    to mean "no key", since `--api-key "$KEY"` with KEY unset would otherwise turn auth off."""
    if not text or not all("!" <= c <= "~" for c in text):
        raise argparse.ArgumentTypeError("must be a non-empty token of visible ASCII characters without spaces "
                                         "(leave the flag out to serve without a key)")
    return text


SIZE = "a size in bytes (e.g. 64KiB)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ServerLimits()
    g = p.add_argument_group("limits and reliability")
    g.add_argument("--max-body-bytes", type=Bound(parse_bytes, 64, what=SIZE), default=d.max_body_bytes,
                   help="largest request body (e.g. 1MiB); larger ones get 413 before they are parsed")
    g.add_argument("--max-prompt-chars", type=Bound(int, 1), default=d.max_prompt_chars,
                   help="longest text prompt in characters (checked before tokenizing)")
    g.add_argument("--max-prompt-tokens", type=Bound(int, 0), default=0,
                   help="longest prompt in tokens (0 = the model's context)")
    g.add_argument("--max-request-tokens", type=Bound(int, 1), default=d.max_request_tokens,
                   help="most tokens one request may return: n x (max_tokens + prompt tokens scored for echo or "
                        "prompt_logprobs), each counted once more per logprob alternative; beyond it a 400 (a chat "
                        "request without max_tokens gets what fits instead of the whole context)")
    g.add_argument("--max-waiting-requests", type=Bound(int, 1, also={-1: "no bound"}),
                   default=d.max_waiting_requests,
                   help="requests that may wait for a slot; beyond it 503 with Retry-After, and a request with "
                        "more choices than this (prompts x n) is a 400 (-1 = unbounded)")
    g.add_argument("--request-timeout", type=Bound(float, 0), default=0.0,
                   help="per-request deadline in seconds (0 = none); a request past it is aborted and "
                        "ends with finish_reason 'timeout' and the text generated so far")
    g.add_argument("--shutdown-grace", type=Bound(float, 0), default=d.shutdown_grace,
                   help="on SIGTERM, seconds that running requests get to finish before they are aborted")
    g.add_argument("--unknown-fields", choices=UNKNOWN_FIELDS, default=d.unknown_fields,
                   help="top-level request fields the server does not know (routers and gateways add their own): "
                        "'ignore' them with one warning per distinct set, as vLLM does, or 'reject' them "
                        "(400 on /v1, 422 on /generate), as OpenAI does; known fields are validated either way")
    g.add_argument("--api-key", type=api_key, default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (or set FLASHPAGE_API_KEY)")
    c = p.add_argument_group("connections (a fronting proxy may bound these too: docs/deploy.md, Limits and reliability)")
    c.add_argument("--max-connections", type=Bound(int, 1), default=d.max_connections,
                   help="most open client connections; at the cap a new one closes the connection idle the "
                        "longest, or gets 503 if every one is busy with a request")
    c.add_argument("--keep-alive-timeout", type=Bound(float, above=0), default=d.keep_alive_timeout,
                   help="seconds a connection may wait without sending a request (after connecting or between "
                        "requests) before it is closed")
    c.add_argument("--header-timeout", type=Bound(float, above=0), default=d.header_timeout,
                   help="seconds from a request's first byte to the end of its headers; then 408, connection closed")
    c.add_argument("--body-timeout", type=Bound(float, above=0), default=d.body_timeout,
                   help="seconds from the end of a request's headers to the end of its body; then 408, connection "
                        "closed")
    c.add_argument("--max-header-bytes", type=Bound(parse_bytes, 1024, what=SIZE), default=d.max_header_bytes,
                   help="largest request line plus headers (e.g. 16KiB); larger ones get 431, connection closed")
