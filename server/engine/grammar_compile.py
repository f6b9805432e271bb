"""Compiling structured-output specs where a crash or a runaway cannot take the server down.

Why a process. A spec is the client's program for XGrammar, and XGrammar can die on one (a JSON
schema whose `$ref`s chain 3,600 deep overflowed its stack: SIGSEGV, and the API process with it,
issue 44) or run for minutes (`"." * 30000` as a regular expression). A thread cannot be stopped
and a segfault cannot be caught, so every spec new to a process is compiled first in a sacrificial
one: a `CompileWorker` (`worker_main`), started with what the grammar process is started with (the
model's tokenizer, the logits' width, the end ids: `CompileSetup`), which builds the same `Grammars`
(server/engine/grammar.py) and answers one spec at a time with its error, or None. Its caller waits
`structured_compile_timeout` seconds at most; past that, or when the process died, the process is
killed, a new one is started at once, and that request alone gets a 400 saying which.

`SpecCompiler` gives verdicts: a cache keyed by the spec in front (a spec seen before costs a hash
and a dictionary lookup, no round trip: the common case of many requests sharing a few schemas),
its bounds (server/engine/grammar_bounds.py, before any compiler sees the spec), then a bounded
pool of workers. The API process asks it before queueing a request (server/api/controls.py), an
offline `LLMEngine` before adding one that no front end checked; either way the grammar process
(server/engine/grammar_process.py), which must compile the spec itself to fill its masks, only ever
sees specs that compiled in a worker within the deadline. Any kind of spec goes through here
(`Grammars.compile` decides what each kind means), so a new kind needs no change in this file.

The worker ignores SIGINT and SIGTERM (Ctrl+C and a supervisor's TERM reach the whole process
group; its parent drains and then closes it) and exits when its socket closes or its parent is gone.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection

from server.config import StructuredLimits
from server.engine.grammar import spec_name
from server.engine.grammar_bounds import check_spec
from server.engine.requests import RequestError
from server.sampling_params import StructuredOutput

log = logging.getLogger("flashpage.grammar")
ENTRY = "import sys; from server.engine.grammar_compile import worker_main; worker_main(sys.argv[1:])"
START_TIMEOUT_S = 120.0  # a worker's imports and tokenizer (seconds of CPU on a busy host)
COMPILE_WORKERS = 1  # per process that compiles: each is ~350 MB (torch comes with XGrammar)
PENDING_BOUND = 64  # compiles running or waiting for a worker, at most; beyond them CompilerBusy (HTTP 503)
VERDICTS = 4096  # specs whose verdict a SpecCompiler remembers (least recently used go)
TIMEOUT_REMEMBERED_S = 60.0  # a spec that ran out of time is refused at once for this long


@dataclass(frozen=True)
class CompileSetup:
    """What a worker is started with: what the grammar process builds its Grammars from."""

    model_path: str
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    cache_bytes: int = -1  # XGrammar's cache of compiled grammars there (StructuredLimits.structured_cache_memory)


class CompilerBusy(RuntimeError):
    """Every worker is busy and enough compiles wait for them already: try again later (HTTP 503)."""


class CompileTimeout(RequestError):
    """The spec ran past the deadline (remembered for a while only: a loaded host is slower)."""

    @classmethod
    def of(cls, spec: StructuredOutput, timeout: float) -> CompileTimeout:
        """What the client reads (a 400), wherever the spec ran out of time: here, or in the grammar
        process (server/engine/grammar_process.py)."""
        return cls(f"the {spec_name(spec.kind)} did not compile within {timeout:g} s (--structured-compile-timeout); "
                   "a simpler one may")


class CompileWorker:
    """One sacrificial compile process (started at once), used by one thread at a time."""

    def __init__(self, setup: CompileSetup) -> None:
        self.setup = setup
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.ready = False
        self.start()

    def start(self) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-c", ENTRY, str(theirs.fileno())], pass_fds=(theirs.fileno(),))
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(self.setup)
        self.ready = False

    def kill(self) -> int | None:
        """Stop the process now; its exit code (negative: the signal that ended it)."""
        self.conn.close()
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            return None

    def _restart(self) -> int | None:
        code = self.kill()
        self.start()
        return code

    def compile(self, spec: StructuredOutput, timeout: float) -> str | None:
        """The spec's error (None: it compiled). Raises RequestError when the worker died on it or
        ran out of time (then it is replaced), CompilerBusy when no worker could be started."""
        if self.proc.poll() is not None:  # died while idle (not of a spec): a new one
            self._restart()
        if not self.ready:
            self._wait_ready()
        try:
            self.conn.send((spec.kind, spec.spec))
            answered = self.conn.poll(timeout)
            reply = self.conn.recv() if answered else None
        except (EOFError, OSError):
            answered, reply = True, None
        if reply is not None:
            return reply[1]
        code = self._restart()
        name = spec_name(spec.kind)
        if not answered:
            log.warning("a %s ran past %g s in the compile process: killed it, started another", name, timeout)
            raise CompileTimeout.of(spec, timeout)
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        log.warning("a %s crashed the compile process (%s): started another", name, how)
        raise RequestError(f"the {name} crashed the grammar compiler ({how}); nothing else was affected, but it "
                           "cannot be served: make it smaller or less deeply nested")

    def _wait_ready(self) -> None:
        try:
            if self.conn.poll(START_TIMEOUT_S):
                kind, detail = self.conn.recv()
                if kind == "ready":
                    self.ready = True
                    return
                raise CompilerBusy(f"the grammar compile process failed to start: {detail}")
        except (EOFError, OSError):
            pass
        code = self._restart()
        raise CompilerBusy(f"the grammar compile process did not start (exit code {code})")


class SpecCompiler:
    """Verdicts on structured-output specs: remembered ones at once, new ones bounded, then compiled
    in a worker under the deadline (see the module docstring). Thread-safe."""

    def __init__(self, setup: CompileSetup, limits: StructuredLimits, workers: int = COMPILE_WORKERS) -> None:
        self.setup, self.limits, self.workers = setup, limits, workers
        self._idle: queue.SimpleQueue[CompileWorker | None] = queue.SimpleQueue()
        for _ in range(workers):
            self._idle.put(None)  # started when first needed
        self._started: list[CompileWorker] = []
        self._verdicts: OrderedDict[bytes, tuple[str | None, float | None]] = OrderedDict()
        self._lock = threading.Lock()
        self.pending = 0  # compiles running or waiting for a worker
        self.queue_bound = PENDING_BOUND
        self._warm = False  # a worker has answered: from then on a compile waits for one `timeout` at most
        # Where an event loop awaits `check_new` (server/api/controls.py): threads of its own, one for
        # every compile that may be pending (made as needed), so that waiting compiles never hold up
        # the loop's default pool (tokenizing, chat templates) nor one another beyond their wait.
        self.executor = ThreadPoolExecutor(self.queue_bound, thread_name_prefix="flashpage-compile-wait")

    @staticmethod
    def _key(spec: StructuredOutput) -> bytes:
        return hashlib.blake2b(f"{spec.kind}\0{spec.spec}".encode("utf-8", "surrogatepass"), digest_size=20).digest()

    def cached(self, spec: StructuredOutput) -> bool:
        """True if the spec compiled before; RequestError if it failed before; False if unknown."""
        key = self._key(spec)
        with self._lock:
            verdict = self._verdicts.get(key)
            if verdict is None:
                return False
            error, expires = verdict
            if expires is not None and time.monotonic() > expires:
                del self._verdicts[key]
                return False
            self._verdicts.move_to_end(key)
        if error is not None:
            raise RequestError(error)
        return True

    def check(self, spec: StructuredOutput) -> None:
        """RequestError if the spec is over a bound, invalid, crashes the compiler or runs past the
        deadline; CompilerBusy if too many compiles wait already. Blocks while it compiles."""
        if self.cached(spec):
            return
        with self.slot():
            self.check_new(spec)

    @contextmanager
    def slot(self):
        """Count a compile as pending while the block runs (CompilerBusy if too many are)."""
        with self._lock:
            if self.pending >= self.queue_bound:
                raise CompilerBusy(f"{self.pending} structured-output specs are compiling or waiting to; "
                                   "retry later")
            self.pending += 1
        try:
            yield
        finally:
            with self._lock:
                self.pending -= 1

    def check_new(self, spec: StructuredOutput) -> None:
        """`check` for a spec `cached` does not know, inside a `slot`: its bounds, then a compile in a
        worker. Blocks while it waits for a worker and compiles."""
        check_spec(spec, self.limits)  # before any compiler sees it
        timeout = self.limits.structured_compile_timeout
        try:  # as long as a spec may compile (while the first worker starts: as long as that may take)
            worker = self._idle.get(timeout=timeout if self._warm else START_TIMEOUT_S)
        except queue.Empty:
            raise CompilerBusy(f"no grammar compile process was free within {timeout:g} s (others are compiling "
                               "specs); retry later") from None
        try:
            if self.cached(spec):  # another request compiled it while this one waited
                return
            if worker is None:
                worker = CompileWorker(self.setup)
                with self._lock:
                    self._started.append(worker)
            try:
                error = worker.compile(spec, timeout)
            except RequestError as e:  # it crashed the worker or ran out of time
                self._remember(spec, str(e), TIMEOUT_REMEMBERED_S if isinstance(e, CompileTimeout) else None)
                raise
            self._warm = True
        finally:
            self._idle.put(worker)
        self._remember(spec, error, None)
        if error is not None:
            raise RequestError(error)

    def _remember(self, spec: StructuredOutput, error: str | None, ttl: float | None) -> None:
        with self._lock:
            self._verdicts[self._key(spec)] = (error, None if ttl is None else time.monotonic() + ttl)
            if len(self._verdicts) > VERDICTS:
                self._verdicts.popitem(last=False)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            started, self._started = self._started, []
        for worker in started:
            worker.kill()


# -- the worker process ---------------------------------------------------------------------------
def _watch_parent() -> None:
    """Exit once the process that started this one is gone (it cannot close the socket if it was
    killed mid-compile, and this one would otherwise compile to the end)."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def serve(conn: Connection) -> None:
    setup: CompileSetup = conn.recv()
    threading.Thread(target=_watch_parent, daemon=True, name="flashpage-parent-watch").start()
    try:
        from models import load_tokenizer
        from server.engine.grammar import Grammars

        grammars = Grammars(load_tokenizer(setup.model_path), setup.vocab_size, frozenset(setup.stop_token_ids),
                            setup.cache_bytes)
    except Exception as e:  # noqa: BLE001 - said to the parent, which reports it
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            kind, text = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # at once: the interpreter's teardown (torch, XGrammar) takes CPU a busy host lacks
        spec = StructuredOutput(kind, text)
        try:
            grammars.compile(spec)
            error = None
        except RequestError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - anything else the spec provoked is its error too
            error = f"invalid {spec_name(spec.kind)}: {type(e).__name__}: {e}"
        conn.send(("done", error))


def worker_main(argv: list[str]) -> None:
    """The worker's entry (`ENTRY`): the socket's fd."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if hasattr(os, "SCHED_BATCH"):  # Linux: CPU-bound, so a serving process that wakes runs first
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # (its share of the CPU is unchanged)
    serve(Connection(int(argv[0])))
