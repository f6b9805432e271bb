"""argmax_rows (greedy sampling) against its reference (TRITON_INTERPRET=1 on CPU; see tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.argmax import argmax_rows
from kernels.reference import argmax_ref

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
