"""Structured requests on their way into the scheduler's queue (issue 44).

A request with a grammar needs its matcher in the grammar process (server/engine/grammar_process.py)
before its first step. One whose spec that process has compiled before is queued at once; any other
is held here, out of the queue, until its matcher is made, so that a compile of seconds holds up no
request behind it. A spec that no front end checked (an offline caller's) is checked first, bounded,
in a sacrificial process (server/engine/grammar_compile.py's SpecCompiler): the grammar process only
ever compiles specs that compiled there within the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from server.config import StructuredLimits
from server.engine.grammar_compile import CompileSetup, SpecCompiler
from server.engine.grammar_process import GrammarProcess
from server.engine.sequence import Sequence

COMPILE_WAIT_S = 0.05  # how long an idle step waits for the matchers of new constrained requests


@dataclass(slots=True)
class GrammarAdmission:
    setup: CompileSetup  # what a SpecCompiler's workers start with
    limits: StructuredLimits
    held: list[Sequence] = field(default_factory=list)  # requests whose matcher is in the making
    keys: int = 0  # each constrained sequence's matcher is a key in the grammar process
    compiler: SpecCompiler | None = None  # started by the first spec no front end checked

    def admit(self, seq: Sequence, grammars: Callable[[], GrammarProcess], checked: bool) -> bool:
        """Ask the grammar process (`grammars()`: the live one, started or restarted) for `seq`'s
        matcher: True if it is made already (queue `seq` now), False if `seq` is held until `made`
        hands it back. `checked`: a front end checked the spec; otherwise RequestError if it is over
        a bound or invalid (the verdict is remembered; a spec the grammar process compiled is valid:
        not checked again, ~10 us a request)."""
        spec = seq.params.structured
        if not checked and spec not in grammars().ready:
            if self.compiler is None:
                self.compiler = SpecCompiler(self.setup, self.limits)
            self.compiler.check(spec)  # (seconds, at worst: asked for again after it)
        self.keys += 1
        seq.compiling = grammars().add(self.keys, spec)
        if seq.compiling is None:
            seq.grammar = self.keys
            return True
        self.held.append(seq)
        return False

    def made(self, grammars: GrammarProcess, wait: bool) -> list[tuple[Sequence, Exception | None]]:
        """The held requests whose matcher is made (None, `seq.grammar` set) or failed (the error),
        off the list; those that finished meanwhile are dropped. `wait`: nothing runs, so wait a
        little (COMPILE_WAIT_S) for every matcher asked for, rather than admit them a few at a time."""
        if wait:
            deadline = time.monotonic() + COMPILE_WAIT_S
            while time.monotonic() < deadline and not all(s.is_finished or s.compiling.done() for s in self.held):
                grammars.drain(0.002)
        out, still = [], []
        for seq in self.held:
            if seq.is_finished or not seq.compiling.done():
                still += [] if seq.is_finished else [seq]
                continue
            future, seq.compiling = seq.compiling, None
            try:
                seq.grammar = future.result()
                out.append((seq, None))
            except Exception as e:
                out.append((seq, e))
        self.held = still
        return out

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
            self.compiler = None
