"""The grammar process itself: every constrained sequence's XGrammar matcher, advanced by the ids
each step sampled, filling the step's token masks into the memory it shares with the engine.

The engine's side, why this is a process and the messages both sides speak:
server/engine/grammar_process.py (`GrammarProcess` starts this one with `main`). Specs new to the
process compile on a thread of their own (a new schema takes tens of milliseconds), so that the
jobs, which fill the masks of the steps on the device's path, never wait behind one.
"""

from __future__ import annotations

import mmap
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

from server.engine.requests import RequestError
from server.sampling_params import StructuredOutput
from server.worker.grammar_rows import MaskLayout


def serve(conn: Connection, fd: int) -> None:
    """Answer the engine on `conn` until it closes; `fd`: the masks' memory (a memfd)."""
    from models import load_tokenizer
    from server.engine.grammar import Grammars

    model_path, vocab_size, stop_ids, rows, words, cache_bytes = conn.recv()
    layout = MaskLayout(rows, words)
    flags, lives, bitss = layout.views(mmap.mmap(fd, layout.nbytes))
    grammars = Grammars(load_tokenizer(model_path), vocab_size, frozenset(stop_ids), cache_bytes)
    matchers: dict[int, object] = {}
    compiled: dict[StructuredOutput, object] = {}  # until the engine says to forget it (grammar_process.py)
    sending = threading.Lock()
    compiles = ThreadPoolExecutor(1, thread_name_prefix="flashpage-compile")
    held = threading.Lock()  # matchers, with the keys the compile thread is making
    making: set[int] = set()
    gone: set[int] = set()  # keys dropped while the compile thread made them: not kept

    def reply(msg: tuple) -> None:
        with sending:
            conn.send(msg)

    def matcher(spec: StructuredOutput) -> tuple[object | None, str | None]:
        try:
            with held:
                grammar = compiled.get(spec)
            if grammar is None:  # new (on the compile thread); or, on a job, forgotten (never: see GrammarProcess)
                grammar = grammars.compile(spec)
                with held:
                    compiled[spec] = grammar
            return grammars.xgr.GrammarMatcher(grammar), None
        except RequestError as e:
            return None, str(e)
        except Exception as e:  # noqa: BLE001 - anything else is the request's error too, and said so
            return None, f"{type(e).__name__}: {e}"

    def make(key: int, spec: StructuredOutput) -> None:
        with held:
            new = spec not in compiled
        if new:  # the engine's deadline for it counts from now (grammar_process.py)
            reply(("compiling", key, time.monotonic()))
            if slow[0] and slow[1] in spec.spec:  # tests only
                time.sleep(slow[0])
        m, error = matcher(spec)
        with held:
            making.discard(key)
            if key in gone:
                gone.discard(key)
            elif m is not None:
                matchers[key] = m
            nbytes = compiled[spec].memory_size_bytes if spec in compiled else 0
        reply(("added", key, (error, nbytes)))

    def drop(key: int) -> None:
        with held:
            if matchers.pop(key, None) is None and key in making:
                gone.add(key)

    get = matchers.get

    def advance(rows: list[int], tokens: list[int], runs: bool) -> frozenset[int]:
        # Skipped: unconstrained rows (-1), matchers dropped since (their sequences ended), and
        # those of a job's adds that could not be made (held as None; reported); after a
        # speculative step, a verification's rows past its accepted run (id -1).
        ms = [get(k) for k in rows]
        if None in ms or runs:
            kept = [(m, t) for m, t in zip(ms, tokens) if m is not None and t >= 0]
            ms, tokens = [m for m, _ in kept], [t for _, t in kept]
        return grammars.accept(ms, tokens, runs) if ms else frozenset()

    filled: list[int] | None = None  # the last fill's rows: whose matchers the next ids advance
    runs = False  # the last fill had verifications: its ids are runs
    fills, fail_at = 0, 0
    slow = (0.0, "")  # tests: seconds the compile of a spec holding the text is made to take longer ("slow")
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the engine closed it, or died: nothing here to keep
            os._exit(0)  # at once: an interpreter's teardown (torch, XGrammar) takes CPU a busy host lacks
        kind = msg[0]
        if kind == "job":
            _, step, adds, drops, tokens, rows, forgets, drafts = msg
            for key, spec_kind, spec in adds:  # compiled before: ~10 us each
                matchers[key], error = matcher(StructuredOutput(spec_kind, spec))
                if error is not None:  # held as None: its row is left alone until the engine drops it
                    reply(("broken", key, error))
            for spec_kind, spec in forgets:  # after the adds: one may be of a spec the engine let go of since
                with held:
                    compiled.pop(StructuredOutput(spec_kind, spec), None)
            for key in drops:
                drop(key)
            taking, taking_runs = filled, runs  # the rows whose ids `tokens` are
            if step is not None:
                filled = filled if rows is None else rows
                runs = bool(drafts)
            try:
                if tokens is not None and taking is None:
                    raise RuntimeError("ids for matchers this process never filled (it started since)")
                ended = advance(taking, tokens, taking_runs) if tokens else frozenset()
                if step is not None:
                    fills += 1
                    if fills == fail_at:
                        raise RuntimeError("injected fill failure")
                    if filled is None:
                        raise RuntimeError("no rows to fill")
                    grammars.fill_bitmask([None if r < 0 else matchers[r] for r in filled], bitss[step % 2],
                                          lives[step % 2], ended, drafts)
            except Exception as e:  # noqa: BLE001 - the step fails, the process goes on
                if step is not None:
                    lives[step % 2][: len(filled or ())] = 0
                    flags[1] = step
                reply(("failed", step, f"{type(e).__name__}: {e}"))
            if step is not None:
                flags[0] = step  # after every write to the masks (one thread, x86's store order)
        elif kind == "add":
            with held:
                making.add(msg[1])
            compiles.submit(make, msg[1], StructuredOutput(msg[2], msg[3]))
        elif kind == "fail_at":
            fail_at = fills + msg[1] if msg[1] else 0
        elif kind == "slow":
            slow = msg[1:]
        elif kind == "count":
            reply(("count", len(matchers), len(compiled)))
        elif kind == "check":
            reply(("checked", msg[1], [grammars.valid_prefix(get(key), p) for key, p in msg[2]]))


def main(argv: list[str]) -> None:
    """The process's entry (`ENTRY`): the socket's fd, the masks' memfd."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the group's Ctrl+C and TERM: the engine closes it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    serve(Connection(int(argv[0])), int(argv[1]))
