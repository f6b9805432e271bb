"""The weight dequantized into memory (kernels/dequant.py) equals its reference bit for bit, under the
interpreter on the CPU: int4 with zero points in groups (a partial last group), per channel and with
GPTQ's g_idx; fp8 per channel and in 128-column blocks; every output dtype."""

from __future__ import annotations

import pytest
import torch

from kernels.dequant import dequantize
from kernels.quant_reference import dequant_fp8, dequant_int4, pack_int4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("group,k,gidx", [(128, 392, False), (64, 200, False), (1 << 30, 136, False), (128, 384, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int4_dequantized_as_the_cpu_path_does(group, k, gidx, dtype):
    g = torch.Generator().manual_seed(k)
    n, groups = 20, -(-k // group) if group < k else 1
    qweight = pack_int4(torch.randint(0, 16, (n, k), generator=g))
    scale = torch.rand(n, groups, generator=g) * 0.05
    zero = torch.randint(0, 16, (n, groups), generator=g).to(torch.uint8)
    g_idx = (torch.randperm(k, generator=g) // group).to(torch.int32) if gidx else None
    out = dequantize(qweight.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE), group, dtype,
                     None if g_idx is None else g_idx.to(DEVICE))
    assert torch.equal(out.cpu(), dequant_int4(qweight, scale, zero, group, dtype, g_idx))


@pytest.mark.parametrize("group", [128, 1 << 30])
def test_fp8_dequantized_as_the_cpu_path_does(group):
    g = torch.Generator().manual_seed(1)
    n, k = 17, 300
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, -(-k // group) if group < k else 1, generator=g)
    out = dequantize(w.to(DEVICE), scale.to(DEVICE), None, group, torch.bfloat16)
    assert torch.equal(out.cpu(), dequant_fp8(w, scale, group, torch.bfloat16))
