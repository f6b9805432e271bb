"""The logits controls (server/worker/logits.py) against a PyTorch reference of each formula,
written row by row and token by token from the definitions (OpenAI's and vLLM's)."""

import math

import pytest
import torch

from server.sampling_params import SamplingParams
from server.worker.logits import GrammarMask, StepControls, TokenCounts

V = 50
CPU = torch.device("cpu")


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [rows, words] int32 (XGrammar's layout) -> allowed [rows, vocab_size] bool, bit by
    bit; tokens past the bitmask's 32 * words are not allowed."""
    out = torch.zeros(bitmask.shape[0], vocab_size, dtype=torch.bool)
    for r in range(bitmask.shape[0]):
        for t in range(min(vocab_size, 32 * bitmask.shape[1])):
            out[r, t] = bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1)
    return out


def reference(logits, params, generated, prompts, sampled, stop_ids, allowed=None):
    """The definitions, one row and one token at a time."""
    out = logits.clone()
    for r, p in enumerate(params):
        for tid, b in p.logit_bias.items():
            out[r, tid] += b
        for tid in range(V):
            count = generated[r].count(tid)
            if p.repetition_penalty != 1.0 and (count or tid in prompts[r]):
                x = out[r, tid].item()
                out[r, tid] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            out[r, tid] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
        if allowed is not None:
            out[r, ~allowed[r]] = -math.inf
        if sampled[r] < p.min_tokens:
            held = stop_ids | set(p.stop_token_ids)
            trial = out[r].clone()
            trial[list(held)] = -math.inf
            if allowed is None or torch.isfinite(trial).any():
                out[r] = trial
    return out


def run(params, generated, prompts, stop_ids=frozenset({0}), bitmask=None, seed=0):
    """Feed each row's generated tokens through TokenCounts as steps would, then apply the controls."""
    torch.manual_seed(seed)
    logits = torch.randn(len(params), V) * 3
    counts = TokenCounts(V, CPU)
    ids = [f"r{i}" for i in range(len(params))]
    for step in range(max(map(len, generated), default=0)):
        rows = [r for r in range(len(params)) if step < len(generated[r]) and params[r].penalized]
        if rows:
            slots = torch.tensor([counts.slot(ids[r], prompts[r], params[r]) for r in rows])
            counts.add(slots, torch.tensor([generated[r][step] for r in rows]))
    sampled = [len(g) for g in generated]
    c = StepControls.build(params, sampled, ids, prompts, stop_ids, counts, CPU)
    got = logits.clone()
    live = torch.ones(len(params), dtype=torch.int32)
    c.apply(got, counts, None if bitmask is None else GrammarMask(bitmask, live, 32 * bitmask.shape[1]))
    allowed = None if bitmask is None else allowed_tokens(bitmask, V)
    return got, reference(logits, params, generated, prompts, sampled, stop_ids, allowed)


@pytest.mark.parametrize("p", [
    SamplingParams(presence_penalty=0.7),
    SamplingParams(frequency_penalty=0.4),
    SamplingParams(frequency_penalty=-0.5, presence_penalty=-1.0),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8),
    SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2),
    SamplingParams(logit_bias={3: 100.0, 7: -100.0, 11: 2.5}),
    SamplingParams(min_tokens=4, stop_token_ids=[5, 9]),
    SamplingParams(min_tokens=2),  # already past it: nothing held back
])
def test_each_control_matches_its_definition(p):
    generated = [[4, 4, 8, 2, 4]]
    got, want = run([p], generated, [[1, 2, 3, 30]])
    torch.testing.assert_close(got, want)


def test_a_batch_of_mixed_rows_matches_row_by_row():
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.5, frequency_penalty=0.2),
              SamplingParams(min_tokens=10, logit_bias={1: 5.0}), SamplingParams(presence_penalty=1.0),
              SamplingParams(frequency_penalty=1.0, min_tokens=1)]
    generated = [[1, 2], [3, 3, 3], [], [7, 8, 7, 9], [0]]
    prompts = [[1], [2, 5], [6], [7, 40], [49]]
    got, want = run(params, generated, prompts, stop_ids=frozenset({0, 49}))
    torch.testing.assert_close(got, want)


def test_counts_slots_are_reused_only_after_the_next_update():
    counts = TokenCounts(V, CPU)
    p = SamplingParams(presence_penalty=1.0)
    a = counts.slot("a", [1], p)
    counts.add(torch.tensor([a]), torch.tensor([3]))
    counts.release("a")
    b = counts.slot("b", [2], p)  # "a"'s slot is held back: a launched step may still add to it
    assert b != a
    counts.add(torch.tensor([a, b]), torch.tensor([4, 5]))  # the stale add lands in a's old slot
    c = counts.slot("c", [9], SamplingParams(frequency_penalty=0.5))
    assert c == a and counts.counts[c].sum() == 0 and counts.in_prompt[c].nonzero().flatten().tolist() == [9]
    assert counts.counts[b, 5] == 1 and counts.in_prompt[b, 2]
    assert counts.penalties[c].tolist() == [1.0, 0.5, 0.0] and counts.penalties[b].tolist() == [1.0, 0.0, 1.0]


def test_counts_grow_past_their_first_capacity():
    counts = TokenCounts(V, CPU)
    slots = [counts.slot(f"s{i}", [i % V], SamplingParams(presence_penalty=i / 40)) for i in range(40)]
    assert len(set(slots)) == 40 and counts.counts.shape[0] >= 40
    counts.add(torch.tensor(slots), torch.tensor([7] * 40))
    assert counts.counts[:, 7].sum() == 40 and counts.penalties[slots[-1], 2] == 39 / 40


def test_the_grammar_masks_what_its_bits_rule_out_in_its_live_rows_only():
    """Bits as XGrammar packs them; rows 0 and 2 live (row 1's bits are not read), and the logits
    wider than the tokenizer's vocabulary (32 of V = 50): those columns never allowed."""
    torch.manual_seed(1)
    bits = torch.randint(-2**31, 2**31 - 1, (3, 1), dtype=torch.int32)  # 32 ids covered of V = 50
    bits[1] = 0  # would rule out every token of row 1, were it read
    logits = torch.randn(3, V)
    got = logits.clone()
    GrammarMask(bits, torch.tensor([1, 0, 1], dtype=torch.int32), covered=32).apply(got)
    assert torch.equal(got[1], logits[1])
    allowed = allowed_tokens(bits, V)
    for r in (0, 2):
        assert torch.equal(got[r], logits[r].masked_fill(~allowed[r], float("-inf")))
    assert torch.isinf(got[[0, 2], 32:]).all()


def test_min_tokens_yields_to_a_grammar_that_allows_only_its_end():
    bitmask = torch.zeros(2, (V + 31) // 32, dtype=torch.int32)
    bitmask[:, 0] = 1  # token 0 (the EOS) only
    bitmask[1, 0] |= 1 << 6  # row 1: token 6 too
    params = [SamplingParams(min_tokens=5), SamplingParams(min_tokens=5)]
    got, want = run(params, [[], []], [[1], [1]], stop_ids=frozenset({0}), bitmask=bitmask)
    assert torch.isinf(got[:, 32:]).all()  # past the bits
    torch.testing.assert_close(got, want)
    assert torch.isfinite(got[0, 0]) and torch.isinf(got[0, 1:]).all()  # the grammar's end survives
    assert torch.isinf(got[1, 0]) and torch.isfinite(got[1, 6])  # min_tokens holds EOS back where it can
