"""kernels/fp8.py: the in-kernel fp8 quantizer gives torch's bits (fp8_quantize_ref) for every value
that can round either way, the dequantizer reads every one of the 256 bytes as torch does, NaN and
inf included, and fp16_rows brings query rows into fp16 exactly (runs under TRITON_INTERPRET=1 on CPU,
see tests/conftest.py; on a GPU too)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels.fp8 import dequantize, fp16_rows, inverse, quantize
from kernels.reference import FP8_MAX, fp8_dequantize_ref, fp8_quantize_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@triton.jit
def _quantize_kernel(x_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, quantize(x, inverse(tl.load(scale_ptr)), out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequantize_kernel(c_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(out_ptr + offs, dequantize(tl.load(c_ptr + offs, mask=ok), out_ptr.dtype.element_ty), mask=ok)


def _hard_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the format, every midpoint between neighbours (ties: nearest even must
    win) and the fp32 values one ulp either side of them, both signs; past the largest value
    (saturation), zero and below the smallest subnormal, and NaN."""
    every = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    every = every[every.isfinite()].unique()
    mid = (every[1:] + every[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    top = FP8_MAX[dtype]
    extra = torch.tensor([top * 1.03, top * 1.07, top * 4, 1e30, -1e30, 1e-30, -0.0, float("nan")])
    return torch.cat([every, mid, torch.nextafter(mid, up), torch.nextafter(mid, down), extra])


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_quantize_matches_torch(dtype: torch.dtype, src: torch.dtype) -> None:
    """Bit for bit against torch's cast of x * (1 / scale): scale 1 walks the hard values exactly;
    a scale of 0.37 (not a power of two) and random inputs check the multiply by its fp32 inverse."""
    g = torch.Generator().manual_seed(0)
    for scale, x in ((1.0, _hard_values(dtype)), (0.37, torch.randn(20000, generator=g) * 60)):
        x = x.to(src).to(DEVICE)
        s = torch.tensor([scale], dtype=torch.float32, device=DEVICE)
        out = torch.empty(x.shape, dtype=dtype, device=DEVICE)
        _quantize_kernel[(triton.cdiv(x.numel(), 4096),)](x, s, out, x.numel(), BLOCK=4096)
        want = fp8_quantize_ref(x[:, None], s, dtype)[:, 0]
        bad = (out.view(torch.uint8) != want.view(torch.uint8)).nonzero().flatten()
        assert not len(bad), f"scale {scale}: {x[bad[:5]].tolist()} -> {out[bad[:5]].float().tolist()}, " \
                             f"torch gives {want[bad[:5]].float().tolist()}"


@pytest.mark.parametrize("dtype", FP8)
def test_dequantize_every_byte(dtype: torch.dtype) -> None:
    c = torch.arange(256, dtype=torch.uint8).view(dtype).to(DEVICE)
    for out_dtype in (torch.float32, torch.float16, torch.bfloat16):
        out = torch.empty(256, dtype=out_dtype, device=DEVICE)
        _dequantize_kernel[(1,)](c, out, 256, BLOCK=256)
        want = c.to(out_dtype)
        same = (out == want) | (out.isnan() & want.isnan())
        assert same.all(), f"{out_dtype}: bytes {same.logical_not().nonzero().flatten().tolist()} read wrongly"


def test_reference_round_trip() -> None:
    """The reference pair: dequantize(quantize(x)) is x within half an fp8 step (relative 1/16 for
    e4m3, 1/8 for e5m2) wherever x is in the format's normal range, per-head scales applied."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, 32, generator=g) * torch.tensor([0.01, 1.0, 300.0])[:, None]
    scale = x.abs().amax(dim=(0, 2)) / 448
    back = fp8_dequantize_ref(fp8_quantize_ref(x, scale, torch.float8_e4m3fn), scale)
    normal = x.abs() >= scale[:, None] * 2**-6
    assert ((back - x).abs() <= x.abs() / 16)[normal].all()


@triton.jit
def _fp16_rows_kernel(q_ptr, out_ptr, up_ptr, ROWS: tl.constexpr, D: tl.constexpr):
    r = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    q16, up = fp16_rows(tl.load(q_ptr + r[:, None] * D + d[None, :]))
    tl.store(out_ptr + r[:, None] * D + d[None, :], q16)
    tl.store(up_ptr + r, up)


def test_fp16_rows_is_exact_per_row() -> None:
    """bf16 query rows of any magnitude (1e-30 to 1e30, and all zero) as fp16 times a power of two:
    exactly the row back once multiplied by its power, largest |value| in [1, 2), and a row's
    result independent of the other rows."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(8, 64, generator=g) * torch.tensor([1e-30, 1e-3, 1.0, 7.0, 3e4, 1e30, 0.0, 448.0])[:, None]
    q = q.to(torch.bfloat16).to(DEVICE)
    out = torch.empty(q.shape, dtype=torch.float16, device=DEVICE)
    up = torch.empty(8, dtype=torch.float32, device=DEVICE)
    _fp16_rows_kernel[(1,)](q, out, up, ROWS=8, D=64)
    real = q.float().abs().amax(dim=1) > 0
    assert torch.equal(out.float()[real] * up[real, None], q.float()[real])
    top = out.float().abs().amax(dim=1)
    assert ((top[real] >= 1) & (top[real] < 2)).all() and (out[~real] == 0).all()
    assert (up.log2() == up.log2().round()).all()  # powers of two
