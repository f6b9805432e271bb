"""The grammar process: the XGrammar matcher of every constrained sequence, in a process of its own
that fills each step's token masks into memory it shares with the engine.

Why a process. A constrained step's masks are filled on the host while the device runs the step's
forward (server/worker/grammar_rows.py); the fill is on the device's path the moment it takes
longer than the forward. On a thread of the engine's process it did, about half the time: XGrammar
lets go of the GIL while it works, but every return to Python waited for the engine's thread,
which holds the GIL while it detokenizes and schedules (GPT-2 small, batch 64, on an H100: the
job took 0.42-0.6 ms a step on its thread against ~0.25 ms alone, beside a 0.64 ms forward). Here
nothing else wants this process's GIL.

Protocol: pickled tuples over a socket pair; the masks and flags in a memfd both processes map
(`MaskLayout`, server/worker/grammar_rows.py).
  engine -> process: ("add", key, kind, spec)  compile (on a thread of its own: a new schema takes
                                               tens of milliseconds) and make key's matcher
                     ("job", step, adds, drops, tokens, rows, forgets, drafts)
                                               first make the matchers `adds` ([(key, kind, spec)]:
                                               specs this process compiled before, a cache hit)
                                               and drop the matchers `drops` (their sequences
                                               ended); then (tokens not None) advance the matchers
                                               of the last fill's rows by the ids that step
                                               sampled, row by row (rows of dropped matchers and
                                               unconstrained rows skipped); then (step not None)
                                               fill the step's masks, row j from matcher rows[j]
                                               (-1: unconstrained; rows None: the last fill's
                                               rows), and write the step to the flag; `forgets`
                                               ([(kind, spec)]): compiled specs to let go of;
                                               `drafts`: its verifications (server/engine/spec/),
                                               whose ids next job are each one's run, then -1
                     ("check", ref, [(key, proposals)])  how many proposals each matcher accepts
                     ("fail_at", n)            tests: the n-th fill from now fails (0: none)
                     ("slow", seconds, marker) tests: every compile from now of a spec holding
                                               `marker` takes that much longer
                     ("count",)                tests: how many matchers and compiled specs it holds
  process -> engine: ("compiling", key, t)      key's spec began to compile at time.monotonic() t
                                               (one clock for every process): its deadline counts from t
                     ("added", key, (error, bytes))  error None, or what is wrong with the spec;
                                               the compiled grammar's size
                     ("broken", key, error)    a job's matcher of `adds` could not be made (its row
                                               is left alone; the engine fails its request)
                     ("failed", step, message) a job failed (its rows left alone, live 0)
                     ("count", n, compiled)    the answer to "count"
                     ("checked", ref, counts)  the answer to "check"
A fill that succeeds sends nothing: its flag is the answer (the device reads it; the engine reads
it after collecting the step). A failed one writes its step to the second flag first.
Why adds and drops ride on the jobs: a batch of 64 requests of one schema cost 128 messages of
20-30 us each on the engine's thread, and the engine waited 3-5 ms for 64 answers before admitting
them (GPT-2 small on an H100, `bench_structured.py --timeline`: a run takes ~80 ms). A
request whose spec the process has compiled is admitted at once; its matcher is made before the
first fill that needs it, in the same message.
A spec compiles here under the request's deadline (`structured_compile_timeout`, the one it met
in the API process's compile process, server/engine/grammar_compile.py), counted from when its
compile begins here (not from the ask: the process's start, or other specs compiling first, are not
the spec's doing; START_TIMEOUT_S is their backstop). Past it the request alone is refused as the
API process refuses one (server/engine/llm_engine.py: a 400 saying so) and its blocks are freed.
A thread's compile cannot be stopped: it runs to its end (a spec that compiled in time in the compile
process takes about as long here) and the grammar is kept, listed when its answer comes, for the
next request of that spec; new specs wait behind it on the one compile thread meanwhile.
The process keeps each spec it compiled (a job's adds make their matchers from it, ~10 us) until
the engine says to forget it: the engine keeps the list, least recently used first, within
`cache_bytes` of compiled grammars (the sizes the process reports), so that what it admits at once
is always there and the process's memory stays bounded (issue 44: unbounded, ~20 specs took it
from 365 to 1,041 MB). XGrammar's own cache there has the same bound.
The process itself (its loop over these messages) is server/engine/grammar_matchers.py; it reads
until its socket closes (the engine closed it, or died), then exits; it ignores SIGINT and SIGTERM
(they reach the whole process group; the engine closes it when it stops).
"""

from __future__ import annotations

import logging
import mmap
import operator
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from server.config import StructuredLimits
from server.engine.grammar import spec_name
from server.engine.grammar_compile import CompileTimeout
from server.engine.requests import RequestError
from server.sampling_params import StructuredOutput
from server.worker.grammar_rows import MaskLayout, MaskMemory

log = logging.getLogger("flashpage.grammar")
ENTRY = "import sys; from server.engine.grammar_matchers import main; main(sys.argv[1:])"  # the process's
START_TIMEOUT_S = 120.0  # a matcher's first reply waits for the process's start (imports, tokenizer)
READY_SPECS = 1024  # the specs the engine remembers the process compiled (least recently used go)
CHECK_TIMEOUT_S = 2.0  # a speculative step's wait for its proposals' check (then none of them stands)


def mask_memory(rows: int, covered: int, alive: Callable[[], bool]) -> tuple[int, MaskMemory]:
    """A memfd for the masks of `rows` rows over a vocabulary of `covered` tokens, mapped here;
    returns (fd, memory). The fd goes to each grammar process; the memory to the runner."""
    layout = MaskLayout(rows, -(-covered // 32))
    if hasattr(os, "memfd_create"):  # Linux
        fd = os.memfd_create("flashpage-grammar-masks")
    else:  # another POSIX system: an unlinked file, kept by its descriptor
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    os.ftruncate(fd, layout.nbytes)
    return fd, MaskMemory(mmap.mmap(fd, layout.nbytes), layout, covered, alive)


class GrammarProcess:
    """The engine's side: starts the process, sends it work, reads its replies without blocking."""

    def __init__(self, model_path: str, vocab_size: int, stop_token_ids: frozenset[int], fd: int,
                 memory: MaskMemory, owed: dict[int, str] | None = None, cache_bytes: int = -1,
                 compile_timeout: float = StructuredLimits.structured_compile_timeout) -> None:
        """`owed`: the failed steps of the process this one replaces (`abandon`), which the engine
        checks with this one. `cache_bytes`: the compiled grammars it keeps, at most (-1: no bound).
        `compile_timeout`: seconds a spec may compile here (StructuredLimits.structured_compile_timeout)."""
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-c", ENTRY, str(theirs.fileno()), str(fd)],
                                     pass_fds=(theirs.fileno(), fd))
        theirs.close()
        self.conn = Connection(ours.detach())
        layout = memory.layout
        self.conn.send((model_path, vocab_size, sorted(stop_token_ids), layout.rows, layout.words, cache_bytes))
        self.flags = layout.views(memory.buffer)[0]
        self.replies: dict[int, tuple[str | None, int]] = {}  # key -> (error of its matcher (None: made), bytes)
        self.compile_timeout = compile_timeout
        self.started: dict[int, float] = {}  # key -> when its spec began to compile there (unanswered keys)
        self.unwanted: dict[int, StructuredOutput | None] = {}  # keys dropped before their reply came, their specs
        self.failures: dict[int | None, str] = dict(owed or {})  # step -> why its job failed
        self.broken: dict[int, str] = {}  # key -> why its matcher of a job's adds was not made
        self.ready: OrderedDict[StructuredOutput, int] = OrderedDict()  # specs compiled there -> their bytes
        self.ready_bytes, self.cache_bytes = 0, cache_bytes
        self.forgets: list[tuple[str, str]] = []  # specs it may let go of, with the next job
        self.adds: list[tuple[int, str, str]] = []  # matchers to make (key, kind, spec), with the next job
        self.drops: list[int] = []  # and matchers to drop
        self.count: int | None = None  # the last answer to "count": matchers
        self.cached: int | None = None  # and compiled specs
        self.checked: dict[int, list[int]] = {}  # the answers to "check", by their number
        self.checks = 0  # the last check's number
        self.filled: list | None = None  # the sequences of the last fill's rows (the process has their keys)
        self.sent = 0  # the last step sent to be filled

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except OSError as e:
            raise RuntimeError(f"the grammar process is gone (exit code {self.proc.poll()})") from e

    def drain(self, timeout: float = 0.0) -> None:
        """Read every reply that is there (waiting up to `timeout` for the first)."""
        try:
            while self.conn.poll(timeout):
                timeout = 0.0
                kind, ref, text = self.conn.recv()
                if kind == "compiling":
                    self.started[ref] = text
                elif kind == "added" and ref in self.unwanted:  # its matcher is not kept; its spec is
                    self.started.pop(ref, None)
                    spec, (error, nbytes) = self.unwanted.pop(ref), text
                    if error is None and spec is not None:  # compiled there: listed, so that it is let go of in turn
                        self.compiled(spec, nbytes)
                elif kind == "added":
                    self.started.pop(ref, None)
                    self.replies[ref] = text
                elif kind == "broken":
                    self.broken[ref] = text
                elif kind == "count":
                    self.count, self.cached = ref, text
                elif kind == "checked":
                    self.checked[ref] = text
                else:
                    self.failures[ref] = text
                    if ref is None:
                        log.error("a grammar job failed: %s", text)
        except (EOFError, OSError):
            pass  # gone: the callers see it in the flags, or in alive

    def add(self, key: int, spec: StructuredOutput) -> PendingMatcher | None:
        """Ask for key's matcher. None: the process compiled this spec before, so the request may
        be admitted now (the matcher is made with the next job, before any fill needs it); else a
        PendingMatcher, answered once the spec has compiled there."""
        if spec in self.ready:
            self.ready.move_to_end(spec)
            self.adds.append((key, spec.kind, spec.spec))
            return None
        self._send(("add", key, spec.kind, spec.spec))
        return PendingMatcher(self, key, spec)

    def compiled(self, spec: StructuredOutput, nbytes: int = 0) -> None:
        """The process compiled `spec` (a matcher of it was made): later ones are made with a job.
        The least recently used go past READY_SPECS, or past `cache_bytes` (the newest stays)."""
        self.ready_bytes += nbytes - self.ready.get(spec, 0)
        self.ready[spec] = nbytes
        self.ready.move_to_end(spec)
        while len(self.ready) > READY_SPECS or (len(self.ready) > 1 and 0 <= self.cache_bytes < self.ready_bytes):
            old, size = self.ready.popitem(last=False)
            self.ready_bytes -= size
            self.forgets.append((old.kind, old.spec))

    def drop(self, key: int, answered: bool = True, spec: StructuredOutput | None = None) -> None:
        """The sequence ended: its matcher goes (with the next job). `answered`: the process's
        reply about it was read (else it is not kept when it comes; `spec` is listed compiled then)."""
        if not answered and self.replies.pop(key, self) is self:
            self.unwanted[key] = spec
        self.started.pop(key, None)
        self.broken.pop(key, None)
        for i, add in enumerate(self.adds):
            if add[0] == key:  # never sent: nothing to make or drop
                del self.adds[i]
                return
        self.drops.append(key)

    def job(self, step: int | None, tokens: list[int] | None, seqs: list | None = None,
            drafts: list[tuple[int, list[int]]] | None = None) -> None:
        """`tokens`: the ids the last filled step sampled, one a row (its matchers take them);
        `step`, `seqs`: a step to fill and its rows' sequences (their `grammar` keys). The rows go
        only when they changed: a decoding batch keeps its sequences step after step, and their
        keys cost the engine's thread a pass over them and the message a list. `drafts`: the
        step's constrained verifications, (first row, proposals) (server/engine/spec/)."""
        adds, drops, forgets, self.adds, self.drops, self.forgets = self.adds, self.drops, self.forgets, [], [], []
        rows = None
        if seqs is not None:
            last, self.filled = self.filled, seqs
            if last is None or len(last) != len(seqs) or not all(map(operator.is_, last, seqs)):
                rows = [-1 if s.grammar is None else s.grammar for s in seqs]
        self._send(("job", step, adds, drops, tokens, rows, forgets, drafts))
        if step is not None:
            self.sent = step

    def valid_prefixes(self, drafts: list[tuple[int, list[int]]], timeout: float = CHECK_TIMEOUT_S) -> list[int]:
        """How many leading proposals of each (key, proposals) its matcher accepts after the ids
        sent so far; 0 each where the process does not answer in time (they decode a token)."""
        self.checks = ref = self.checks + 1
        try:
            self._send(("check", ref, drafts))
        except RuntimeError:
            return [0] * len(drafts)
        deadline = time.monotonic() + timeout
        while ref not in self.checked and self.alive and time.monotonic() < deadline:
            self.drain(0.01)
        answer = self.checked.pop(ref, None)
        self.checked.clear()  # (late answers to checks given up on)
        return answer if answer is not None else [0] * len(drafts)

    def abandon(self, step: int | None = None) -> dict[int, str]:
        """The process is gone: every step sent to it and not yet filled (and `step`, whose job
        never reached it) is marked failed, and the waits for them (the device's, the CPU path's)
        end: the engine writes the flag the process no longer will. Returns those failures (for
        the process that replaces it, whose check the steps meet)."""
        last, filled = max(self.sent, step or 0), int(self.flags[0])
        owed = {s: "the grammar process is gone" for s in range(filled + 1, last + 1)}
        self.failures.update(owed)
        if owed:
            self.flags[1] = last
            self.flags[0] = last
        return owed

    def flush(self) -> None:
        """Send the matchers to make and drop now (no job is on its way to carry them)."""
        if self.adds or self.drops or self.forgets:
            try:
                self.job(None, None)
            except RuntimeError:
                pass  # gone, and its matchers with it

    def held(self, timeout: float = 5.0) -> int | None:
        """Tests: how many matchers the process holds once it has read everything sent before."""
        self.count = None
        self._send(("count",))
        deadline = time.monotonic() + timeout
        while self.count is None and self.alive and time.monotonic() < deadline:
            self.drain(0.05)
        return self.count

    def fail_fill_at(self, n: int) -> None:
        """Tests: the n-th fill from now fails (0: none does)."""
        self._send(("fail_at", n))

    def slow_compiles(self, seconds: float, marker: str = "") -> None:
        """Tests: every compile from now of a spec whose text holds `marker` takes `seconds` longer
        (0: none does; FLASHPAGE_FAULT_INJECT's compile_sleep, server/engine/faults.py)."""
        self._send(("slow", seconds, marker))

    def check(self, step: int) -> None:
        """After a constrained step's ids are in: raise if its fill failed, or never came."""
        if step in self.failures or int(self.flags[1]) == step or int(self.flags[0]) < step:
            deadline = time.monotonic() + 1.0
            while step not in self.failures and self.alive and time.monotonic() < deadline:
                self.drain(0.05)
            why = self.failures.pop(step, None)
            if why is None:
                why = "the grammar process is gone" if not self.alive else "its masks were not filled"
            raise RuntimeError(f"the step's grammar masks: {why}")

    def close(self) -> None:
        self.conn.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@dataclass
class PendingMatcher:
    """A matcher the process is making: done() once it answered, it is gone, or the spec's compile
    there ran past the deadline (`compile_timeout`, from the time it began: see the module
    docstring), or START_TIMEOUT_S passed since the ask (a backstop: the process's start, or compiles
    before it); result() the key, else RequestError (CompileTimeout past the deadline)."""

    process: GrammarProcess
    key: int
    spec: StructuredOutput
    asked: float = field(default_factory=time.monotonic)

    def _late(self) -> bool:
        started = self.process.started.get(self.key)
        return started is not None and time.monotonic() - started > self.process.compile_timeout

    def done(self) -> bool:
        self.process.drain()
        return (self.key in self.process.replies or not self.process.alive or self._late()
                or time.monotonic() - self.asked > START_TIMEOUT_S)

    def result(self, timeout: float = START_TIMEOUT_S) -> int:
        deadline = self.asked + timeout
        while self.key not in self.process.replies:
            if not self.process.alive:
                raise RequestError("the grammar process did not answer (it is gone)")
            if self._late():  # its matcher, should it still come, is not kept; its grammar is
                log.warning("a %s ran past %g s in the grammar process: its request is refused",
                            spec_name(self.spec.kind), self.process.compile_timeout)
                self.process.drop(self.key, answered=False, spec=self.spec)
                raise CompileTimeout.of(self.spec, self.process.compile_timeout)
            if time.monotonic() > deadline:
                self.process.drop(self.key, answered=False, spec=self.spec)  # should it still come, it is not kept
                raise RequestError(f"the grammar process did not compile it within {timeout:g} s")
            self.process.drain(0.05)
        error, nbytes = self.process.replies.pop(self.key)
        if error is not None:
            raise RequestError(error)
        self.process.compiled(self.spec, nbytes)
        return self.key
