"""What changes a row's logits before its token is chosen, on the device, for the whole batch:
`logit_bias`, `min_tokens`, the presence, frequency and repetition penalties, and a grammar's
token bitmask.

Contract. `StepControls.build` reads the step's rows on the host (their parameters and how many
tokens each has sampled so far, in-flight placeholders included, which the host always knows) and
turns them into a few index tensors; `apply` then edits the fp32 logits [rows, vocab] in place:

1. logit_bias: logits[r, id] += bias (values already clamped to +-100 by the front end);
2. penalties, as vLLM defines them, over the counts of the tokens each sequence generated
   (`TokenCounts`, kept on the device) and the set of its prompt's tokens:
   repetition r: a token seen in the prompt or the output has its logit divided by r when positive,
   multiplied by r otherwise; then logit -= frequency * count + presence * (count > 0);
3. the grammar's masks (bit i of word i // 32 set = token i allowed; `GrammarMask`): disallowed
   tokens -> -inf in each constrained row (kernels/grammar_mask.py, queued behind a wait on the device
   for the host to have filled them);
4. min_tokens: logits[r, id] = -inf for every end-of-sequence and stop id while row r has sampled
   fewer than its min_tokens, except in a row this would leave with no token at all (a complete
   grammar allows only its end, and the grammar wins).

No host loop touches the vocabulary; the per-sequence counts never go to the host, so asynchronous
scheduling keeps working (the sampled ids are added on the device after each step). The penalties
are one kernel launch on the GPU (kernels/penalties.py). The PyTorch reference of every formula is
in tests/server/worker/test_logits.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.grammar_mask import apply_grammar
from kernels.penalties import apply_penalties, table_addresses
from kernels.reference import apply_penalties_ref, grammar_mask_ref
from server.sampling_params import SamplingParams


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without blocking the host: through pinned memory and an
    asynchronous copy. `torch.tensor(values, device=cuda)` copies from pageable memory, which waits
    for every kernel queued before it: the host would stall on the step in flight, undoing
    asynchronous scheduling (measured on an H100: penalized greedy decoding at a third of plain)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class TokenCounts:
    """Per-sequence counts of generated tokens [slots, vocab] int32 and prompt-token sets [slots,
    vocab] bool, on the device, for the sequences with penalties. Allocated when the first one
    arrives and doubled as needed (16 slots of a 152k vocabulary: 12 MB)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.penalties = torch.zeros(0, 3, device=device)  # repetition, frequency, presence per slot
        self.slots: dict[str, int] = {}
        self.free: list[int] = []
        # Released slots are reused only after the next step's update: a step launched before a
        # sequence finished may still add its last (discarded) id to the slot.
        self.released: list[int] = []
        self.scratched: list[int] = []  # a verification's per-row slots this step (server/worker/spec/penalties.py)
        self.ones = torch.ones(0, dtype=torch.int32, device=device)  # what add() adds, kept between steps
        # The tables' device addresses, through which the decode graphs' penalized argmax reads them
        # (kernels/argmax.py `penalty`): rewritten when the tables grow, so no graph holds a stale one.
        self.addresses = torch.zeros(3, dtype=torch.int64, device=device)

    def slot(self, request_id: str, prompt_token_ids: list[int], p: SamplingParams) -> int:
        """The sequence's slot; a new one is zeroed, its prompt's tokens and penalties written."""
        s = self.slots.get(request_id)
        if s is not None:
            return s
        if not self.free:
            self._grow()
        s = self.slots[request_id] = self.free.pop()
        self.counts[s].zero_()
        self.in_prompt[s].zero_()
        self.in_prompt[s, to_device(prompt_token_ids, torch.long, self.device)] = True
        self.penalties[s] = to_device([p.repetition_penalty, p.frequency_penalty, p.presence_penalty], torch.float32,
                                      self.device)
        return s

    def scratch(self) -> int:
        """A slot for one step, its contents the caller's (server/worker/spec/penalties.py)."""
        if not self.free:
            self._grow()
        s = self.free.pop()
        self.scratched.append(s)
        return s

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(16, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        penalties = torch.zeros(new, 3, device=self.device)
        counts[:old], in_prompt[:old], penalties[:old] = self.counts, self.in_prompt, self.penalties
        self.counts, self.in_prompt, self.penalties = counts, in_prompt, penalties
        self.addresses.copy_(to_device(table_addresses(counts, in_prompt, penalties), torch.int64, self.device))
        self.free.extend(range(new - 1, old - 1, -1))

    def release(self, request_id: str) -> None:
        s = self.slots.pop(request_id, None)
        if s is not None:
            self.released.append(s)

    def add(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """counts[slots[i], ids[i]] += 1 (the step's sampled ids, still on the device). index_add_ on
        the flat view: atomic adds, where index_put_(accumulate=True) sorts its indices first."""
        flat = torch.add(ids.long(), slots, alpha=self.vocab_size)
        self.counts.view(-1).index_add_(0, flat, self.ones_for(flat.numel()))
        self.updated()

    def ones_for(self, n: int) -> torch.Tensor:
        """n int32 ones on the device (what an index_add_ of counts adds)."""
        if self.ones.numel() < n:
            self.ones = torch.ones(max(64, 2 * n), dtype=torch.int32, device=self.device)
        return self.ones[:n]

    def updated(self) -> None:
        """The step's count update is queued (add, or the greedy path's kernel): slots released
        before it may now be handed out again (stream order puts their zeroing after it)."""
        self.free.extend(self.released)
        self.released.clear()


@dataclass(slots=True)
class StepControls:
    """The step's controls as device index tensors (None where no row asks for one)."""

    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, ids, values
    masked: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, ids set to -inf (min_tokens)
    # the penalized rows and their TokenCounts slots (which hold their penalties): one upload a step
    penalty: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def empty(self) -> bool:
        return self.bias is None and self.masked is None and self.penalty is None

    @staticmethod
    def build(params: list[SamplingParams], sampled: list[int], request_ids: list[str],
              prompts: list[list[int]], stop_ids: frozenset[int], counts: TokenCounts | None,
              device: torch.device, slots: dict[int, int] | None = None) -> StepControls:
        """`sampled[r]`: tokens row r's sequence had sampled before this step; `stop_ids`: the
        model's end-of-sequence ids (min_tokens holds them back with the row's stop_token_ids);
        `slots`: rows whose penalties read another slot than their sequence's (a verification's)."""
        out = StepControls()
        b_rows, b_ids, b_vals, m_rows, m_ids, p_rows, p_slots = [], [], [], [], [], [], []
        for r, p in enumerate(params):
            if p.logit_bias:
                b_rows += [r] * len(p.logit_bias)
                b_ids += p.logit_bias.keys()
                b_vals += p.logit_bias.values()
            if sampled[r] < p.min_tokens:
                held = stop_ids.union(p.stop_token_ids)
                m_rows += [r] * len(held)
                m_ids += held
            if p.penalized and counts is not None:
                p_rows.append(r)
                p_slots.append(slots[r] if slots and r in slots else counts.slot(request_ids[r], prompts[r], p))
        t = lambda xs, dtype=torch.long: to_device(xs, dtype, device)  # noqa: E731
        if b_rows:
            out.bias = (t(b_rows), t(b_ids), t(b_vals, torch.float32))
        if m_rows:
            out.masked = (t(m_rows), t(m_ids))
        if p_rows:
            rows_slots = t([p_rows, p_slots])
            out.penalty = (rows_slots[0], rows_slots[1])
        return out

    def apply(self, logits: torch.Tensor, counts: TokenCounts | None, grammar: GrammarMask | None = None) -> None:
        """Edit logits [rows, vocab] fp32 in place (the order of the module docstring)."""
        if self.bias is not None:
            rows, ids, vals = self.bias
            logits.view(-1).index_add_(0, rows * logits.shape[1] + ids, vals)
        if self.penalty is not None and counts is not None:
            # one launch on the GPU (kernels/penalties.py); its PyTorch reference on the CPU
            penalize = apply_penalties if logits.is_cuda else apply_penalties_ref
            penalize(logits, *self.penalty, counts.counts, counts.in_prompt, counts.penalties)
        if grammar is not None:
            grammar.apply(logits)
        if self.masked is not None:
            rows, ids = self.masked
            kept = logits[rows, ids]
            logits[self.masked] = float("-inf")
            if grammar is not None:  # a complete grammar allows only its end: min_tokens yields to it
                empty = ~torch.isfinite(logits).any(dim=-1)
                logits.index_put_(self.masked, torch.where(empty[rows], kept, logits[rows, ids]))


@dataclass(slots=True)
class GrammarMask:
    """A step's grammar masks (server/worker/grammar_rows.py): bits [rows, words] int32 (XGrammar's
    layout), live [rows] int32 (1: the row is constrained), covered (tokens past the tokenizer's
    vocabulary are never allowed). On a GPU, on the device: the runner queues them behind the
    wait for their fill (server/worker/grammar_rows.py)."""

    bits: torch.Tensor
    live: torch.Tensor
    covered: int

    def apply(self, logits: torch.Tensor) -> None:
        """logits[r, t] = -inf for each live row r and each token t it does not allow."""
        if logits.is_cuda:
            apply_grammar(logits, logits.shape[1], self.bits, self.live, self.covered)
        else:
            logits.copy_(grammar_mask_ref(logits, logits.shape[1], self.bits, self.live, self.covered))
