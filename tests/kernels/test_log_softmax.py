"""log_softmax_rows against torch.log_softmax, and a row's bits inside batches of 1, 7 and 64 rows
at different offsets (TRITON_INTERPRET=1 on CPU, see tests/conftest.py)."""

from __future__ import annotations

import torch

from kernels.log_softmax import log_softmax_rows

from tests.helpers import bits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_matches_torch():
    g = torch.Generator().manual_seed(0)
    for cols in (1, 37, 2048, 5003):
        x = (torch.randn(5, cols, generator=g) * 8).to(DEVICE)
        x[1, ::3] = float("-inf")  # masked tokens (logit_bias -100 / grammar masks give -inf too)
        torch.testing.assert_close(log_softmax_rows(x), torch.log_softmax(x, dim=-1), atol=2e-5, rtol=1e-5,
                                   equal_nan=True)  # a row of only -inf: NaN in both


def test_rows_are_batch_invariant():
    g = torch.Generator().manual_seed(1)
    cols = 5003  # odd: in one contiguous batch every row starts at another alignment
    probe = (torch.randn(2, cols, generator=g) * 8).to(DEVICE)
    alone = torch.cat([log_softmax_rows(probe[i : i + 1]) for i in range(2)])
    for batch in (7, 64):
        x = (torch.randn(batch, cols, generator=g) * 3).to(DEVICE)
        at = torch.randperm(batch, generator=g)[:2].to(DEVICE)
        x[at] = probe
        assert torch.equal(bits(log_softmax_rows(x)[at]), bits(alone)), f"rows changed in a batch of {batch}"
    strided = torch.zeros(3, cols + 5, device=DEVICE)
    strided[1, :cols] = probe[0]
    assert torch.equal(bits(log_softmax_rows(strided[:, :cols])[1]), bits(alone[0]))
