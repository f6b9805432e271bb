"""benchmarks/quant/bench_act_quant.py times ours against the torch chain vLLM's graph compiles: on the
CPU that chain, eagerly, computes silu_mul_fp8's function (the same scales, q within one e4m3 step:
torch's CPU exp and the interpreter's may differ in fp32's last bit, kernels/silu_mul.py)."""

import torch

from benchmarks.quant.bench_act_quant import silu_quant_torch
from kernels.fp8_quant import silu_mul_fp8


def test_the_peer_chain_is_silu_mul_fp8():
    torch.manual_seed(0)
    gate_up = torch.randn(5, 2 * 96, dtype=torch.bfloat16) * 3
    gate_up[2] = 0.0  # an all-zero row: the scale's floor
    q, s = silu_quant_torch(gate_up)
    assert s[2].item() == torch.tensor(1.0 / (448.0 * 512.0)).item()  # (in fp32)
    for split in (0, 1 << 30):  # one program a row, and rows cut into 32-column chunks
        ours_q, ours_s = silu_mul_fp8(gate_up, split_cols=32, split_rows=split)
        torch.testing.assert_close(ours_s, s, rtol=2 ** -7, atol=0)  # amax within a bf16 ulp
        step = q.float().abs() * 2 ** -3 + 2 ** -9  # one e4m3 step (the subnormals' 2^-9 near zero)
        assert ((ours_q.float() - q.float()).abs() <= step).all(), split
        assert (ours_q.float() == q.float()).float().mean() > 0.99, split
