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
                     ("drop", key)             the sequence ended
                     ("job", step, keys, tokens, rows)  advance matchers `keys` by `tokens`, then
                                               (step not None) fill the step's masks, row j from
                                               matcher rows[j] (-1: unconstrained), and write the
                                               step to the flag
                     ("fail_at", n)            tests: the n-th fill from now fails (0: none)
  process -> engine: ("added", key, error)     error None, or what is wrong with the spec
                     ("failed", step, message) a job failed (its rows left alone, live 0)
A fill that succeeds sends nothing: its flag is the answer (the device reads it; the engine reads
it after collecting the step). A failed one writes its step to the second flag first.
The process reads until its socket closes (the engine closed it, or died), then exits.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection

from server.engine.requests import RequestError
from server.sampling_params import StructuredOutput
from server.worker.grammar_rows import MaskLayout, MaskMemory

log = logging.getLogger("flashpage.grammar")
ENTRY = "import sys; from server.engine.grammar_process import main; main(sys.argv[1:])"  # the process's
START_TIMEOUT_S = 120.0  # a matcher's first reply waits for the process's start (imports, tokenizer)


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
                 memory: MaskMemory) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-c", ENTRY, str(theirs.fileno()), str(fd)],
                                     pass_fds=(theirs.fileno(), fd))
        theirs.close()
        self.conn = Connection(ours.detach())
        layout = memory.layout
        self.conn.send((model_path, vocab_size, sorted(stop_token_ids), layout.rows, layout.words))
        self.flags = layout.views(memory.buffer)[0]
        self.replies: dict[int, str | None] = {}  # key -> error of its matcher (None: made)
        self.unwanted: set[int] = set()  # keys dropped before their reply came: it is not kept
        self.failures: dict[int | None, str] = {}  # step -> why its job failed

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
                if kind == "added" and ref in self.unwanted:
                    self.unwanted.discard(ref)
                elif kind == "added":
                    self.replies[ref] = text
                else:
                    self.failures[ref] = text
                    if ref is None:
                        log.error("a grammar job failed: %s", text)
        except (EOFError, OSError):
            pass  # gone: the callers see it in the flags, or in alive

    def add(self, key: int, spec: StructuredOutput) -> PendingMatcher:
        self._send(("add", key, spec.kind, spec.spec))
        return PendingMatcher(self, key)

    def drop(self, key: int, answered: bool = True) -> None:
        """The sequence ended: its matcher goes. `answered`: the process's reply about it was read
        (else it is not kept when it comes)."""
        if not answered and self.replies.pop(key, self) is self:
            self.unwanted.add(key)
        try:
            self._send(("drop", key))
        except RuntimeError:
            pass  # gone, and its matchers with it

    def job(self, step: int | None, keys: list[int], tokens: list[int], rows: list[int] | None) -> None:
        self._send(("job", step, keys, tokens, rows))

    def fail_fill_at(self, n: int) -> None:
        """Tests: the n-th fill from now fails (0: none does)."""
        self._send(("fail_at", n))

    def check(self, step: int) -> None:
        """After a constrained step's ids are in: raise if its fill failed, or never came."""
        if int(self.flags[1]) == step or int(self.flags[0]) < step:
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
    """A matcher the process is making: done() once it answered; result() the key, or RequestError."""

    process: GrammarProcess
    key: int

    def done(self) -> bool:
        self.process.drain()
        return self.key in self.process.replies or not self.process.alive

    def result(self, timeout: float = START_TIMEOUT_S) -> int:
        deadline = time.monotonic() + timeout
        while self.key not in self.process.replies:
            if not self.process.alive or time.monotonic() > deadline:
                raise RequestError("the grammar process did not answer (it is gone, or stuck)")
            self.process.drain(0.05)
        error = self.process.replies.pop(self.key)
        if error is not None:
            raise RequestError(error)
        return self.key


# -- the process ----------------------------------------------------------------------------------
def serve(conn: Connection, fd: int) -> None:
    from models import load_tokenizer
    from server.engine.grammar import Grammars

    model_path, vocab_size, stop_ids, rows, words = conn.recv()
    layout = MaskLayout(rows, words)
    flags, lives, bitss = layout.views(mmap.mmap(fd, layout.nbytes))
    grammars = Grammars(load_tokenizer(model_path), vocab_size, frozenset(stop_ids))
    matchers: dict[int, object] = {}
    sending = threading.Lock()
    compiles = ThreadPoolExecutor(1, thread_name_prefix="flashpage-compile")

    def reply(msg: tuple) -> None:
        with sending:
            conn.send(msg)

    def make(key: int, spec: StructuredOutput) -> None:
        try:
            matchers[key] = grammars.matcher(spec)
            reply(("added", key, None))
        except RequestError as e:
            reply(("added", key, str(e)))
        except Exception as e:  # noqa: BLE001 - anything else is the request's error too, and said so
            reply(("added", key, f"{type(e).__name__}: {e}"))

    fills, fail_at = 0, 0
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the engine closed it, or died: nothing here to keep
            os._exit(0)  # at once: an interpreter's teardown (torch, XGrammar) takes CPU a busy host lacks
        kind = msg[0]
        if kind == "job":
            _, step, keys, tokens, rows_of = msg
            try:
                ended = grammars.accept([matchers[k] for k in keys], tokens) if keys else frozenset()
                if step is not None:
                    fills += 1
                    if fills == fail_at:
                        raise RuntimeError("injected fill failure")
                    grammars.fill_bitmask([None if r < 0 else matchers[r] for r in rows_of], bitss[step % 2],
                                          lives[step % 2], ended)
            except Exception as e:  # noqa: BLE001 - the step fails, the process goes on
                if step is not None:
                    lives[step % 2][: len(rows_of)] = 0
                    flags[1] = step
                reply(("failed", step, f"{type(e).__name__}: {e}"))
            if step is not None:
                flags[0] = step  # after every write to the masks (one thread, x86's store order)
        elif kind == "add":
            compiles.submit(make, msg[1], StructuredOutput(msg[2], msg[3]))
        elif kind == "drop":
            matchers.pop(msg[1], None)
        elif kind == "fail_at":
            fail_at = fills + msg[1] if msg[1] else 0


def main(argv: list[str]) -> None:
    """The process's entry (`ENTRY`): the socket's fd, the masks' memfd."""
    serve(Connection(int(argv[0])), int(argv[1]))
