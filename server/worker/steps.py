"""The records a step travels in between the engine and the runner (server/worker/runner.py): the
handle of a launched step, the plan of how its rows choose their tokens, and what it sampled."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from server.worker.grammar_rows import GrammarFill
from server.worker.inputs import SeqState
from server.worker.logits import StepControls
from server.worker.scoring import PromptScores


@dataclass(slots=True)
class StepHandle:
    """A launched step: which sequences sample, and where their results will land on the host."""

    rows: list[SeqState]
    ids: torch.Tensor | None = None  # [len(rows)] int32, host (pinned on CUDA)
    top: torch.Tensor | None = None  # [len(rows), 1 + 2k] fp32: chosen logprob, top-k ids, top-k logprobs
    k: int = 0
    want: list[int | None] = field(default_factory=list)
    event: torch.cuda.Event | None = None  # recorded after the copies; collect() waits on it
    controls: StepControls | None = None
    scores: list[PromptScores] = field(default_factory=list)  # prompt log-probabilities on their way
    # A step with a grammar-constrained row: the masks the engine fills for it (server/worker/grammar_rows.py),
    # and until `ModelRunner.complete` its raw logits and plan
    grammar: GrammarFill | None = None
    parts: list[torch.Tensor] | None = None
    plan: RowsPlan | None = None
    error: Exception | None = None  # choosing the tokens failed: collect() raises it
    released: list[str] = field(default_factory=list)  # CPU: requests ended while the choice was pending


@dataclass(slots=True)
class RowsPlan:
    """How a step's rows (not all plain) choose their tokens; kept while the rows stay the same."""

    rows: list[SeqState]  # the sequences, in row order
    controls: StepControls | None  # None: no row's logits are edited (e.g. logprobs only)
    structured: bool  # a row is grammar-constrained: the step carries a GrammarFill
    # structured, every row greedy without logprobs, and the grammar the only control: the live rows'
    # allowed argmax is the whole choice (kernels/grammar_mask.py), no sampler
    grammar_greedy: bool
    # Every row greedy without logprobs, and penalties the only control: each row's TokenCounts slot
    # (-1 for a row without penalties), for the decode graph and _penalized_greedy. Else None.
    penalty_slots: list[int] | None
    # penalty_slots on the device, uploaded the first time a step chooses rows after its forward
    # (an eager step, or a prefill chunk beside graphed decodes); kept with the plan
    penalty_slots_dev: torch.Tensor | None = None


@dataclass(slots=True)
class StepResult:
    """What a step sampled, row by row (rows as in StepHandle.rows)."""

    token_ids: list[int]
    # per row, (chosen id, logprob) then the top alternatives, where requests asked for logprobs
    logprobs: list[list[tuple[int, float]]] | None = None
    # (sequence, position p of the first, per prompt token p + 1...: (id, logprob) then alternatives)
    prompt_logprobs: list[tuple[object, int, list[list[tuple[int, float]]]]] = field(default_factory=list)
