"""The FP8 GEMM (kernels/fp8_matmul.py) against its reference, under the interpreter on the CPU: block
scales (group 128) and one scale per row, awkward M/N/K (K past the last full group, N and M not
multiples of the tiles, one row, no row), bias, every output dtype."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_matmul import fp8_matmul
from kernels.quant_reference import fp8_matmul_ref, quant_fp8_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(m, n, k, group, seed):
    g = torch.Generator().manual_seed(seed)
    a, a_scale = quant_fp8_ref(torch.randn(m, k, generator=g), group)
    b, b_scale = quant_fp8_ref(torch.randn(n, k, generator=g) * 0.05, group)
    return [t.to(DEVICE) for t in (a, a_scale, b, b_scale)]


@pytest.mark.parametrize("group", [128, 1 << 30])
@pytest.mark.parametrize("m,n,k", [(1, 64, 256), (17, 40, 200), (33, 96, 384), (0, 32, 128)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_matmul_matches_reference(group, m, n, k, out_dtype):
    a, sa, b, sb = _operands(m, n, k, group, m + n + k)
    bias = (torch.randn(n) * 0.1).to(out_dtype).to(DEVICE) if m % 2 else None
    out = fp8_matmul(a, sa, b, sb, group, out_dtype, bias)
    ref = fp8_matmul_ref(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), group, out_dtype, None if bias is None else bias.cpu())
    assert out.dtype == out_dtype and out.shape == (m, n)
    # fp32 out: exact sums on the CPU; on an H100 the FP8 MMA adds its products in fewer bits than
    # fp32 (seen there: up to 9e-4 apart at K 384, sums of order 1), as 16-bit outputs' rounding allows
    tol = 1e-2 if out_dtype != torch.float32 else 1e-5 if DEVICE == "cpu" else 2e-3
    torch.testing.assert_close(out.cpu(), ref, atol=tol, rtol=tol)


def test_block_scales_apply_per_group():
    # a second K group whose scale is 1000x the first: summing groups before scaling would be far off
    a, sa, b, sb = _operands(3, 32, 256, 128, 0)
    sb[:, 1] *= 1000
    out = fp8_matmul(a, sa, b, sb, 128, torch.float32)
    torch.testing.assert_close(out.cpu(), fp8_matmul_ref(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), 128, torch.float32),
                               atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("group", [128, 1 << 30])
def test_split_k_sums_the_splits_in_order(group):
    # decode rows with K split three ways (the last split shorter): fp32 partials, then one rounding
    from kernels.fp8_matmul import Fp8MatmulConfig

    a, sa, b, sb = _operands(5, 40, 640, group, 3)
    bias = (torch.randn(40) * 0.1).to(torch.bfloat16).to(DEVICE)
    ref = fp8_matmul_ref(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), group, torch.float32, bias.cpu())
    out = fp8_matmul(a, sa, b, sb, group, torch.bfloat16, bias, cfg=Fp8MatmulConfig(16, 32, 1, 1, 128, 3))
    torch.testing.assert_close(out.cpu().float(), ref, atol=1e-2, rtol=8e-3)
    exact = fp8_matmul(a, sa, b, sb, group, torch.float32, cfg=Fp8MatmulConfig(16, 32, 1, 1, 128, 3))
    torch.testing.assert_close(exact.cpu(), fp8_matmul_ref(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), group,
                                                           torch.float32), atol=1e-5, rtol=1e-5)
