"""The draft_model and eagle3 methods' host side: what the draft (server/worker/spec/draft.py) or the
EAGLE-3 head (server/worker/spec/eagle.py) has computed of each sequence, and which of its
positions a round feeds it.

A sequence's `SpecState.draft_computed` counts the leading positions whose K/V the draft holds. It is 0
for a new sequence, even one whose prompt hit the prefix cache (the draft's K/V of a shared block
is recomputed, not trusted: the sequence that published it may never have run the draft) and after
a preemption; a round catches the draft up to the sequence's last position, then proposes; after the
verification only the positions whose inputs were accepted stay valid.

A draft model's position p reads token p, so its last position is the sequence's last token's. An
EAGLE-3 head's position p reads the target's state at p with token p + 1 (`lag` 1): its last is the
one before, the target's states reach no further, and only the position before the verified chunk
stays valid after it (the head's later positions were fed its own states, not the target's; they
are recomputed from the target's, as vLLM does)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CatchUp:
    """Tokens [start, start + num_tokens) of a sequence for the draft (a ScheduledChunk)."""

    seq: object
    start: int
    num_tokens: int
    samples: bool  # reaches the sequence's last token: it proposes this round
    draft: tuple = ()


class DraftProposer:
    def __init__(self, runner, k: int, max_tokens: int, lag: int = 0) -> None:
        self.runner, self.k, self.max_tokens, self.lag = runner, k, max_tokens, lag

    def propose(self, items: list) -> list[list[int] | None]:
        """(sequence, position of its last token, most proposals) per sequence -> up to that many
        proposals each, or None for one whose catch-up did not fit this round's token budget (it
        continues next round)."""
        order = sorted(range(len(items)), key=lambda i: -items[i][2])  # most proposals first: the
        # draft's decode steps then run on a shrinking prefix of its rows (server/worker/spec/draft.py)
        budget, chunks, ks, rows = self.max_tokens, [], [], []
        for i in order:
            seq, last, k = items[i]
            st = seq.spec
            end = last + 1 - self.lag  # the positions it reads: up to its last token's (draft), the one before (EAGLE)
            n = min(end - st.draft_computed, budget)
            if n <= 0:
                continue
            done = st.draft_computed + n == end
            chunks.append(CatchUp(seq, st.draft_computed, n, done))
            st.draft_computed += n
            budget -= n
            if done:
                ks.append(k)
                rows.append(i)
        # (chunks that do not reach their sequence's end only advance the draft: no rows)
        proposed = self.runner.propose(sorted(chunks, key=lambda c: not c.samples), ks) if chunks else []
        out: list[list[int] | None] = [None] * len(items)
        for i, d in zip(rows, proposed):
            out[i] = d
        return out

    def accepted(self, seq, start: int, proposed: int, accepted: int) -> None:
        """The draft wrote K/V for positions start .. start + proposed - 1 (its input there: the
        last token, then its proposals); those up to the last accepted proposal stand. An EAGLE-3
        head's stand up to start - 1 (its positions from start on read its own states)."""
        seq.spec.draft_computed = start if self.lag else start + 1 + min(accepted, proposed - 1)

    def reset(self, seq) -> None:
        seq.spec.draft_computed = 0
