"""tests/interpreter_dot.py: under Triton's CPU interpreter, tl.dot gives a row the same bits
wherever it sits in the tile, as the tensor-core steps do on the GPU (the batch-invariance tests
rest on it). Without it, numpy's BLAS decides: OpenBLAS's Haswell kernels do not."""

import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's dot only")


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    rm, rk, rn = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # bf16 is upcast before a dot (UPCAST_DOT)
def test_a_rows_bits_do_not_depend_on_its_place_in_the_tile(dtype):
    m, k, n = 64, 128, 64
    g = torch.Generator().manual_seed(0)
    row = torch.randn(1, k, generator=g).to(dtype)
    b = torch.randn(k, n, generator=g).to(dtype)
    bits = set()
    for place in range(m):  # every row of the tile, among rows of another scale
        a = (torch.randn(m, k, generator=g) * 5).to(dtype)
        a[place] = row[0]
        out = torch.empty(m, n, dtype=torch.float32)
        _dot_kernel[(1,)](a, b, out, m, k, n)
        bits.add(out[place].numpy().tobytes())
        want = row.float() @ b.float()
        np.testing.assert_allclose(out[place].numpy(), want[0].numpy(), rtol=1e-4, atol=1e-4)
    assert len(bits) == 1, f"{len(bits)} different results for one row over {m} places"
