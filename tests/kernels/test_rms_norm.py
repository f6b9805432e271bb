"""add_rmsnorm and rmsnorm against their references (TRITON_INTERPRET=1 on CPU; see tests/conftest.py).

The reference is checked against the model's own RMSNorm (models/llama.py) bit for bit. The
residual add is bit-exact. The norm differs from torch only through the order of the fp32 sum of
squares, so h must be within 2 ulp of the reference everywhere (1 ulp before the weight multiply)
and bit-identical almost everywhere (at most 1 element in 500 off): rounding in the wrong order (e.g. the weight applied
before rounding to the model dtype) breaks that by a wide margin.
"""

from __future__ import annotations

import pytest
import torch

from kernels.reference import add_rmsnorm_ref, rmsnorm_ref
from kernels.rms_norm import add_rmsnorm, rmsnorm
from models.llama import RMSNorm

from tests.helpers import bits, ulps  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _assert_close_ulp(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if not out.numel():
        return
    dist = ulps(out, ref)
    if out.dtype == torch.float32:  # nothing rounds the fp32 result: a few ulp of rsqrt's input
        assert dist.max().item() <= 8, f"{what}: {dist.max().item()} ulp"
        return
    # normalised x can round to its neighbour (1 ulp); the weight (0.5..1.5) can stretch that to 2.
    off = int((dist > 0).sum())
    assert dist.max().item() <= 2, f"{what}: {dist.max().item()} ulp"
    assert off <= 1 + out.numel() // 500, f"{what}: {off} of {out.numel()} elements off"


def _weight(n, dtype, g):
    return (torch.rand(n, generator=g) + 0.5).to(dtype).to(DEVICE)


def test_reference_is_the_model_rmsnorm():
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        x = (torch.randn(9, 3, 100, generator=g) * 4).to(dtype)
        norm = RMSNorm(100, 1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(100, generator=g) + 0.5)
            assert torch.equal(bits(norm(x)), bits(rmsnorm_ref(x, norm.weight, 1e-6)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,hidden", [(1, 4096), (7, 96), (33, 1000), (4, 2880), (0, 64)])
def test_add_rmsnorm_matches_reference(dtype, n, hidden):
    g = torch.Generator().manual_seed(n * 1000 + hidden)
    x = (torch.randn(n, hidden, generator=g) * 3).to(dtype).to(DEVICE)
    y = torch.randn(n, hidden, generator=g).to(dtype).to(DEVICE)
    w = _weight(hidden, dtype, g)
    ref_s, ref_h = add_rmsnorm_ref(x.clone(), y, w, 1e-5)
    x_in = x.clone()
    s, h = add_rmsnorm(x_in, y, w, 1e-5)
    assert s.data_ptr() == x_in.data_ptr()  # the residual stream is updated in place
    assert torch.equal(bits(s), bits(ref_s)), "the residual add must be bit-exact"
    _assert_close_ulp(h, ref_h, f"h {dtype} {n}x{hidden}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_strided_rows_and_out(dtype):
    """Rows of x and y with a stride (views into wider buffers), h into a given out."""
    g = torch.Generator().manual_seed(11)
    n, hidden = 6, 300
    xb = (torch.randn(n, hidden + 20, generator=g) * 3).to(dtype).to(DEVICE)
    yb = torch.randn(n, 2 * hidden, generator=g).to(dtype).to(DEVICE)
    x, y = xb[:, 5 : 5 + hidden], yb[:, hidden:]
    w = _weight(hidden, dtype, g)
    ref_s, ref_h = add_rmsnorm_ref(x.clone(), y, w, 1e-6)
    xb_before = xb.clone()
    out = torch.full((n, hidden), float("nan"), dtype=dtype, device=DEVICE)
    s, h = add_rmsnorm(x, y, w, 1e-6, out=out)
    assert h.data_ptr() == out.data_ptr()
    assert torch.equal(bits(s), bits(ref_s))
    _assert_close_ulp(h, ref_h, "strided h")
    # Columns of the buffer outside the view are untouched.
    assert torch.equal(bits(xb[:, :5]), bits(xb_before[:, :5]))
    assert torch.equal(bits(xb[:, 5 + hidden :]), bits(xb_before[:, 5 + hidden :]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_rows_and_heads(dtype):
    """rmsnorm on [n, hidden] (the first layer) and on per-head views [n, heads, head_dim] of a
    merged QKV output (Q/K norms, head_dim 64 and 128), out-of-place and in place (out=x)."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 1000, generator=g) * 2).to(dtype).to(DEVICE)
    w = _weight(1000, dtype, g)
    _assert_close_ulp(rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6), "rows")
    one = x[:1].clone()
    _assert_close_ulp(rmsnorm(one, w, 1e-6), rmsnorm_ref(one, w, 1e-6), "one token")
    for heads, kv_heads, d in [(8, 2, 64), (4, 1, 128)]:
        n = 5
        qkv = (torch.randn(n, (heads + 2 * kv_heads) * d, generator=g) * 2).to(dtype).to(DEVICE)
        q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q, k = q.view(n, heads, d), k.view(n, kv_heads, d)
        wq, wk = _weight(d, dtype, g), _weight(d, dtype, g)
        ref_q, ref_k = rmsnorm_ref(q, wq, 1e-6), rmsnorm_ref(k, wk, 1e-6)
        out_q = rmsnorm(q, wq, 1e-6)
        assert out_q.is_contiguous()
        _assert_close_ulp(out_q, ref_q, f"q heads {heads}x{d}")
        before = qkv.clone()
        assert rmsnorm(k, wk, 1e-6, out=k).data_ptr() == k.data_ptr()  # in place, inside the buffer
        _assert_close_ulp(k, ref_k, f"k heads {kv_heads}x{d} in place")
        # q and v untouched by the in-place k norm.
        assert torch.equal(bits(qkv[:, : heads * d]), bits(before[:, : heads * d]))
        assert torch.equal(bits(qkv[:, (heads + kv_heads) * d :]), bits(before[:, (heads + kv_heads) * d :]))
    assert rmsnorm(x[:0], w, 1e-6).shape == (0, 1000)
