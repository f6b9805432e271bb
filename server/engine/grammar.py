"""Structured output with XGrammar: a request's grammar compiled once per distinct spec, a matcher
per sequence, and the token bitmask of each step.

- `Grammars.compile` turns a `StructuredOutput` (sampling_params.py) into XGrammar's compiled grammar.
  XGrammar's compiler caches by spec, so a schema many requests share compiles once per process.
  An invalid spec is a `RequestError` whose message is XGrammar's, without its source location.
  The API process compiles each request's spec before queueing it (off the event loop), so an invalid
  one is a 400 that never reaches the engine; the engine process compiles it again (a cache hit after
  the first request of that spec) when the request is added.
- JSON schemas and JSON-object mode compile without XGrammar's "any whitespace" (one space after
  `:` and `,`, no newlines): small models otherwise emit whitespace until max_tokens. A schema whose
  strings have a `maxLength` compiles from XGrammar's own EBNF for it with those strings rewritten
  (server/engine/grammar_rewrite.py): the same language, masks an order of magnitude cheaper to fill.
- Each step, one job in the grammar process (server/engine/grammar_process.py, which holds the
  matchers) advances the matchers by the previous step's tokens (`accept`), then fills the masks
  of the step the device is running (`fill_bitmask`) into memory it shares with the engine, and
  raises the step's flag (server/worker/grammar_rows.py); the device waits for the flag, then
  masks the logits and chooses (kernels/grammar_mask.py).
- The fill runs on one thread (`FILL_THREADS`): XGrammar's pool made it slower, not faster
  (64 rows of the benchmark schema, GPT-2 small at batch 64 on an H100: 0.81x unconstrained
  throughput on one thread, 0.77x, 0.73x and 0.60x on 2, 4 and 8).
- The grammar ends the output: it allows an end token (the model's EOS ids) only where it may
  end, so a constrained sequence stops (finish_reason "stop") on the EOS it samples, `ignore_eos`
  or not.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import TYPE_CHECKING

import numpy as np

from server.engine.grammar_rewrite import json_string_characters, unroll_bounded_strings
from server.engine.grammar_tags import expand_structural_tag
from server.engine.requests import RequestError
from server.sampling_params import StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr

FILL_THREADS = 1  # see the module docstring
HEAD_WORDS = 8  # the words of a mask row checked first for a dead end (see _end_dead_ends)
_SOURCE = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[19:35:30] /project/cpp/regex_converter.cc:83: "


def choice_grammar(choices: list[str]) -> str:
    """EBNF matching exactly one of `choices` (JSON string escapes are the EBNF parser's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Grammars:
    """Compiles specs for one tokenizer (its vocabulary padded to the model's logits width) and
    makes matchers that stop on the model's end-of-sequence ids."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int], cache_bytes: int = -1) -> None:
        """`cache_bytes`: XGrammar's cache of compiled grammars holds at most this many bytes, least
        recently used going first (-1: no bound; issue 44: ~20 distinct specs took a process from 503
        to 1,348 MB)."""
        import xgrammar as xgr  # here, not at the top: 0.7 s of imports a server without grammars skips

        self.xgr = xgr
        # The tokenizer's ids only: rows of the model's logits past them (padding, e.g. GPT-2's
        # 50257 over a smaller tokenizer) can never be text; the worker masks them outright. Handing
        # XGrammar the padded width made each fill ~3.5x dearer (measured: 73 us against 20 us).
        self.vocab_size = min(vocab_size, len(tokenizer))
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids))
        threads = min(8, os.cpu_count() or 1)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_limit_bytes=cache_bytes)
        self.batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
        self.accept_batch = _raw_batch_accept(xgr)
        self.stop_token_ids = stop_token_ids
        self.end = min(stop_token_ids) if stop_token_ids else None  # what a dead-end grammar may do

    def compile(self, s: StructuredOutput) -> xgr.CompiledGrammar:
        """Raise RequestError naming what is wrong with the spec."""
        c = self.compiler
        try:
            if s.kind == "json":
                text = _json_schema_rewritten(s.spec)
                return c.compile_json_schema(s.spec, any_whitespace=False) if text is None else c.compile_grammar(text)
            if s.kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if s.kind == "regex":
                return c.compile_regex(s.spec)
            if s.kind == "choice":
                return c.compile_grammar(choice_grammar(json.loads(s.spec)))
            if s.kind == "grammar":
                return c.compile_grammar(s.spec)
            if s.kind == "structural_tag":  # tool calls (server/api/tools/), their schemas as compact JSON
                return c.compile_structural_tag(expand_structural_tag(s.spec, json_schema_ebnf))
        except (RuntimeError, ValueError, TypeError) as e:
            message = _SOURCE.sub("", str(e).strip()).strip()
            raise RequestError(f"invalid {_NAMES[s.kind]}: {message}") from None
        raise RequestError(f"unknown kind of structured output {s.kind!r}")

    def matcher(self, s: StructuredOutput) -> xgr.GrammarMatcher:
        return self.xgr.GrammarMatcher(self.compile(s))

    def fill_bitmask(self, matchers: list, bits: np.ndarray, live: np.ndarray,
                     ended: frozenset[int] = frozenset(), drafts: list | None = None) -> list[int]:
        """Fill a step's masks: the rows j whose matchers[j] is live (not None, and not in `ended`:
        the ids of matchers that just took an end token) get what they allow next in bits[j] and
        live[j] = 1; every other row live[j] = 0 (left alone). Returns the live rows. `drafts`: a
        speculative step's verifications (server/engine/spec/), (row, proposals) each: the row is
        filled as any row, row + i with what its matcher allows after proposals 1..i. Rows past a
        proposal it rejects, or past its end, stay live 0: the choice before them, masked, cannot
        be that proposal, so no accepted run reaches them."""
        if drafts:
            matchers = list(matchers)
            for row, proposals in drafts:  # the rows after the first: filled after the proposals
                matchers[row + 1 : row + 1 + len(proposals)] = [None] * len(proposals)
        rows = [j for j, m in enumerate(matchers) if m is not None and id(m) not in ended]
        live[: len(matchers)] = 0
        if not rows:
            return rows
        if len(rows) == 1:
            matchers[rows[0]].fill_next_token_bitmask(bits, rows[0])
        else:
            self.batch.batch_fill_next_token_bitmask([matchers[j] for j in rows], bits, rows)
        live[rows] = 1
        for row, proposals in drafts or ():
            if matchers[row] is not None and live[row]:
                self.valid_prefix(matchers[row], proposals, (bits, live, row))
        if self.end is not None:
            self._end_dead_ends(bits, live, len(matchers))
        return rows

    @staticmethod
    def valid_prefix(matcher, proposals: list[int], fill: tuple | None = None) -> int:
        """How many leading proposals the matcher accepts (until one it rejects, or its end); it
        takes them (`accept_token`) and gives them back (`rollback`): it advances over an accepted
        run only, with the step's ids. `fill` (bits, live, row): row + i gets the mask after the
        i-th (live 1), unless the matcher ended there."""
        if matcher is None:
            return 0
        taken = 0
        for t in proposals:
            if matcher.is_terminated() or not matcher.accept_token(t):
                break
            taken += 1
            if fill is not None and not matcher.is_terminated():
                bits, live, row = fill
                matcher.fill_next_token_bitmask(bits, row + taken)
                live[row + taken] = 1
        if taken:
            matcher.rollback(taken)
        return taken

    def _end_dead_ends(self, bits: np.ndarray, live: np.ndarray, n: int) -> None:
        """A grammar that allows nothing (e.g. {"anyOf": []}, or `root ::= root`) may still compile;
        its row would pick an arbitrary token forever. Let it end instead. This runs on the path to
        the step's flag with the GIL held, so it looks at the first words of each row first (a
        byte-level vocabulary's single bytes: nearly every state allows one) and reads whole rows
        only for the few that allowed none of those."""
        full, rest = divmod(self.vocab_size, 32)  # bits past the vocabulary in a last word are not tokens
        shut = np.flatnonzero((live[:n] != 0) & ~bits[:n, : min(HEAD_WORDS, full)].any(axis=1))
        if not shut.size:
            return
        for j in shut.tolist():
            row = bits[j]
            if row[:full].any() or (rest and row[full] & _word((1 << rest) - 1)):
                continue
            row[:] = 0
            row[self.end // 32] = _word(1 << (self.end % 32))

    def accept(self, matchers: list, tokens: list[int], runs: bool = False) -> frozenset[int]:
        """Advance each matcher by its sequence's sampled token (the masks allowed only what it
        accepts), in one call into XGrammar when there are several. Returns the ids of the matchers
        that took an end token: they have terminated, and the engine finishes their sequences.
        (The engine never hands a terminated matcher back, so nothing here asks XGrammar whether
        one is: 64 calls into XGrammar a step saved.) `runs`: a speculative step's ids, where a
        matcher comes once per token of its sequence's accepted run, in order (none past its end)."""
        if len(matchers) == 1:
            matchers[0].accept_token(tokens[0])
        elif runs:  # a speculative step's: a verification's run is one matcher's, in order
            for m, t in zip(matchers, tokens):
                if not m.is_terminated():
                    m.accept_token(t)
        elif matchers:
            self.accept_batch(matchers, tokens)
        stop = self.stop_token_ids
        return frozenset(id(m) for m, t in zip(matchers, tokens) if t in stop)


def _raw_batch_accept(xgr):
    """XGrammar's batch accept without its result. The public `batch_accept_token` turns the
    binding's result into a list of bools, one call into the FFI per row with the GIL held: ~80 us
    a step at 64 rows (this project's CPU), in the grammar job whose time bounds constrained
    decoding (GPT-2 small on an H100, batch 64: 0.87x unconstrained through the binding, 0.73x
    through the wrapper, alternating in one process). The engine ignores the result (the masks
    allowed only what each matcher accepts), so it calls the binding where it has the form this
    was written against (xgrammar 0.2.8), and the public method otherwise."""
    core = getattr(getattr(getattr(xgr, "base", None), "_core", None), "BatchGrammarMatcher", None)
    raw = getattr(core, "batch_accept_token", None)
    if raw is None:
        return xgr.BatchGrammarMatcher.batch_accept_token

    def accept(matchers: list, tokens: list[int]) -> None:
        raw([m._handle for m in matchers], tokens, False)

    return accept


@functools.lru_cache(maxsize=64)  # the conversion is ~0.5 ms, and most requests reuse a few schemas
def _json_schema_rewritten(spec: str) -> str | None:
    """XGrammar's EBNF for a JSON schema with its bounded strings unrolled and kept free of control
    characters (grammar_rewrite.py), or None when nothing changed (then the schema compiles
    directly, as XGrammar's cache expects)."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(spec, any_whitespace=False))
    rewritten = json_string_characters(unroll_bounded_strings(text))
    return None if rewritten == text else rewritten


def spec_name(kind: str) -> str:
    """What a kind of structured-output spec is called in messages."""
    return _NAMES.get(kind, f"{kind} spec")


def json_schema_ebnf(spec: str) -> str:
    """The EBNF a JSON schema (as JSON text) compiles from here: compact, bounded strings unrolled."""
    import xgrammar as xgr

    return _json_schema_rewritten(spec) or str(xgr.Grammar.from_json_schema(spec, any_whitespace=False))


def _word(bits: int) -> int:
    """An unsigned 32-bit pattern as the int32 it is stored as."""
    return bits - (1 << 32) if bits >= 1 << 31 else bits


_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regular expression",
          "choice": "choice", "grammar": "EBNF grammar", "structural_tag": "tool-call grammar"}
