"""log_softmax_rows against torch.log_softmax, and a row's bits inside batches of 1, 7 and 64 rows
at different offsets (TRITON_INTERPRET=1 on CPU, see tests/conftest.py)."""

from __future__ import annotations

import torch

from kernels.log_softmax import _log_softmax_kernel, log_softmax_rows

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


def test_one_row_slice_of_a_padded_tensor():
    """A one-row slice keeps its parent's padded stride (a multiple of 16 here); its bits must be
    those of the same row inside a dense batch (the kernel is not specialised on the stride)."""
    g = torch.Generator().manual_seed(2)
    cols, padded = 5003, 5008
    parent = (torch.randn(1, padded, generator=g) * 8).to(DEVICE)
    one = parent[:, :cols].float()
    assert one.stride(0) == padded  # what torch does; the case the kernel must not specialise on
    batch = torch.cat([one, (torch.randn(1, cols, generator=g) * 3).to(DEVICE)]).contiguous()
    assert torch.equal(bits(log_softmax_rows(one)[0]), bits(log_softmax_rows(batch)[0]))
    # Under the interpreter nothing is specialised; on the GPU a stride that is a multiple of 16
    # compiled another layout (another summation order) until these were excluded.
    jit = _log_softmax_kernel  # the interpreter wraps the JITFunction and keeps its options
    unspecialised = getattr(jit, "do_not_specialize", None) or jit.kwargs["do_not_specialize"]
    names = {jit.arg_names[a] if isinstance(a, int) else a for a in unspecialised}  # indices on some versions
    assert {"num_cols", "stride_x"} <= names
