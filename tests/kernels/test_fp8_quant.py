"""FP8 activation quantization (kernels/fp8_quant.py) against its reference, under the interpreter on
the CPU: per token, per 128-column group, static; alone, fused into the residual add + RMSNorm, and
into silu_mul. q and the scales must equal the reference bit for bit (the rounding to e4m3 is
exact), on awkward row lengths (a partial last group, one row, no row) and all-zero rows; and a
row's q and scale depend on that row alone (a CUDA graph's padding rows, NaN included, change none)."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_quant import add_rmsnorm_fp8, quant_fp8, rmsnorm_fp8, silu_mul_fp8
from kernels.quant_reference import quant_fp8_ref
from kernels.reference import add_rmsnorm_ref, rmsnorm_ref, silu_mul_ref
from kernels.rms_norm import add_rmsnorm
from kernels.silu_mul import silu_mul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GROUP_CASES = [("token", 1 << 30, None), ("group128", 128, None), ("static", 1 << 30, 0.02)]


def _x(m, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 8
    if m > 2:
        x[1] = 0  # an all-zero row: the floor scale
    return x.to(dtype).to(DEVICE)


def _same(q, s, ref_q, ref_s):
    assert q.dtype == torch.float8_e4m3fn and q.shape == ref_q.shape and s.shape == ref_s.shape
    assert torch.equal(s.cpu(), ref_s.cpu())
    assert torch.equal(q.view(torch.uint8).cpu(), ref_q.view(torch.uint8).cpu())


@pytest.mark.parametrize("name,group,static", GROUP_CASES)
@pytest.mark.parametrize("m,k", [(1, 256), (5, 200), (3, 384), (0, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quant_fp8_matches_reference(name, group, static, m, k, dtype):
    x = _x(m, k, dtype, m * 7 + k)
    st = torch.tensor([static], device=DEVICE) if static else None
    q, s = quant_fp8(x, group, st)
    _same(q, s, *quant_fp8_ref(x.cpu(), group, st.cpu() if st is not None else None))


def test_the_rounding_is_to_nearest_even_on_e4m3s_grid():
    # halfway points between neighbours of the fp8 grid, normal and subnormal, and the clamp at 448;
    # and one fp32 ulp either side of halfway points, which a rounding through fp16 truncated first
    # (Triton 3.6's conversion on sm_89: kernels.fp8_quant.e4m3_cvt) would send to the lower neighbour
    ties = [1.0625, 1.1875, 2.125, 0.0029296875, 0.0048828125, -3.375, 500.0, -1e-9]
    near = [t * (1 + d * 2.0 ** -23) for t in (1.0625, 1.1875, -3.375, 0.0048828125) for d in (1, -1)]
    v = torch.tensor([(ties + near) * 2])
    q, s = quant_fp8(v.to(DEVICE), static_scale=torch.ones(1, device=DEVICE))
    ref = (v / 1.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    # -1e-9 rounds to zero: torch on the CPU keeps its sign (0x80), an H100's conversion gives +0
    # (0x00; seen there); both decode to 0.0, so a zero's sign bit is not compared
    bits, ref_bits = (t.view(torch.uint8) for t in (q.cpu(), ref))
    zero = ref.float() == 0
    assert torch.equal(torch.where(zero, 0, bits), torch.where(zero, 0, ref_bits)) and s.item() == 1.0
    assert torch.equal(q.cpu().float() == 0, zero)


@pytest.mark.parametrize("name,group,static", GROUP_CASES)
@pytest.mark.parametrize("m,k", [(1, 256), (6, 192), (0, 128)])
def test_fused_norm_quant_matches_reference(name, group, static, m, k):
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(m + k)
    x, y = _x(m, k, dtype, 3), _x(m, k, dtype, 4)
    w = (torch.rand(k, generator=g) + 0.5).to(dtype).to(DEVICE)
    st = torch.tensor([static], device=DEVICE) if static else None
    # the h the fused kernels quantize is add_rmsnorm's h (within the norm's own ulp of the reference)
    s_ref, h = add_rmsnorm(x.clone(), y, w, 1e-5)
    x2 = x.clone()
    out, q, s = add_rmsnorm_fp8(x2, y, w, 1e-5, group, st)
    assert out is x2 and torch.equal(x2.cpu(), add_rmsnorm_ref(x.cpu(), y.cpu(), w.cpu(), 1e-5)[0])
    _same(q, s, *quant_fp8_ref(h.cpu(), group, st.cpu() if st is not None else None))
    q, s = rmsnorm_fp8(x, w, 1e-5, group, st)
    ref_q, ref_s = quant_fp8_ref(rmsnorm_ref(x.cpu(), w.cpu(), 1e-5), group, st.cpu() if st is not None else None)
    # h may differ from torch's by an ulp (kernels/rms_norm.py): q within one fp8 step where it does
    assert torch.equal(s.cpu(), ref_s) or torch.allclose(s.cpu(), ref_s, rtol=1e-2)
    assert (q.cpu().float() - ref_q.float()).abs().le(ref_q.float().abs() * 0.07 + 1e-6).all()


@pytest.mark.parametrize("name,group,static", GROUP_CASES)
@pytest.mark.parametrize("m,inter", [(1, 256), (5, 200), (0, 128), (17, 200)])
@pytest.mark.parametrize("split_cols", [1024, 128])  # 128: rows cut into chunks (any row count), a partial last
def test_silu_mul_fp8_quantizes_silu_mul(name, group, static, m, inter, split_cols):
    gate_up = _x(m, 2 * inter, torch.bfloat16, inter)
    if m > 2:
        gate_up[2, inter + 150] = 60.0  # the row's largest |h| in its second chunk: the split's amax must see it
    st = torch.tensor([static], device=DEVICE) if static else None
    q, s = silu_mul_fp8(gate_up, group, st, split_cols=split_cols)
    _same(q, s, *quant_fp8(silu_mul(gate_up), group, st))  # the same bits as the two launches it replaces
    ref_q, ref_s = quant_fp8_ref(silu_mul_ref(gate_up.cpu()), group, st.cpu() if st is not None else None)
    # against torch: exp may differ in its last bit (kernels/silu_mul.py), so q within one fp8 step
    torch.testing.assert_close(s.cpu(), ref_s, rtol=1e-2, atol=0)
    assert (q.cpu().float() - ref_q.float()).abs().le(ref_q.float().abs() * 0.07 + 1e-6).all()


@pytest.mark.parametrize("name,group,static", GROUP_CASES)
def test_a_rows_quantization_depends_on_that_row_only(name, group, static):
    x, y = _x(3, 320, torch.bfloat16, 5), _x(3, 320, torch.bfloat16, 6)
    rows = torch.stack([torch.full((320,), float("nan")), torch.full((320,), 3e4)]).to(torch.bfloat16).to(DEVICE)
    px, py = torch.cat([x, rows]), torch.cat([y, rows])  # a graph's padding rows: anything, NaN included
    w = torch.ones(320, dtype=torch.bfloat16, device=DEVICE)
    st = torch.tensor([static], device=DEVICE) if static else None
    for fn in (lambda a, b: quant_fp8(a, group, st), lambda a, b: rmsnorm_fp8(a, w, 1e-5, group, st),
               lambda a, b: add_rmsnorm_fp8(a.clone(), b, w, 1e-5, group, st)[1:],
               lambda a, b: silu_mul_fp8(torch.cat([a, b], 1), group, st),
               lambda a, b: silu_mul_fp8(torch.cat([a, b], 1), group, st, split_cols=64)):
        q, s = fn(x, y)
        pq, ps = fn(px, py)
        _same(pq[:3], ps[:3], q, s)


@pytest.mark.parametrize("device,capability,cvt", [("cuda:0", (9, 0), True), ("cuda:0", (10, 0), True),
                                                   ("cuda:0", (8, 9), False), ("cuda:0", (8, 0), False),
                                                   ("cpu", None, False)])
def test_e4m3_by_conversion_only_where_it_rounds_once(monkeypatch, device, capability, cvt):
    """The kernels round to e4m3 by Triton's conversion on sm_90 and later alone: on sm_89 Triton 3.6
    converts through fp16 truncated first, and the interpreter does not round to nearest-even."""
    from kernels import fp8_quant

    monkeypatch.setattr(fp8_quant, "_INTERPRET", False)
    monkeypatch.setattr(fp8_quant, "_capability", lambda index: capability)
    assert fp8_quant.e4m3_cvt(torch.device(device)) is cvt
    monkeypatch.setattr(fp8_quant, "_INTERPRET", True)
    assert fp8_quant.e4m3_cvt(torch.device(device)) is False
