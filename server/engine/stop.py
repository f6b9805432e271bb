"""The stop rule: every reason a request ends, and the one function that decides it per token.

A sequence stops on any of the model's end-of-sequence tokens (unless `ignore_eos`) or one of its `stop_token_ids`
(STOP; not before `min_tokens` tokens, and the sampler masks them until then), when its grammar is
complete (STOP; server/engine/grammar.py), at `max_tokens` or the context limit (LENGTH), or when its text contains a stop string
(STOP; the text is cut where the string starts). It is cut off when its deadline passes (TIMEOUT:
`--request-timeout`, checked by the engine at every step, queued or running), when its client left
or the server shuts down (ABORT), or when the step running it failed (ERROR). It is refused after it
was queued, before any token, when its structured-output spec ran past the compile deadline in the
grammar process (REFUSED: the client gets a 400 saying so, as from the API process's own compile;
server/engine/grammar_process.py). While a stop string could still complete, the tail that might start
one is held back from the client, so streamed text never holds what the final text cuts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from server.engine.outputs import RequestOutput, packed_prompt_logprobs
from server.sampling_params import SamplingParams

if TYPE_CHECKING:
    from server.engine.detokenize import Detokenizer
    from server.engine.sequence import Sequence

STOP = "stop"
LENGTH = "length"
TIMEOUT = "timeout"
ABORT = "abort"
ERROR = "error"
REFUSED = "refused"


def token_stop(tok: int, num_output: int, num_tokens: int, params: SamplingParams, eos_token_ids: frozenset[int],
               max_model_len: int) -> str | None:
    """STOP or LENGTH once this newest token ends the sequence, else None. `eos_token_ids`: every
    end-of-sequence id of the model (Llama 3 has several)."""
    if num_output > params.min_tokens and ((not params.ignore_eos and tok in eos_token_ids)
                                           or tok in params.stop_token_ids):
        return STOP
    if num_output >= params.max_tokens or num_tokens >= max_model_len:
        return LENGTH
    return None


def find_stop(text: str, new_len: int, stops: list[str]) -> int | None:
    """Index where the earliest stop string starts, searching only where the newest piece (its last
    `new_len` characters) could have completed one; None if there is none."""
    best = None
    for s in stops:
        start = max(0, len(text) - new_len - len(s) + 1)
        i = text.find(s, start)
        if i != -1 and (best is None or i < best):
            best = i
    return best


def held_back(params: SamplingParams, finished: bool) -> int:
    """Characters at the end of the text that may not be sent yet: they could start a stop string."""
    return 0 if finished or not params.stop else max(map(len, params.stop)) - 1


def advance(seq: Sequence, tok: int, logprob, eos_token_ids: frozenset[int], max_model_len: int,
            detokenizer: Detokenizer) -> RequestOutput:
    """The stop rule applied to a sequence's newest (resolved) token: its text, the reason it ends if
    it does (the engine retires it then), and the output the client gets for this step."""
    p = seq.params
    # Resolved tokens only: with asynchronous scheduling token_ids already holds the next step's
    # placeholder, which would end a sequence at the context limit one token early.
    num_output = len(seq.output_token_ids)
    reason = token_stop(tok, num_output, len(seq.prompt_token_ids) + num_output, p, eos_token_ids,
                        max_model_len)
    if seq.grammar is not None and reason is None and tok in eos_token_ids:
        reason = STOP  # the grammar allowed its end (its matcher, in the grammar process, took it)
    decoded = detokenizer.step(seq, final=reason is not None)
    if p.stop and decoded and num_output >= p.min_tokens:
        cut = find_stop(seq.text, len(decoded), p.stop)
        if cut is not None:
            seq.text = seq.text[:cut]
            reason = STOP
    end = max(seq.emitted, len(seq.text) - held_back(p, reason is not None))
    new_text, seq.emitted = seq.text[seq.emitted : end], end
    return RequestOutput(seq.request_id, new_text, [tok], reason is not None, reason,
                         prompt_tokens=len(seq.prompt_token_ids), completion_tokens=len(seq.output_token_ids),
                         new_logprobs=[logprob] if logprob is not None else [], text=seq.text,
                         token_ids=seq.output_token_ids, cached_prompt_tokens=seq.num_cached_prompt,
                         prompt_logprobs=None if num_output != 1 or p.prompt_logprobs is None
                         else packed_prompt_logprobs(seq))

