"""The engine on a thread of this process: simple, and what the tests drive.

Under heavy streaming the event loop and the engine share one GIL, which slows the engine (the
engine process, server/bridge/engine_process.py, is what serving uses). The engine is touched only
from its thread; adds and aborts reach it in the order they were made.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading

from server.bridge.messages import AbortRequest, AddRequest, Command, apply_commands
from server.engine import LLMEngine
from server.sampling_params import SamplingParams

log = logging.getLogger("flashpage.engine")


# The engine thread waits on the device with the GIL released; when the step it waits for ends it
# must get the GIL back before the device runs dry. Python's default 5 ms switch interval is longer
# than a decode step, so a busy event loop could hold the GIL that long.
GIL_SWITCH_INTERVAL_S = 0.0005


class ThreadCore:
    """Steps an LLMEngine on a thread of this process."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()  # guards _commands, filled by the loop, drained by the thread
        self._commands: list[Command] = []
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop, deliver, die) -> None:
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._run, args=(loop, deliver, die), name="flashpage-engine",
                                        daemon=True)
        self._thread.start()

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            deadline: float | None = None) -> None:
        self._send(AddRequest(request_id, prompt_token_ids, params, deadline))

    def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    def _send(self, cmd: Command) -> None:
        with self._lock:
            self._commands.append(cmd)
        self._wake.set()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def _run(self, loop, deliver, die) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                with self._lock:
                    commands, self._commands = self._commands, []
                if not commands and not engine.has_unfinished():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                refused = apply_commands(engine, commands)
                outputs = engine.step() if engine.has_unfinished() else []
                if outputs or refused:
                    loop.call_soon_threadsafe(deliver, outputs, refused)
        except BaseException as e:  # the engine cannot continue: fail everyone, report unhealthy
            log.exception("engine loop died")
            loop.call_soon_threadsafe(die, e)
