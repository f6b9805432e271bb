"""benchmarks/quant/bench_act_quant.py times ours against the torch chain vLLM's graph compiles: on the
CPU that chain, eagerly, gives silu_mul_fp8's bits, so the two cases compute the same function."""

import torch

from benchmarks.quant.bench_act_quant import silu_quant_torch
from kernels.fp8_quant import silu_mul_fp8


def test_the_peer_chain_is_silu_mul_fp8():
    torch.manual_seed(0)
    gate_up = torch.randn(5, 2 * 96, dtype=torch.bfloat16) * 3
    gate_up[2] = 0.0  # an all-zero row: the scale's floor
    q, s = silu_quant_torch(gate_up)
    for split in (0, 1 << 30):  # one program a row, and rows cut into 32-column chunks
        ours_q, ours_s = silu_mul_fp8(gate_up, split_cols=32, split_rows=split)
        assert torch.equal(ours_q.view(torch.uint8), q.view(torch.uint8)), split
        assert torch.equal(ours_s, s), split
