"""models/quant/gemms.py: at each row count's kernel (one row: the GEMVs, a 16-bit row read as it is
(ONE_ROW_W8A16) or quantized in the GEMV where no norm did it; 2-16 rows: the split tiles; more: torch._scaled_mm, the FP8 Triton GEMM,
or the weight dequantized into memory for a 16-bit GEMM) a quantized linear computes its
reference: FP8 activations quantized per token, per 128 columns or statically times the FP8
weight; 16-bit activations times the dequantized int4 or fp8 weight. The CPU runs the Triton kernels
under the interpreter and torch._scaled_mm's CPU implementation; a GPU runs them for real."""

from __future__ import annotations

import pytest
import torch

from kernels.quant_reference import fp8_matmul_ref, pack_int4, quant_fp8_ref, wo_matmul_ref
import models.quant.gemms as gemms
from kernels.quant_reference import dequant_fp8
from models.quant.gemms import QuantizedInput, fp8_linear, quantizes_input, weight_only_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, K = 48, 384
ROWS = [1, 5, 24]


def _x(m, seed):
    return (torch.randn(m, K, generator=torch.Generator().manual_seed(seed)) * 2).to(torch.bfloat16)


def _dev(*tensors):
    return [t.to(DEVICE) if t is not None else None for t in tensors]


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("kind", ["token", "block", "static"])
def test_fp8_linear_at_each_row_count(m, kind, monkeypatch):
    group = 128 if kind == "block" else 1 << 30
    static = torch.tensor([0.02]) if kind == "static" else None
    w, ws = quant_fp8_ref(torch.randn(N, K, generator=torch.Generator().manual_seed(1)) * 0.05, group)
    bias = (torch.randn(N) * 0.1).to(torch.bfloat16)
    x = _x(m, m)
    q, s = quant_fp8_ref(x, group, static)
    want = fp8_matmul_ref(q, s, w, ws, group, torch.float32, bias)
    x, q, s, w, ws, bias, static = _dev(x, q, s, w, ws, bias, static)
    monkeypatch.setattr(gemms, "ONE_ROW_W8A16", False)  # FP8 activations at one row too (the next test: on)
    for scaled_mm in ([False, True] if kind == "token" else [False]):
        got = fp8_linear(x, w, ws, group, group, static, torch.bfloat16, bias, scaled_mm)
        torch.testing.assert_close(got.cpu().float(), want, atol=2e-2, rtol=8e-3)  # one bf16 rounding, sum order
        # the norm's quantized input gives the same row as the raw one quantized by the linear
        assert torch.equal(fp8_linear(QuantizedInput(q, s), w, ws, group, group, static, torch.bfloat16, bias,
                                      scaled_mm), got)
    if m == 1:  # ... quantized by its own launch before the GEMV or in it (gemms.FP8_GEMV_QUANT_FIRST)
        monkeypatch.setattr(gemms, "FP8_GEMV_QUANT_FIRST", not gemms.FP8_GEMV_QUANT_FIRST)
        assert torch.equal(fp8_linear(x, w, ws, group, group, static, torch.bfloat16, bias, False), got)


@pytest.mark.parametrize("kind", ["token", "block", "static"])
def test_fp8_linear_reads_one_16_bit_row_unquantized(kind):
    # gemms.ONE_ROW_W8A16 (the default): one 16-bit row times the dequantized FP8 weight, the row not
    # quantized (the static scale unused); closer to that reference than w8a8's row is; a row the norm
    # quantized (QuantizedInput) still computes as w8a8; 2 rows and more read FP8
    assert gemms.ONE_ROW_W8A16 and not quantizes_input(1) and quantizes_input(2) and quantizes_input(16)
    group = 128 if kind == "block" else 1 << 30
    static = torch.tensor([0.02]) if kind == "static" else None
    w, ws = quant_fp8_ref(torch.randn(N, K, generator=torch.Generator().manual_seed(5)) * 0.05, group)
    bias = (torch.randn(N) * 0.1).to(torch.bfloat16)
    x = _x(1, 11)
    want = (x.float() @ dequant_fp8(w, ws, group, torch.float32).t() + bias.float())
    q, s = quant_fp8_ref(x, group, static)
    w8a8 = fp8_matmul_ref(q, s, w, ws, group, torch.float32, bias)
    dx, dq, ds, dw, dws, dbias, dstatic = _dev(x, q, s, w, ws, bias, static)
    got = fp8_linear(dx, dw, dws, group, group, dstatic, torch.bfloat16, dbias, False).cpu().float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=8e-3)  # one bf16 rounding, sum order
    assert (got - want).abs().max() < (w8a8 - want).abs().max() / 2  # the activations' FP8 error is gone
    quantized = fp8_linear(QuantizedInput(dq, ds), dw, dws, group, group, dstatic, torch.bfloat16, dbias, False)
    torch.testing.assert_close(quantized.cpu().float(), w8a8, atol=2e-2, rtol=8e-3)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("kind", ["int4", "int4-g_idx", "fp8"])
def test_weight_only_linear_at_each_row_count(m, kind):
    g = torch.Generator().manual_seed(2)
    x = _x(m, m + 10)
    bias = (torch.randn(N, generator=g) * 0.1).to(torch.bfloat16)
    if kind == "fp8":
        w = (torch.randn(N, K, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        args = (w, torch.rand(N, 1, generator=g) * 0.01, None, 1 << 30, bias, None)
    else:
        q = pack_int4(torch.randint(0, 16, (N, K), generator=g))
        scale, zero = torch.rand(N, K // 128, generator=g) * 0.02, torch.randint(0, 16, (N, K // 128), generator=g)
        g_idx = (torch.randperm(K, generator=g) // 128).to(torch.int32) if kind == "int4-g_idx" else None
        args = (q, scale, zero.to(torch.uint8), 128, bias, g_idx)
    got = weight_only_linear(*_dev(x, *args[:3]), args[3], *_dev(*args[4:]))
    torch.testing.assert_close(got.cpu().float(), wo_matmul_ref(x, *args[:5], args[5]).float(), atol=3e-2, rtol=1e-2)
