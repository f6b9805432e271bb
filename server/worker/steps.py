"""The records a step travels in between the engine and the runner (server/worker/runner.py): the
handle of a launched step, the plan of how its rows choose their tokens, and what it sampled."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from server.worker.grammar_rows import GrammarFill
from server.worker.inputs import SeqState
from server.worker.logits import StepControls
from server.worker.scoring import PromptScores, ScoredPrompt


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
    positions: list[int] = field(default_factory=list)  # each row's last input position (a step with a plan)
    graph_size: int = 0  # a constrained step of decodes only: its decode graph's size (ChoiceGraphs)


@dataclass(slots=True)
class RowsPlan:
    """How a step's rows (not all plain) choose their tokens; kept while the rows stay the same."""

    rows: list[SeqState]  # the sequences, in row order
    controls: StepControls | None  # None: no row's logits are edited (e.g. logprobs only)
    structured: bool  # a row is grammar-constrained: the step carries a GrammarFill
    # Every row's choice is the argmax kernel's own (no logprobs, no top-k or top-p, and penalties or
    # a grammar the only controls): what the decode graph (not for a constrained step: its masks
    # come after the forward) and server/worker/choice.py choose with. Else None.
    choice: ArgmaxChoice | None


@dataclass(slots=True)
class ArgmaxChoice:
    """Per row of a step, what kernels/argmax.py chooses its token with: its TokenCounts slot (-1:
    no penalties), 1/temperature (0: greedy) and noise key (kernels/sampling_noise.py)."""

    penalty_slots: list[int]
    inv_temperature: list[float]
    keys: list[int]
    # on the device, uploaded the first time a step chooses rows after its forward (an eager step,
    # or a prefill chunk beside graphed decodes); kept with the plan
    device: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def sampled(self) -> bool:
        return any(self.inv_temperature)


@dataclass(slots=True)
class StepResult:
    """What a step sampled, row by row (rows as in StepHandle.rows)."""

    token_ids: list[int]
    # per row, (chosen id, logprob) then the top alternatives, where requests asked for logprobs
    logprobs: list[list[tuple[int, float]]] | None = None
    # what prefill chunks scored of their prompts (per sequence, arrays: server/worker/scoring.py)
    prompt_logprobs: list[ScoredPrompt] = field(default_factory=list)
