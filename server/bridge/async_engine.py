"""Drives the synchronous engine from asyncio.

The engine steps back to back while there is work, never waiting for the HTTP side, in one of two
homes (a "core"): its own process (server/bridge/engine_process.py, what `python -m server` runs:
the event loop and the engine then never compete for the GIL), or a thread of this process
(server/bridge/thread_core.py: tests, notebooks, --no-engine-process). Either way adds and aborts reach it in the
order they were made, and each step's outputs come back to the event loop in one call.

Each request's outputs land in a collector. When a consumer is behind (the event loop busy with
hundreds of streams), the outputs waiting for it are merged into one: it then sends one SSE event
with several tokens instead of falling further behind one event per token. vLLM streams the same
way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator

from server.bridge.engine_process import EngineClient
from server.bridge.messages import RequestRefused
from server.bridge.thread_core import ThreadCore
from server.engine import LLMEngine, RequestError, RequestOutput, merge_outputs
from server.engine.stop import ABORT, ERROR, REFUSED, TIMEOUT
from server.sampling_params import SamplingParams

log = logging.getLogger("flashpage.engine")


# Seconds past a request's deadline after which the API side ends it itself, should the engine not
# have: steps take milliseconds, so only a stalled engine (or a command that never reached it) trips it.
DEADLINE_BACKSTOP_S = 2.0


class EngineDeadError(RuntimeError):
    pass


class ServiceUnavailableError(RuntimeError):
    """Not admitted now (the server is draining, or too many requests wait): HTTP 503 + Retry-After."""

    status_code = 503

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.headers = {"Retry-After": str(retry_after)}


class RequestFailedError(RuntimeError):
    """The engine step running this request failed; the engine carries on (HTTP 500)."""

    status_code = 500


class _Cutoff:
    """Queued to a request to end it at once (shutdown) with this finish reason."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Collector:
    """One request's undelivered outputs; consecutive RequestOutputs merge into one. The consumer
    awaits a bare future that the next put resolves: per event, cheaper than an asyncio.Event's
    wait (a coroutine, a new future and a waiter list) and set."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        items = self.items
        if (items and isinstance(item, RequestOutput) and isinstance(items[-1], RequestOutput)
                and item.finish_reason != ERROR):  # a failure stays separate: the tokens before it are kept
            items[-1] = merge_outputs(items[-1], item)
        else:
            items.append(item)
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():  # done: its consumer was cancelled
                waiter.set_result(None)

    def wait(self) -> asyncio.Future:
        """A future resolved by the next put (await it only while `items` is empty)."""
        self.waiter = asyncio.get_running_loop().create_future()
        return self.waiter


class AsyncEngine:
    def __init__(self, engine: LLMEngine | EngineClient, max_waiting: int | None = None,
                 request_timeout: float | None = None) -> None:
        self.engine = engine  # what the HTTP side asks: tokenizer, model_name, max_model_len, validate, snapshot
        self.core = engine if isinstance(engine, EngineClient) else ThreadCore(engine)
        self.max_waiting = max_waiting  # admitted-but-not-running requests beyond which new ones get 503
        self.request_timeout = request_timeout  # seconds from arrival; the engine ends it then ("timeout")
        self.deadline_backstop = DEADLINE_BACKSTOP_S
        self.draining = False  # shutting down: admit nothing new
        self._streams: dict[str, _Collector] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead: BaseException | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.core.start(self._loop, self._deliver, self._die)

    async def stop(self) -> None:
        await self.core.stop()

    @property
    def num_active(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not in the running batch (new, queued or preempted), server-wide."""
        if getattr(self.core, "shared", False):  # several API processes (server/api/servers.py)
            return self.engine.snapshot().waiting + self.core.unseen_adds
        return max(0, len(self._streams) - self.engine.snapshot().running)

    @property
    def load(self) -> int:
        """Engine requests in flight server-wide, running or waiting (GET /get_load)."""
        if getattr(self.core, "shared", False):  # several API processes: the engine's count
            return self.engine.snapshot().running + self.num_waiting
        return len(self._streams)

    def in_use(self, request_id: str) -> bool:
        return request_id in self._streams  # an abort reaches the engine before any later add

    def admit(self, count: int = 1) -> None:
        """Check that `count` more requests (the choices of one HTTP request, admitted together) may
        wait for a place in the batch. Raises RequestError (400) if they never can, being more than
        the waiting-queue bound; a client that retried would spin forever (the OpenAI SDK retries
        503s). Raises ServiceUnavailableError (503 + Retry-After) if the queue is too full now."""
        if self.max_waiting is None:
            return
        if count > self.max_waiting:
            raise RequestError(f"this request runs {count} sequences (prompts x n) but at most {self.max_waiting} may "
                               "wait for the batch (--max-waiting-requests): it could never be admitted; send "
                               "fewer prompts or a smaller n")
        if self.num_waiting + count > self.max_waiting:
            raise ServiceUnavailableError(f"{self.num_waiting} requests are already waiting (the limit is "
                                          f"{self.max_waiting}); retry later")

    # -- requests -----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       validated: bool = False, admitted: bool = False) -> AsyncIterator[RequestOutput]:
        """Yield outputs as they come (merged when the consumer is behind); abort the request if
        the consumer stops early.

        Raises RequestError (400; also for a request the engine refused after queueing it),
        ServiceUnavailableError (503: draining, or the waiting queue is
        full), EngineDeadError (503), RequestFailedError (500: the step that ran it failed). A
        request past its deadline is ended by the engine with finish_reason "timeout"; one cut off by
        shutdown ends with "abort"; both keep the text generated so far. `validated`: the caller
        already ran engine.validate on exactly these arguments; `admitted`: the caller already ran
        `admit` for this request together with the others of its HTTP request."""
        if self.dead is not None:
            raise EngineDeadError(f"engine is not running: {self.dead!r}")
        if self.draining:
            raise ServiceUnavailableError("the server is shutting down", retry_after=5)
        if self.in_use(request_id):
            raise RequestError(f"request id {request_id!r} is already in flight")
        if not validated:  # the one check per request (read-only, safe off the engine thread); the
            self.engine.validate(prompt_token_ids, params)  # OpenAI route checks every choice up front
        if not admitted:
            self.admit()
        stream = self._streams[request_id] = _Collector()
        deadline, backstop = None, None
        if self.request_timeout is not None:
            deadline = time.monotonic() + self.request_timeout
            # The engine ends the request at its deadline (server/engine/stop.py); this timer only
            # answers the client if the engine cannot (a step that never returns, a lost command).
            backstop = self._loop.call_later(self.request_timeout + self.deadline_backstop, self._cut_off,
                                             request_id, TIMEOUT)
        self.core.add(request_id, prompt_token_ids, params, deadline)
        finished, last = False, None
        items = stream.items
        try:
            while not finished:
                while not items:
                    await stream.wait()
                item = items.popleft()
                if isinstance(item, _Cutoff):
                    finished = True
                    yield RequestOutput(request_id, "", [], True, item.reason, len(prompt_token_ids),
                                        last.completion_tokens if last else 0, text=last.text if last else "",
                                        token_ids=list(last.token_ids) if last else [])
                    break
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finish_reason == ERROR:
                    finished = True
                    raise RequestFailedError(item.error or "the engine step running this request failed")
                if item.finish_reason == REFUSED:  # its grammar's compile ran past the deadline in the grammar
                    finished = True  # process, after it was queued (before any token): a 400 about its spec
                    raise RequestError(item.error or "the engine refused this request", param="structured_outputs")
                finished, last = item.finished, item
                yield item
        finally:
            if backstop is not None:
                backstop.cancel()
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.core.abort(request_id)

    def _cut_off(self, request_id: str, reason: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self.abort(request_id)
            stream.put(_Cutoff(reason))

    def abort_all(self, reason: str = ABORT) -> int:
        """End every request in flight now (shutdown): each gets finish_reason `reason` and the
        text it has so far; the engine frees their blocks at its next step."""
        rids = list(self._streams)
        for rid in rids:
            self._cut_off(rid, reason)
        return len(rids)

    # -- called on the event loop by the core ------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput], refused: list[RequestRefused]) -> None:
        streams = self._streams
        for r in refused:
            stream = streams.pop(r.request_id, None)
            if stream is not None:
                stream.put(RequestError(r.message))
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            stream.put(out)
            if out.finished:
                del streams[out.request_id]

    def _die(self, e: BaseException) -> None:
        """The engine cannot continue: fail everyone; /health reports it and the server exits 1."""
        self.dead = e
        for rid in list(self._streams):
            self._streams.pop(rid).put(EngineDeadError(f"engine failed: {e!r}"))
