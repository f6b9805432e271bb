"""apply_penalties against apply_penalties_ref (TRITON_INTERPRET=1 on CPU; see tests/conftest.py): odd
vocabularies, one row or many in any order beside rows it must not touch, a padded row stride whose
padding it must not touch, masked (-inf) logits, and no penalized row at all. (The greedy path's
penalties, inside the argmax, are tested in test_argmax.py.)"""

from __future__ import annotations

import pytest
import torch

from kernels.penalties import apply_penalties
from kernels.reference import apply_penalties_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(g: torch.Generator, num_rows: int, vocab: int, num_slots: int, pad: int = 0):
    """Logits [num_rows, vocab] (a view of a [num_rows, vocab + pad] buffer whose padding is NaN) and
    the per-slot tables, with counts mostly zero and prompt flags sparse, as in serving."""
    buf = torch.full((num_rows, vocab + pad), float("nan"))
    buf[:, :vocab] = torch.randn(num_rows, vocab, generator=g) * 4
    buf[:, : vocab : 7] = float("-inf")  # tokens a bias or a grammar already ruled out
    counts = torch.randint(0, 4, (num_slots, vocab), generator=g, dtype=torch.int32)
    counts *= torch.rand(num_slots, vocab, generator=g) < 0.2
    in_prompt = torch.rand(num_slots, vocab, generator=g) < 0.1
    penalties = torch.stack([torch.rand(num_slots, generator=g) + 0.5,  # repetition (1.0 = none is covered too)
                             torch.rand(num_slots, generator=g) * 2 - 1,  # frequency, either sign
                             torch.rand(num_slots, generator=g) * 2 - 1], dim=1)  # presence
    penalties[0, 0] = 1.0
    tables = [t.to(DEVICE) for t in (counts, in_prompt, penalties)]
    return buf.to(DEVICE), tables


@pytest.mark.parametrize("vocab", [1, 37, 256, 1000, 5003])
@pytest.mark.parametrize("rows_slots", [([0], [0]), ([4, 1, 6], [2, 0, 3]), (list(range(9)), [3, 1, 4, 0, 2, 5, 6, 7, 8])])
def test_matches_reference(vocab, rows_slots):
    g = torch.Generator().manual_seed(vocab)
    rows, slots = (torch.tensor(x, dtype=torch.long, device=DEVICE) for x in rows_slots)
    buf, tables = case(g, num_rows=9, vocab=vocab, num_slots=9, pad=3)
    got, want = buf.clone(), buf.clone()
    apply_penalties(got[:, :vocab], rows, slots, *tables)
    apply_penalties_ref(want[:, :vocab], rows, slots, *tables)
    torch.testing.assert_close(got[:, :vocab], want[:, :vocab], rtol=1e-6, atol=0)
    assert got[:, vocab:].isnan().all(), "the row padding past the vocabulary was written"
    untouched = [r for r in range(9) if r not in rows_slots[0]]
    assert torch.equal(got[untouched, :vocab], buf[untouched, :vocab]), "a row not penalized changed"


def test_no_penalized_rows_is_a_no_op():
    g = torch.Generator().manual_seed(1)
    buf, tables = case(g, num_rows=3, vocab=100, num_slots=2)
    got = buf.clone()
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    apply_penalties(got, empty, empty, *tables)
    assert torch.equal(got, buf)


def test_neutral_penalties_change_nothing_and_seen_tokens_follow_the_sign_rule():
    """repetition 1, frequency 0, presence 0: bit-for-bit the input; repetition 2 on a token seen
    only in the prompt halves a positive logit and doubles a negative one."""
    logits = torch.tensor([[3.0, -3.0, 5.0, float("-inf")]], device=DEVICE)
    counts = torch.zeros(1, 4, dtype=torch.int32, device=DEVICE)
    in_prompt = torch.tensor([[True, True, False, True]], device=DEVICE)
    one = torch.zeros(1, dtype=torch.long, device=DEVICE)
    neutral = logits.clone()
    apply_penalties(neutral, one, one, counts, in_prompt, torch.tensor([[1.0, 0.0, 0.0]], device=DEVICE))
    assert torch.equal(neutral, logits)
    apply_penalties(logits, one, one, counts, in_prompt, torch.tensor([[2.0, 0.0, 0.0]], device=DEVICE))
    assert logits.tolist() == [[1.5, -6.0, 5.0, float("-inf")]]
