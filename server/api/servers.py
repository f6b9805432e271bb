"""Several API processes in front of one engine process (`--api-server-count N`, N > 1).

One event loop cannot keep up with a fast engine: at a few hundred streams it spends all its time
receiving outputs, encoding events and writing sockets while the engine waits (issue 20). As
vLLM's `--api-server-count` does, N uvicorn processes share one listening socket (the kernel hands
each new connection to one of them) and each has its own channel to the engine process, so
tokenising, validation, response encoding and socket writes scale with N while the engine process
only schedules and steps (server/bridge/engine_loop.py).

The parent process (`run_servers`) binds the socket, spawns the engine with N channels and the N API
processes (`api_main`), then only supervises:

- SIGTERM or SIGINT: forwarded to every API process as SIGTERM. Each drains its own requests within
  --shutdown-grace (server/api/lifecycle.py), sends StopEngine and exits 0; the engine exits when
  every channel is closed. A second signal is forwarded too: abort now. The API processes ignore
  SIGINT themselves, so Ctrl+C, which reaches the whole process group, is one signal, not two.
- An API process exits on its own (a crash, a kill) while the engine runs: the engine has aborted
  its requests and freed their blocks (server/bridge/engine_loop.py), the other API processes
  serve on, and the parent starts another in its place on a new channel to the engine (handed over
  the control pipe), sharing the same socket. Only its own clients lost their connections, and a
  server that keeps serving is what a supervisor would restore anyway, without dropping every
  other client. Restarting is bounded (`RestartBudget`: MAX_RESTARTS in RESTART_WINDOW_S): an API
  process that keeps dying stops the server as below.
- The engine exits on its own (a dead engine makes every API process exit 1), or API processes
  keep dying: the others are told to stop, and the server exits 1 for a supervisor to restart it.

Metrics: the API processes record histograms and counters in prometheus_client's multiprocess mode
(a private directory per server, PROMETHEUS_MULTIPROC_DIR) and the engine sends its statistics to
one channel only, so GET /metrics on any process reports the whole server once
(server/api/metrics.py). Per process: `requests_active` in /debug/kv, the connection cap
(--max-connections, a file-descriptor bound), and the log lines, which carry the process's pid.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

from server.api.guards import ServerLimits
from server.config import EngineConfig

if TYPE_CHECKING:  # imported where it runs: the parent process needs no torch, models or engine
    from server.bridge.engine_spawn import ClientChannel

log = logging.getLogger("flashpage.servers")

MAX_API_SERVERS = 64
STOP_WAIT_S = 30.0  # after the drain: how long an API process or the engine may take to exit
MAX_RESTARTS, RESTART_WINDOW_S = 5, 60.0  # API processes restarted in a window; one more stops the server


def default_api_server_count(cpus: int | None = None) -> int:
    """One API process per two cores beyond the engine's own two, up to 4: one on a laptop or a
    2-core CI runner (today's single process, nothing to share), 4 on a 16-core GPU host."""
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1
    return max(1, min(4, (cpus - 2) // 2))


@dataclass
class ApiProcessSpec:
    """What one API process is started with."""

    index: int
    config: EngineConfig
    limits: ServerLimits
    channel: ClientChannel
    sock: socket.socket  # the shared listening socket
    log_level: str
    log_format: str


def api_main(spec: ApiProcessSpec) -> None:
    """An API process: attach to the engine on its channel, serve HTTP on the shared socket."""
    from server.logs import setup_logging

    setup_logging(spec.log_level, spec.log_format)
    from server.api.app import create_app
    from server.api.connections import raise_fd_limit
    from server.api.lifecycle import serve
    from server.bridge.async_engine import AsyncEngine
    from server.bridge.engine_process import EngineClient

    raise_fd_limit(spec.limits.max_connections)
    engine = EngineClient(spec.config, spec.channel, id_prefix=f"{spec.index}:")
    if spec.index == 0:
        log.info("engine ready: serving %r (context %d tokens)", engine.model_name, engine.max_model_len)
    aengine = AsyncEngine(engine, max_waiting=spec.limits.max_waiting_requests,
                          request_timeout=spec.limits.request_timeout)
    app = create_app(aengine, spec.limits)
    code = serve(app, aengine, spec.limits, sockets=[spec.sock], managed=True, log_level=spec.log_level,
                 log_config=None, access_log=False)
    sys.exit(code)


@dataclass
class RestartBudget:
    """At most `limit` restarts within any `window` seconds."""

    limit: int = MAX_RESTARTS
    window: float = RESTART_WINDOW_S
    times: deque = field(default_factory=deque)

    def take(self, now: float) -> bool:
        while self.times and now - self.times[0] > self.window:
            self.times.popleft()
        if len(self.times) >= self.limit:
            return False
        self.times.append(now)
        return True


def run_servers(config: EngineConfig, limits: ServerLimits, count: int, host: str, port: int,
                log_level: str = "info", log_format: str = "text") -> int:
    """Serve with `count` API processes until a signal (exit code 0 after the drain) or a failure (1)."""
    import uvicorn
    from prometheus_client import multiprocess

    # not engine_process: it imports torch and the models
    from server.bridge.engine_spawn import reopen_channel, spawn_engine

    metrics_dir = tempfile.mkdtemp(prefix="flashpage-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the API processes (spawned below)
    sock = uvicorn.Config(app=None, host=host, port=port, log_config=None).bind_socket()  # our logging, not its
    ctx = mp.get_context("spawn")
    control, engine_control = ctx.Pipe(duplex=True)  # a socket pair: new channels' descriptors go over it
    engine, channels = spawn_engine(config, count, log_level, log_format, control=engine_control)

    def start(i: int, channel) -> mp.Process:
        p = ctx.Process(target=api_main, name=f"flashpage-api-{i}",
                        args=(ApiProcessSpec(i, config, limits, channel, sock, log_level, log_format),))
        p.start()
        channel.commands.close()  # the API process has its copies
        channel.out.close()
        return p

    def restart(i: int, dead: mp.Process) -> mp.Process:
        multiprocess.mark_process_dead(dead.pid)  # its live gauges; its counters stay summed
        return start(i, reopen_channel(control, i, engine.pid, ctx))

    apis = [start(i, ch) for i, ch in enumerate(channels)]
    port = sock.getsockname()[1]
    log.info("%d API processes on http://%s:%d in front of one engine process (pid %d)", count, host,
             port, engine.pid)
    signals = []

    def forward(sig: int, frame) -> None:
        signals.append(sig)
        for p in apis:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _supervise(apis, engine, signals, limits.shutdown_grace + STOP_WAIT_S, restart)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        sock.close()
        control.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _supervise(apis: list, engine, signals: list, patience: float, restart=None,
               budget: RestartBudget | None = None) -> int:
    """Wait for the API processes. One that exits unasked while the engine runs is replaced by
    `restart(index, dead)` (within `budget`); past the budget, or when the engine exits, stop the
    rest and kill what is still running `patience` seconds later. Returns the server's exit code."""
    failed_at = None
    budget = budget or RestartBudget()
    while any(p.is_alive() for p in apis):
        wait([p.sentinel for p in apis if p.is_alive()] + ([engine.sentinel] if engine.is_alive() else []), 1.0)
        if failed_at is not None:
            if time.monotonic() - failed_at > patience:
                for p in apis:
                    p.kill()
            continue
        gone = [i for i, p in enumerate(apis) if not p.is_alive() and (p.exitcode != 0 or not signals)]
        why = None if engine.is_alive() or signals else f"the engine process exited (code {engine.exitcode})"
        for i in gone if why is None else ():
            dead = apis[i]
            if restart is None or signals or not budget.take(time.monotonic()):
                why = f"API process {dead.name} exited (code {dead.exitcode})" + (
                    f" after {budget.limit} restarts in {budget.window:g} s" if restart is not None and not signals
                    else "")
                break
            log.error("API process %s exited (code %s): its requests were aborted; starting another in its place",
                      dead.name, dead.exitcode)
            try:
                apis[i] = restart(i, dead)
            except OSError as e:  # the engine went too (its control pipe is closed)
                why = f"API process {dead.name} exited (code {dead.exitcode}) and could not be restarted: {e!r}"
                break
        if why is not None:
            failed_at = time.monotonic()
            log.critical("%s: stopping the server, exit code 1", why)
            for p in apis:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGTERM)
    engine.join(STOP_WAIT_S)  # it exits once every API process has stopped it or gone
    if engine.is_alive():
        log.warning("the engine process did not stop; killing it")
        engine.kill()
    return 1 if failed_at is not None or any(p.exitcode != 0 for p in apis) else 0
