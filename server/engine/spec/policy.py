"""When to speculate: the back-off that keeps speculation from costing anything where it does not pay.

Two rules (their defaults are server/config.py's SPEC_* values, with the measurements behind them):

- **Batch size.** No sequence speculates while more than `disable_by_batch_size` run (vLLM's key):
  a large batch's step is compute bound, so verifying k + 1 tokens a row costs up to k + 1 times a
  decode step, more than acceptance gives back; and the step after a speculating one can only be
  scheduled once its ids are on the host (the placeholders of asynchronous scheduling cannot stand
  for a run of unknown length), which a large batch's host work feels most.
- **Acceptance, per sequence.** Each sequence keeps a moving average of the share of its proposals
  accepted (a quarter of the way toward each verification's: slow enough that the misses of a
  well-accepted sequence do not stop it; with every proposal missing, five verifications). Below `min_acceptance` it stops proposing for 1
  step, then 2, 4, ... up to SPEC_MAX_BACKOFF (doubling each time it fails again), then tries once
  more; a verification at or above it resets the back-off. A step in which no sequence proposes
  is scheduled as any other (asynchronously), so text that offers no n-gram, or a draft that keeps
  missing, costs one probe every SPEC_MAX_BACKOFF steps.

Every request may speculate: a penalized one's verification rows read the counts after the proposals
before them (server/worker/spec/penalties.py), a constrained one's proposals are cut where its
grammar rejects one and its rows' masks are filled after the proposals before them
(server/engine/grammar_process.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from server.config import SPEC_MAX_BACKOFF


@dataclass(slots=True)
class SpecState:
    """A speculating sequence's state (Sequence.spec)."""

    acceptance: float = 1.0  # moving average of accepted / proposed
    skip: int = 0  # steps left before it proposes again
    backoff: int = 0  # the length of its last back-off (0: none)
    draft_computed: int = 0  # draft_model, eagle3: leading positions whose K/V the draft holds (spec/draft.py)


def record(st: SpecState, proposed: int, accepted: int, floor: float) -> None:
    """One verification's outcome (a lookup that found nothing counts as none accepted)."""
    st.acceptance = 0.75 * st.acceptance + 0.25 * (accepted / proposed if proposed else 0.0)
    if st.acceptance < floor:
        st.backoff = min(max(1, 2 * st.backoff), SPEC_MAX_BACKOFF)
        st.skip = st.backoff
        st.acceptance = floor  # after the back-off, one verification decides again
    else:
        st.backoff = 0
