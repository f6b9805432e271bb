"""The weight-only GEMM (kernels/wo_matmul.py) against its reference, under the interpreter on the
CPU: int4 with zero points and group scales (a K group boundary inside a K step, a partial last
group), fp8 weights decoded from their bits (every one of the 254 finite codes, subnormals and
negative zero included), awkward M/N/K, bias, fp16 and bf16."""

from __future__ import annotations

import pytest
import torch

from kernels.quant_reference import dequant_fp8, pack_int4, unpack_int4, wo_matmul_ref
from kernels.wo_matmul import WoConfig, wo_matmul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _int4(n, k, group, g):
    q = torch.randint(0, 16, (n, k), generator=g)
    groups = -(-k // group)
    scale = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    zero = torch.randint(0, 16, (n, groups), generator=g).to(torch.uint8)
    return pack_int4(q), scale, zero


def test_pack_and_unpack_are_inverse():
    q = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(0))
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (5, 8)
    assert torch.equal(unpack_int4(packed).long(), q)
    assert (packed[0, 0].item() & 0xF) == q[0, 0] and ((packed[0, 0].item() >> 28) & 0xF) == q[0, 7]


@pytest.mark.parametrize("group", [128, 32, 1 << 30])
@pytest.mark.parametrize("m,n,k", [(1, 48, 256), (19, 33, 200), (0, 16, 64), (40, 16, 136)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_matches_reference(group, m, n, k, dtype):
    g = torch.Generator().manual_seed(m * 31 + n + k)
    qweight, scale, zero = _int4(n, k, group, g)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = (torch.randn(n, generator=g) * 0.1).to(dtype) if n % 2 else None
    out = wo_matmul(x.to(DEVICE), qweight.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE), group,
                    None if bias is None else bias.to(DEVICE))
    ref = wo_matmul_ref(x, qweight, scale, zero, group, bias)
    torch.testing.assert_close(out.cpu(), ref, atol=2e-2, rtol=1e-2)


def test_int4_group_boundary_inside_a_k_step():
    # BLOCK_K 64 over groups of 32: two groups per step, each with its own scale and zero
    g = torch.Generator().manual_seed(5)
    qweight, scale, zero = _int4(16, 128, 32, g)
    scale[:, 1] *= 100
    x = torch.randn(3, 128, generator=g).to(torch.bfloat16)
    out = wo_matmul(x.to(DEVICE), qweight.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE), 32,
                    cfg=WoConfig(16, 16, 64, 4, 2))
    torch.testing.assert_close(out.cpu(), wo_matmul_ref(x, qweight, scale, zero, 32), atol=0.5, rtol=1e-2)


@pytest.mark.parametrize("m,n,k", [(1, 24, 384), (18, 40, 264)])
def test_int4_with_g_idx_matches_reference(m, n, k):
    # GPTQ's desc_act: the columns' groups in the order they were quantized, not in column order
    g = torch.Generator().manual_seed(k)
    qweight, scale, zero = _int4(n, k, 128, g)
    g_idx = (torch.randperm(k, generator=g) // 128).to(torch.int32)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    out = wo_matmul(x.to(DEVICE), qweight.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE), 128, g_idx=g_idx.to(DEVICE))
    ref = wo_matmul_ref(x, qweight, scale, zero, 128, g_idx=g_idx)
    torch.testing.assert_close(out.cpu(), ref, atol=2e-2, rtol=1e-2)
    assert not torch.allclose(ref, wo_matmul_ref(x, qweight, scale, zero, 128), atol=0.1)  # g_idx matters


@pytest.mark.parametrize("m", [1, 5])
def test_int4_g_idx_gathers_from_more_groups_than_its_columns_span(m):
    """A row-parallel rank's share of a desc_act layer (models/quant/shards.py): its 136 columns' g_idx
    names 5 groups of the whole layer, whose scales and zero points it keeps; the GEMV (one row), the
    tiles (more) and the dequantization into memory read them through g_idx."""
    from kernels.dequant import dequantize
    from kernels.gemv import wo_gemv
    from kernels.quant_reference import dequant_int4

    g = torch.Generator().manual_seed(m)
    n, k, groups = 24, 136, 5
    qweight = pack_int4(torch.randint(0, 16, (n, k), generator=g))
    scale = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    zero = torch.randint(0, 16, (n, groups), generator=g).to(torch.uint8)
    g_idx = torch.randint(0, groups, (k,), generator=g).to(torch.int32)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    dev = [t.to(DEVICE) for t in (x, qweight, scale, zero)]
    out = (wo_gemv if m == 1 else wo_matmul)(*dev, 128, g_idx=g_idx.to(DEVICE))
    torch.testing.assert_close(out.cpu(), wo_matmul_ref(x, qweight, scale, zero, 128, g_idx=g_idx), atol=2e-2, rtol=1e-2)
    if m == 1:
        w = dequantize(*dev[1:], 128, torch.bfloat16, g_idx.to(DEVICE))
        assert torch.equal(w.cpu(), dequant_int4(qweight, scale, zero, 128, torch.bfloat16, g_idx))


@pytest.mark.parametrize("group", [128, 1 << 30])
@pytest.mark.parametrize("m,n,k", [(1, 32, 256), (21, 40, 136)])
def test_fp8_weight_only_matches_reference(group, m, n, k):
    g = torch.Generator().manual_seed(m + n)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, -(-k // group) if group < k else 1, generator=g) * 0.01
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    out = wo_matmul(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), None, group)
    torch.testing.assert_close(out.cpu(), wo_matmul_ref(x, w, scale, None, group), atol=2e-2, rtol=1e-2)


def test_every_fp8_code_decodes_exactly():
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    w = codes.view(torch.float8_e4m3fn).reshape(2, 127)
    w = torch.cat([w, torch.zeros(2, 1, dtype=torch.float8_e4m3fn)], dim=1)  # K = 128
    eye = torch.eye(128, dtype=torch.float32)
    for row in range(2):  # x = identity rows pick out each decoded weight (scale 1, fp32 via bf16-exact values)
        out = wo_matmul(eye.to(torch.bfloat16).to(DEVICE), w[row:row + 1].contiguous().to(DEVICE),
                        torch.ones(1, 1, device=DEVICE), None, 1 << 30)
        assert torch.equal(out.cpu()[:, 0].float(), dequant_fp8(w[row:row + 1], torch.ones(1, 1), 1 << 30,
                                                                torch.bfloat16)[0].float())


def test_split_k_sums_the_splits_in_order():
    # decode rows with K split three ways over 128-column groups (the last split shorter), and a bias
    g = torch.Generator().manual_seed(9)
    qweight, scale, zero = _int4(24, 640, 128, g)
    x = torch.randn(6, 640, generator=g).to(torch.bfloat16)
    bias = (torch.randn(24, generator=g) * 0.1).to(torch.bfloat16)
    out = wo_matmul(x.to(DEVICE), qweight.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE), 128, bias.to(DEVICE),
                    cfg=WoConfig(16, 16, 128, 1, 1, 3))
    torch.testing.assert_close(out.cpu(), wo_matmul_ref(x, qweight, scale, zero, 128, bias), atol=2e-2, rtol=1e-2)
