"""The n-gram method (vLLM's `ngram`, "prompt lookup decoding"): the proposals are the tokens that
followed an earlier occurrence of the sequence's own last n tokens, in its prompt or its output. No
second model, nothing on the device: a lookup on the host per sequence and step.

vLLM's rule: the longest n in [prompt_lookup_min, prompt_lookup_max] whose last-n-token suffix
occurs earlier in the sequence (occurrences may overlap the suffix, not be it), its earliest
occurrence, and up to k of the tokens that followed it (fewer where the sequence ends first)."""

from __future__ import annotations

import numpy as np


def ngram_propose(tokens: list[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k proposals for the token after `tokens` (vLLM's rule above); [] when no n-gram of
    min_n..max_n tokens recurs. Costs one pass over the tokens for the last token's earlier
    occurrences, then a few comparisons per candidate."""
    t = np.asarray(tokens)
    total = len(t)
    if total < min_n or k <= 0:
        return []
    ends = np.flatnonzero(t[: total - 1] == t[-1])  # where an earlier occurrence of the suffix could end
    if not len(ends):
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        cand = ends[ends >= n - 1]
        if n > 1 and len(cand):
            # each candidate's preceding n - 1 tokens against the suffix's
            cand = cand[(t[cand[:, None] + np.arange(1 - n, 0)] == t[total - n : total - 1]).all(axis=1)]
        if len(cand):
            start = int(cand[0]) + 1  # the earliest occurrence: the token after it
            return t[start : start + k].tolist()
    return []


class NgramProposer:
    """Proposals from each sequence's own tokens (ngram_propose)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, items: list) -> list[list[int] | None]:
        """`items`: (sequence, position of its last token, most proposals) per sequence."""
        return [ngram_propose(seq.token_ids, self.min_n, self.max_n, k) for seq, _, k in items]

    def accepted(self, seq, start: int, proposed: int, accepted: int) -> None:
        pass  # nothing to keep between steps

    def reset(self, seq) -> None:
        pass
