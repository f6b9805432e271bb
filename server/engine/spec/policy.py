"""When to speculate: the back-off that keeps speculation from costing anything where it does not pay.

Its defaults are server/config.py's SPEC_* values, with the measurements behind them.

- **Batch size.** No sequence speculates while more than `disable_by_batch_size` run (vLLM's key):
  a large batch's step is compute bound, so verifying k + 1 tokens a row costs up to k + 1 times a
  decode step, more than acceptance gives back; and the step after a speculating one can only be
  scheduled once its ids are on the host (the placeholders of asynchronous scheduling cannot stand
  for a run of unknown length), which a large batch's host work feels most.
- **Acceptance, the estimate.** Each sequence keeps a moving average of the share of its proposals
  accepted (`SpecState.acceptance`, a quarter of the way toward each verification's: slow enough
  that the misses of a well-accepted sequence do not stop it; with every proposal missing, five
  verifications). k proposals at acceptance a are worth k * a tokens a verification (the batch
  rule counts the average's optimistic start as one verification: `estimate`).

Below the batch-size limit, one of two rules (`backoff`, flashpage's key):

- **per_sequence** (n-gram's default). A sequence whose average falls below `min_acceptance` stops
  proposing for 1 step, then 2, 4, ... up to SPEC_MAX_BACKOFF (doubling each time it fails again),
  then tries once more; a verification at or above it resets the back-off. Right where a proposal
  costs only its own row (n-gram: a host lookup, and the verification's k positions).
- **batch** (the draft model's and EAGLE-3's). A round of a draft (k forwards of the draft model,
  or of the head) costs about the same for 1 row as for 8, so a step in which a few of many
  sequences propose pays the whole round for few tokens, which the per-sequence rule, staggering
  its sequences' back-offs, makes common (8 clients at acceptance 0.7 on an H100: 0.73x). Here each
  step decides for the whole batch, from a cost model in units of a plain decode step of one row
  (fitted to the H100 runs: benchmarks/engine/replay_spec_policy.py):
  a plain step of n rows costs `1 + plain_row * (n - 1)`; a round over proposals of P positions adds
  `round_cost + position * P` (the draft's k forwards and the step's synchronous scheduling; the
  verification's extra positions). With the candidates ranked by k_i * a_i, the round takes the
  first r that make the most tokens per unit of time, if that beats plain decoding:
  `(n + sum k_i a_i) / (plain(n) + round(P)) > n / plain(n)`; else no round. A sequence left out
  of rounds for SPEC_MAX_BACKOFF steps joins the next round that runs (its estimate is refreshed at
  the cost of one row). Estimates only change when verified, so while the model says no the batch
  probes: after 1 step without a round, then 2, 4, ... up to SPEC_MAX_BACKOFF, one round over every
  candidate; a round the model chooses resets it.

A step in which no sequence proposes is scheduled as any other (asynchronously), so text that
offers no n-gram, or a draft that keeps missing, costs one probe every SPEC_MAX_BACKOFF steps.

Every request may speculate: a penalized one's verification rows read the counts after the proposals
before them (server/worker/spec/penalties.py), a constrained one's proposals are cut where its
grammar rejects one and its rows' masks are filled after the proposals before them
(server/engine/grammar_process.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from server.config import SPEC_COST_PLAIN_ROW, SPEC_COST_POSITION, SPEC_MAX_BACKOFF


@dataclass(slots=True)
class SpecState:
    """A speculating sequence's state (Sequence.spec)."""

    acceptance: float = 1.0  # moving average of accepted / proposed
    skip: int = 0  # per_sequence: steps left before it proposes again
    backoff: int = 0  # per_sequence: the length of its last back-off (0: none)
    draft_computed: int = 0  # draft_model, eagle3: leading positions whose K/V the draft holds (spec/draft.py)
    idle: int = 0  # batch: steps it could have proposed in, but no round took it
    start_weight: float = 1.0  # the optimistic start's weight in `acceptance` (0.75 ** verifications)


def record(st: SpecState, proposed: int, accepted: int, floor: float) -> None:
    """One verification's outcome (a lookup that found nothing counts as none accepted); a floor of
    0 (the batch rule) only moves the average."""
    st.acceptance = 0.75 * st.acceptance + 0.25 * (accepted / proposed if proposed else 0.0)
    st.start_weight *= 0.75
    st.idle = 0
    if st.acceptance < floor:
        st.backoff = min(max(1, 2 * st.backoff), SPEC_MAX_BACKOFF)
        st.skip = st.backoff
        st.acceptance = floor  # after the back-off, one verification decides again
    else:
        st.backoff = 0


def estimate(st: SpecState) -> float:
    """The batch rule's acceptance estimate: the moving average with its optimistic start (1.0)
    weighing as one verification instead of all the history not yet seen, so that a sequence whose
    proposals all miss is found out after a few verifications, as the per-sequence floor finds it."""
    q = st.start_weight
    return (0.25 * q + st.acceptance - q) / (0.25 * q + 1.0 - q)


@dataclass(frozen=True, slots=True)
class StepCosts:
    """The batch rule's cost model, in plain decode steps of one row (server/config.py's SPEC_COST_*)."""

    round_cost: float  # a round's fixed cost: the draft's k forwards, the step's synchronous scheduling
    position: float  # each proposal verified (and drafted)
    plain_row: float  # each row more in a plain step


def rows_for_round(gains: list[float], positions: list[int], n: int, costs: StepCosts) -> int:
    """How many of the candidates (their expected accepted proposals `gains`, best first, and their
    proposals `positions`) a round over a step of `n` rows should take to make the most tokens per
    unit of time; 0 when no round beats plain decoding."""
    plain = 1.0 + costs.plain_row * (n - 1)
    best, take, gain, pos = n / plain, 0, 0.0, 0
    for r, (g, k) in enumerate(zip(gains, positions), 1):
        gain, pos = gain + g, pos + k
        rate = (n + gain) / (plain + costs.round_cost + costs.position * pos)
        if rate > best:
            best, take = rate, r
    return take


@dataclass(slots=True)
class BatchBackoff:
    """The batch rule's state: its probes' back-off (see the module)."""

    costs: StepCosts
    skip: int = 0  # steps without a round left before the next probe
    backoff: int = 0  # the length of the last back-off (0: the model chose the last round)

    def choose(self, cands: list[tuple[SpecState, int]], n: int, commit: bool = True) -> list[int]:
        """Which candidates (state, proposals), indices into `cands`, this step's round takes ([]:
        no round), in a step of `n` decoding rows. `commit` False asks without counting the step
        (the engine asks before scheduling whether a round is coming: Speculator.wants)."""
        gains = [estimate(st) * k for st, k in cands]
        order = sorted(range(len(cands)), key=lambda i: -gains[i])
        r = rows_for_round([gains[i] for i in order], [cands[i][1] for i in order], n, self.costs)
        if r:
            if commit:
                self.skip = self.backoff = 0
            taken = order[:r] + [i for i in order[r:] if cands[i][0].idle >= SPEC_MAX_BACKOFF]
        elif self.skip or not self.backoff or not cands:
            # backing off (the first step the model says no starts it; a step whose rows all wait for
            # the one in flight, scheduled because no round was coming, counts as one)
            if commit:
                self.skip, self.backoff = max(self.skip - 1, 0), max(self.backoff, 1)
            return []
        else:  # a probe: every candidate's estimate refreshed, then a longer back-off
            if commit:
                self.backoff = min(2 * self.backoff, SPEC_MAX_BACKOFF)
                self.skip = self.backoff
            taken = order
        return sorted(taken)


def batch_rule(round_cost: float) -> BatchBackoff:
    """The batch rule for a method whose round costs `round_cost` (its other costs: server/config.py)."""
    return BatchBackoff(StepCosts(round_cost, SPEC_COST_POSITION, SPEC_COST_PLAIN_ROW))
