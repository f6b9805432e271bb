"""The engine's statistics hooks: what it reports when a request gets its first token, when a request
ends, and after every step. The HTTP side's metrics (server/api/metrics.py) implement `StatsHooks`;
with the engine in its own process, `StatsRecorder` stands in for them there and its events travel
to the API process with the step's outputs, to be replayed (`event.apply(stats)`)."""

from __future__ import annotations

from typing import Protocol

import msgspec


class StatsHooks(Protocol):
    def first_token(self, ttft: float) -> None: ...

    def finished(self, e2e: float, tpot: float | None, reason: str) -> None: ...

    def step(self, num_seqs: int, num_tokens: int, now: float) -> None: ...


class FirstToken(msgspec.Struct, tag="first_token", array_like=True):
    ttft: float  # seconds from the engine receiving the request

    def apply(self, stats: StatsHooks) -> None:
        stats.first_token(self.ttft)


class Finished(msgspec.Struct, tag="finished", array_like=True):
    e2e: float
    tpot: float | None  # (last - first token time) / (tokens - 1); None below two tokens
    reason: str

    def apply(self, stats: StatsHooks) -> None:
        stats.finished(self.e2e, self.tpot, self.reason)


class StepDone(msgspec.Struct, tag="step", array_like=True):
    num_seqs: int
    num_tokens: int
    now: float  # time.monotonic() of the engine process

    def apply(self, stats: StatsHooks) -> None:
        stats.step(self.num_seqs, self.num_tokens, self.now)


StatsEvent = FirstToken | Finished | StepDone


class StatsRecorder:
    """StatsHooks that records the calls as events (engine process side)."""

    def __init__(self) -> None:
        self.events: list[StatsEvent] = []

    def first_token(self, ttft: float) -> None:
        self.events.append(FirstToken(ttft))

    def finished(self, e2e: float, tpot: float | None, reason: str) -> None:
        self.events.append(Finished(e2e, tpot, reason))

    def step(self, num_seqs: int, num_tokens: int, now: float) -> None:
        self.events.append(StepDone(num_seqs, num_tokens, now))

    def take(self) -> list[StatsEvent]:
        events, self.events = self.events, []
        return events
