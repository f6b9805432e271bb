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


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
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

    # -- requests -----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield outputs as they come; abort the request if the consumer stops early."""
        if self.dead is not None:
            raise EngineDeadError(f"engine is not running: {self.dead!r}")
        self.engine.validate(prompt_token_ids, params)  # read-only checks: safe off the worker thread
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._adds.append((request_id, prompt_token_ids, params))
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        if self._queues.pop(request_id, None) is not None:
            self._aborts.append(request_id)
            self._wake.set()

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
