"""apply_grammar (grammar-constrained rows) and the masked argmax (kernels/argmax.py `mask`) against
their references, and wait_for_flag's hold on the queue (TRITON_INTERPRET=1 on CPU; see tests/conftest.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kernels.argmax import argmax_rows
from kernels.grammar_mask import apply_grammar, wait_for_flag
from kernels.reference import argmax_ref, grammar_mask_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PIN = DEVICE == "cuda"  # the masks live in pinned host memory on a GPU, as the runner keeps them


def host(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if PIN else t


def random_bits(g: torch.Generator, rows: int, covered: int, density: float) -> torch.Tensor:
    words = -(-covered // 32)
    allowed = torch.rand(rows, words * 32, generator=g) < density
    allowed[:, covered:] = True  # bits past the vocabulary: the kernel must ignore them anyway
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    packed = (allowed.view(rows, words, 32).long() * weights).sum(-1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,cols,covered,pad", [(1, 1, 1, 0), (1, 700, 700, 3), (3, 1000, 999, 47),
                                                   (6, 2049, 1500, 0), (9, 5003, 4000, 5)])
def test_masks_and_choices_match_the_reference(dtype, rows, cols, covered, pad):
    """Live rows beside rows left alone; a vocabulary past the tokenizer's (covered < cols); NaN in
    the LM head's padding columns, which nothing reads; sparse and dense masks."""
    g = torch.Generator().manual_seed(rows * 13 + cols)
    logits = (torch.randn(rows, cols + pad, generator=g) * 3).to(dtype)
    if pad:
        logits[:, cols:] = float("nan")
    logits = logits.to(DEVICE)
    bits = host(random_bits(g, rows, covered, density=0.02 if rows % 2 else 0.7))
    live = host(torch.tensor([int(r % 3 != 1) for r in range(rows)], dtype=torch.int32))
    want = grammar_mask_ref(logits.cpu(), cols, bits.cpu(), live.cpu(), covered)
    for out_dtype in (torch.int32, torch.int64):
        out = torch.full((rows,), -7, dtype=out_dtype, device=DEVICE)
        before = logits.clone()
        argmax_rows(logits, cols, out=out, mask=(bits, live, covered))
        assert torch.equal(logits.isnan(), before.isnan()) and torch.equal(logits.nan_to_num(), before.nan_to_num())
        assert torch.equal(out.long().cpu(), argmax_ref(want, cols))  # rows left alone: their plain argmax
    apply_grammar(logits, cols, bits, live, covered)
    got = logits.cpu()
    assert torch.equal(got[:, :cols], want[:, :cols])
    assert torch.equal(got[:, cols:].isnan(), want[:, cols:].isnan())  # the padding is not written


def test_ties_nan_and_rows_that_allow_nothing():
    cols = 700
    logits = torch.zeros(4, cols)
    logits[0, [3, 600]] = 2.0  # a tie across blocks (the interpreter's are 256 wide): the first column
    logits[0, 650] = 5.0  # larger, but not allowed
    logits[1, 301] = float("nan")  # an allowed NaN counts as +inf
    logits[1, 302] = float("nan")  # a disallowed one is masked
    logits[2] = float("-inf")  # allowed only -inf: column 0, as torch.argmax of an all -inf row
    logits[3, 5] = 1.0  # allows nothing: column 0
    allowed = torch.zeros(4, 704, dtype=torch.bool)
    allowed[0, [3, 600, 10]] = True
    allowed[1, [301, 20]] = True
    allowed[2, [400, 401]] = True
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    packed = (allowed.view(4, 22, 32).long() * weights).sum(-1)
    bits = host(torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32))
    live = host(torch.ones(4, dtype=torch.int32))
    out = torch.empty(4, dtype=torch.int64, device=DEVICE)
    argmax_rows(logits.to(DEVICE), cols, out=out, mask=(bits, live, cols))
    assert out.tolist() == [3, 301, 0, 0]


def test_wait_for_flag_holds_the_queue_until_the_host_raises_it():
    """What is queued behind the wait reads what the host wrote before raising the flag."""
    flag = host(torch.zeros(1, dtype=torch.int64))
    src = host(torch.zeros(4, dtype=torch.int32))

    def write():
        time.sleep(0.2)
        src.copy_(torch.tensor([3, 1, 4, 1], dtype=torch.int32))
        flag[0] = 2

    writer = threading.Thread(target=write)
    writer.start()
    wait_for_flag(flag, host(torch.tensor([2])))
    dst = torch.zeros(4, dtype=torch.int32, device=DEVICE).copy_(src, non_blocking=True)
    assert dst.tolist() == [3, 1, 4, 1]
    writer.join()
