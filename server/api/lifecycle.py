"""The server process's life: graceful drain on SIGTERM, a non-zero exit when the engine dies.

`serve()` runs uvicorn with the connection guards of server/api/connections.py (timeouts, header
size, connection cap) in place of its plain httptools protocol, and two changes to its signal and
tick handling:

- SIGTERM (or Ctrl+C): admission stops at once (new requests get 503 with Retry-After, /health
  503 so load balancers look elsewhere) while the server keeps listening; requests in flight get
  up to `grace` seconds to finish; whatever is still running then is aborted (it ends with
  finish_reason "abort" and the text it has, and its KV blocks are freed); then uvicorn shuts down
  and the process exits 0. A second signal aborts everything at once.
- The engine died (its loop raised, e.g. steps kept failing): /health already answers 503; the
  server stops and the process exits 1, instead of hanging around unable to serve.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys

import uvicorn

from server.api.connections import protocol_class
from server.api.guards import ServerLimits
from server.bridge.async_engine import AsyncEngine
from server.bridge.thread_core import GIL_SWITCH_INTERVAL_S

log = logging.getLogger("flashpage.lifecycle")

GC_GEN0_THRESHOLD = 20_000  # allocations between young-generation collections (Python's default: 700)


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace: float, managed: bool = False) -> None:
        super().__init__(config)
        self.engine = engine
        self.grace = grace
        self.managed = managed  # one of several API processes: the parent forwards every signal as SIGTERM
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.managed and sig == signal.SIGINT:
            return  # Ctrl+C reached the whole process group; the parent forwards it (server/api/servers.py)
        if self._loop is None:  # not serving yet: uvicorn's own behaviour
            super().handle_exit(sig, frame)
        elif self._drain is None:
            self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)
        else:  # a second signal: stop waiting
            log.warning("%s again: aborting %d request(s) now", signal.Signals(sig).name, self.engine.num_active)
            self._loop.call_soon_threadsafe(self.engine.abort_all)
            self.should_exit = True

    def _start_drain(self, signame: str) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_then_exit(signame))

    async def _drain_then_exit(self, signame: str) -> None:
        loop = asyncio.get_running_loop()
        self.engine.draining = True
        log.info("%s: draining: admitting nothing new; %d request(s) in flight get up to %.1f s",
                 signame, self.engine.num_active, self.grace)
        deadline = loop.time() + self.grace
        while self.engine.num_active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.engine.num_active:
            log.warning("grace period over: aborting %d request(s)", self.engine.abort_all())
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.engine.dead is not None and self.exit_code == 0:
            log.critical("the engine cannot continue (%r): shutting down, exit code 1", self.engine.dead)
            self.exit_code = 1
            self.should_exit = True
        return await super().on_tick(counter)


def serve(app, engine: AsyncEngine, limits: ServerLimits, sockets: list | None = None, managed: bool = False,
          **uvicorn_kwargs) -> int:
    """Serve until SIGTERM (exit code 0, after draining) or engine death (1). Returns the exit code.
    `sockets`: an already-bound listening socket shared with other API processes (then `managed`:
    SIGINT is left to the parent, server/api/servers.py)."""
    # An API process hands long prompts, chat templates and large answers to worker threads
    # (server/api/tokenize.py, openai_serving.py); while one runs Python the event loop waits for the
    # GIL up to a switch interval at each turn, and a finished one waits as long for a loop busy
    # streaming: Python's default 5 ms made each such request, each render a router waits for, and
    # /health beside a large answer that much later. The in-process engine thread's interval
    # (thread_core.py), for that reason.
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
    uvicorn_kwargs.setdefault("timeout_graceful_shutdown", 5)
    # ws="none": no route speaks WebSocket, so an upgrade request is plain HTTP to the guards.
    config = uvicorn.Config(app, http=protocol_class(limits), ws="none", timeout_keep_alive=limits.keep_alive_timeout,
                            **uvicorn_kwargs)
    server = Server(config, engine, limits.shutdown_grace, managed)
    # Start-up leaves millions of long-lived objects (torch, transformers, the tokenizer); each full
    # collection would walk them all again, a pause in the middle of serving: freeze them out of it.
    # Decoding a step message allocates an object or more per request in it, so with the default
    # young-generation threshold (700) the collector ran every few messages: 10-12% of an API
    # process's CPU at 256 streams (py-spy, benchmarks/profiling/bench_api_events.py).
    gc.collect()
    gc.freeze()
    threshold = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, *threshold[1:])
    try:
        server.run(sockets=sockets)
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()  # frozen objects are never freed: triton's bindings would report them leaked at exit
    return server.exit_code
