"""argmax_rows (greedy sampling) against its reference, plain and with penalties (TRITON_INTERPRET=1 on
CPU; see tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.argmax import argmax_rows
from kernels.penalties import table_addresses
from kernels.reference import argmax_ref, penalized_argmax_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,cols,pad", [(1, 1, 0), (1, 50257, 47), (3, 255, 1), (5, 257, 64), (17, 2049, 15)])
def test_argmax_matches_reference(dtype, rows, cols, pad):
    g = torch.Generator().manual_seed(rows * 7 + cols)
    logits = torch.randn(rows, cols + pad, generator=g).to(dtype)
    if pad:  # the LM head's padding columns: never read, whatever they hold
        logits[:, cols:] = float("nan")
        logits[0, -1] = 1e4
    logits = logits.to(DEVICE)
    for out_dtype in (torch.int32, torch.int64):
        out = torch.full((rows,), -7, dtype=out_dtype, device=DEVICE)
        argmax_rows(logits, cols, out=out)
        assert torch.equal(out.long().cpu(), argmax_ref(logits, cols).cpu())


def test_argmax_ties_nan_and_row_stride():
    cols = 1000
    base = torch.randn(4, 2 * cols)
    logits = base[:, :cols + 3]  # row stride 2 * cols: a view, as a slice of a larger buffer
    logits[0, [10, 600, 999]] = 9.0  # a tie across chunks: the first column wins
    logits[1, 300] = float("nan")  # NaN counts as +inf (torch.argmax also picks it)
    logits[2] = float("-inf")  # every column -inf: the first one
    logits[3, [700, 701]] = 5.0  # a tie inside one chunk
    logits[3, cols:] = 100.0  # beyond num_cols: ignored
    logits = logits.to(DEVICE)
    got = argmax_rows(logits, cols)
    assert got.dtype == torch.int64
    assert got.tolist() == [10, 300, 0, 700]
    assert torch.equal(got.cpu(), argmax_ref(logits, cols).cpu())


def test_argmax_no_rows():
    out = argmax_rows(torch.zeros(0, 64, device=DEVICE), 50)
    assert out.shape == (0,)



def penalty_tables(g: torch.Generator, num_slots: int, vocab: int):
    """Count tables as serving has them: counts mostly zero, prompt flags sparse, penalties of
    either sign (slot 0 without repetition penalty)."""
    counts = torch.randint(0, 4, (num_slots, vocab), generator=g, dtype=torch.int32)
    counts *= torch.rand(num_slots, vocab, generator=g) < 0.2
    in_prompt = torch.rand(num_slots, vocab, generator=g) < 0.1
    penalties = torch.stack([torch.rand(num_slots, generator=g) + 0.5, torch.rand(num_slots, generator=g) * 2 - 1,
                             torch.rand(num_slots, generator=g) * 2 - 1], dim=1)
    penalties[0, 0] = 1.0
    return [t.to(DEVICE) for t in (counts, in_prompt, penalties)]


def addresses(tables) -> torch.Tensor:
    return torch.tensor(table_addresses(*tables), dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,cols,pad", [(1, 1, 0), (3, 255, 1), (6, 1000, 47), (9, 5003, 5)])
def test_penalized_rows_match_reference(dtype, rows, cols, pad):
    """Rows with a slot (in any order, beside rows without) choose after their penalties and count
    the choice; the rest are the plain argmax; the logits and the padding are not written."""
    g = torch.Generator().manual_seed(rows * 11 + cols)
    logits = (torch.randn(rows, cols + pad, generator=g) * 4).to(dtype)
    logits[:, : cols : 7] = float("-inf")  # tokens a bias or a grammar already ruled out
    if pad:
        logits[:, cols:] = float("nan")
    logits = logits.to(DEVICE)
    before = logits.clone()
    tables = penalty_tables(g, rows + 2, cols)
    slots = torch.tensor([(r * 5 + 2) % (rows + 2) if r % 3 != 1 else -1 for r in range(rows)], dtype=torch.int32,
                         device=DEVICE)
    want_tables = [t.clone() for t in tables]
    got = torch.full((rows,), -7, dtype=torch.int32, device=DEVICE)
    want = got.clone()
    argmax_rows(logits, cols, out=got, penalty=(slots, addresses(tables)))
    penalized_argmax_ref(logits, cols, slots, *want_tables, out=want)
    assert torch.equal(got, want)
    assert torch.equal(tables[0], want_tables[0]), "the counts differ from the reference's update"
    assert torch.equal(logits.isnan(), before.isnan()) and torch.equal(logits.nan_to_num(), before.nan_to_num())


def test_penalized_ties_go_to_the_first_column_across_chunks_and_each_choice_counts_once():
    """A tie between chunks (the interpreter's are 256 wide) goes to the first column, as
    torch.argmax; an all -inf row takes column 0; each chosen (slot, id) count grows by one, and
    the next call's penalties see it."""
    cols = 700
    logits = torch.zeros(2, cols, device=DEVICE)
    logits[0, 3] = logits[0, 600] = 2.0
    logits[1] = float("-inf")
    tables = [torch.zeros(2, cols, dtype=torch.int32, device=DEVICE), torch.zeros(2, cols, dtype=torch.bool, device=DEVICE),
              torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]], device=DEVICE)]
    tables[0][0, 0] = 5
    out = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    slots = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    argmax_rows(logits, cols, out=out, penalty=(slots, addresses(tables)))
    assert out.tolist() == [3, 0]
    assert tables[0][1, 3] == 1 and tables[0][0, 0] == 6 and tables[0].sum() == 7
    argmax_rows(logits, cols, out=out, penalty=(slots, addresses(tables)))  # slot 1: frequency 1 on token 3
    assert out.tolist() == [600, 0] and tables[0][1, 600] == 1


def test_penalty_tables_are_read_through_their_addresses_and_only_for_rows_with_a_slot():
    """The CUDA-graph contract: the same launch arguments reach tables that moved (grown, as
    TokenCounts does) once their addresses are rewritten; with no row holding a slot, no table is
    read (null addresses)."""
    g = torch.Generator().manual_seed(5)
    cols = 300
    logits = torch.randn(4, cols, generator=g).to(DEVICE)
    tables = penalty_tables(g, 4, cols)
    where = addresses(tables)
    slots = torch.tensor([2, -1, 0, 3], dtype=torch.int32, device=DEVICE)
    out = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    moved = [torch.cat([t, t]) for t in tables]  # new storage, the same slots first
    want_tables = [t.clone() for t in moved]
    where.copy_(addresses(moved))
    tables[0].zero_()
    argmax_rows(logits, cols, out=out, penalty=(slots, where))
    want = torch.zeros_like(out)
    penalized_argmax_ref(logits, cols, slots, *want_tables, out=want)
    assert torch.equal(out, want) and torch.equal(moved[0], want_tables[0]) and not tables[0].any()
    nowhere = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    none = torch.full((4,), -1, dtype=torch.int32, device=DEVICE)
    argmax_rows(logits, cols, out=out, penalty=(none, nowhere))
    assert torch.equal(out.long(), argmax_ref(logits, cols))
