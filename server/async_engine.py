"""Drives the synchronous engine from asyncio.

One background task loops: hand pending adds/aborts and a `step()` to a single worker thread, then
route each output to the queue of the request it belongs to. The engine is touched only from that
worker thread, so it needs no locks; the event loop stays free to accept and stream requests while
the model runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from server.engine import LLMEngine, RequestError, RequestOutput
from server.sampling import SamplingParams

log = logging.getLogger("flashpage.engine")


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
    """Queued to a request to end it early (deadline, shutdown) with this finish reason."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int | None = None, request_timeout: float | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting  # admitted-but-not-running requests beyond which new ones get 503
        self.request_timeout = request_timeout  # seconds from arrival; past it: finish_reason "timeout"
        self.draining = False  # shutting down: admit nothing new
        self._queues: dict[str, asyncio.Queue] = {}
        self._adds: list[tuple[str, list[int], SamplingParams]] = []
        self._aborts: list[str] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="flashpage-step")
        self.dead: BaseException | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._executor.shutdown(wait=True)

    @property
    def num_active(self) -> int:
        return len(self._queues)

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not in the running batch (new, queued or preempted)."""
        return max(0, len(self._queues) - len(self.engine.scheduler.running))

    def in_use(self, request_id: str) -> bool:
        return request_id in self._queues or request_id in self._aborts

    # -- requests -----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield outputs as they come; abort the request if the consumer stops early.

        Raises RequestError (400), ServiceUnavailableError (503: draining, or the waiting queue is
        full), EngineDeadError (503), RequestFailedError (500: the step that ran it failed). A
        request past its deadline is aborted and ends with finish_reason "timeout"; one cut off by
        shutdown ends with "abort"; both keep the text generated so far."""
        if self.dead is not None:
            raise EngineDeadError(f"engine is not running: {self.dead!r}")
        if self.draining:
            raise ServiceUnavailableError("the server is shutting down", retry_after=5)
        if self.in_use(request_id):
            raise RequestError(f"request id {request_id!r} is already in flight")
        self.engine.validate(prompt_token_ids, params)  # read-only checks: safe off the worker thread
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise ServiceUnavailableError(f"{self.num_waiting} requests are already waiting (the limit is "
                                          f"{self.max_waiting}); retry later")
        loop = asyncio.get_running_loop()
        deadline = None if self.request_timeout is None else loop.time() + self.request_timeout
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._adds.append((request_id, prompt_token_ids, params))
        self._wake.set()
        finished, last = False, None
        try:
            while not finished:
                if deadline is None:
                    item = await queue.get()
                else:
                    try:
                        item = await asyncio.wait_for(queue.get(), max(0.0, deadline - loop.time()))
                    except asyncio.TimeoutError:
                        self.abort(request_id)
                        item = _Cutoff("timeout")
                if isinstance(item, _Cutoff):
                    finished = True
                    yield RequestOutput(request_id, "", [], True, item.reason, len(prompt_token_ids),
                                        last.completion_tokens if last else 0, text=last.text if last else "",
                                        token_ids=list(last.token_ids) if last else [])
                    break
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason == "error":
                    finished = True
                    raise RequestFailedError(item.error or "the engine step running this request failed")
                finished, last = item.finished, item
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        if self._queues.pop(request_id, None) is not None:
            self._aborts.append(request_id)
            self._wake.set()

    def abort_all(self, reason: str = "abort") -> int:
        """End every request in flight now (shutdown): each gets finish_reason `reason` and the
        text it has so far; the engine frees their blocks at its next step."""
        queues = list(self._queues.items())
        for rid, queue in queues:
            self.abort(rid)
            queue.put_nowait(_Cutoff(reason))
        return len(queues)

    # -- the loop -----------------------------------------------------------------------------
    def _step(self, adds, aborts):
        errors = []
        for rid, ids, params in adds:
            try:
                self.engine.add_request(rid, ids, params)
            except RequestError as e:
                errors.append((rid, e))
        for rid in aborts:
            self.engine.abort_request(rid)
        return (self.engine.step() if self.engine.has_unfinished() else []), errors

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self._adds and not self._aborts and not self.engine.has_unfinished():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                adds, aborts = self._adds, self._aborts
                self._adds, self._aborts = [], []
                outputs, errors = await loop.run_in_executor(self._executor, self._step, adds, aborts)
                for rid, err in errors:
                    self._deliver(rid, err)
                for out in outputs:
                    self._deliver(out.request_id, out)
                await asyncio.sleep(0)  # let handlers run between steps
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the engine cannot continue: fail everyone, report unhealthy
            log.exception("engine loop died")
            self.dead = e
            for rid in list(self._queues):
                self._deliver(rid, EngineDeadError(f"engine failed: {e!r}"))

    def _deliver(self, rid: str, item) -> None:
        queue = self._queues.get(rid)
        if queue is None:
            return
        queue.put_nowait(item)
        if isinstance(item, BaseException) or item.finished:
            del self._queues[rid]
