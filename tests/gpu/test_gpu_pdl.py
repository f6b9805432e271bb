"""Programmatic dependent launch on a GPU (skipped without CUDA or below compute capability 9.0):
with --enable-pdl the engine (CUDA graphs, asynchronous scheduling) gives the same greedy tokens and
logprobs, bit for bit, as without it, at batch 1 and 13, for a 16-bit, an FP8_DYNAMIC and an AWQ
checkpoint; and the decode GEMVs alone give the same bits launched either way (kernels/pdl.py).
The GEMVs (one row: every checkpoint at batch 1, the 16-bit one through gemv16) are the kernels
launched with PDL, where a missing wait would read a half-written input; elsewhere (13 rows) only
the norms', silu_mul's and the attention's triggers differ."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs a CUDA GPU of compute capability 9.0+")

LLAMA = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, intermediate_size=2816,
             num_hidden_layers=3, vocab_size=2048, max_position_embeddings=1024, initializer_range=0.02)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from benchmarks.quant.quant_checkpoint import quantize_checkpoint
    from tests.helpers import make_llama_checkpoint

    root = tmp_path_factory.mktemp("gpu-pdl")
    src = make_llama_checkpoint(root / "bf16", "llama", **LLAMA)
    out = {"bf16": src}
    for fmt in ("fp8-dynamic", "awq"):
        quantize_checkpoint(src, root / fmt, fmt, device="cuda")
        out[fmt] = root / fmt
    return out


def _run(path, prompts, enable_pdl):
    from server.config import EngineConfig
    from server.engine import LLMEngine
    from server.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="bfloat16", num_blocks=1024,
                                 enable_pdl=enable_pdl))
    try:
        outs = eng.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1))
        return [(o.token_ids, [lp[0] for lp in o.new_logprobs]) for o in outs]
    finally:
        eng.close()
        from kernels import pdl

        pdl.enable(False)


@pytest.mark.parametrize("fmt", ["bf16", "fp8-dynamic", "awq"])
def test_pdl_gives_the_same_bits(checkpoints, fmt):
    from tests.gpu.test_gpu_parity import _prompts

    for prompts in (_prompts(1, 50, 50, seed=5), _prompts(12, 1, 200) + [[7]]):
        assert _run(checkpoints[fmt], prompts, True) == _run(checkpoints[fmt], prompts, False), (fmt, len(prompts))


def test_the_gemvs_launched_with_pdl_give_the_same_bits():
    from kernels import pdl
    from kernels.fp8_quant import quant_fp8
    from kernels.gemv import fp8_gemv, gemv16, wo_gemv
    from kernels.quant_reference import pack_int4, quant_fp8_ref

    g = torch.Generator().manual_seed(0)
    n, k = 4096, 4096
    x = torch.randn(1, k, generator=g).to(torch.bfloat16).cuda()
    w16 = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    w8, s8 = (t.cuda() for t in quant_fp8_ref(w16.float(), 1 << 30))
    w16 = w16.cuda()
    q4 = pack_int4(torch.randint(0, 16, (n, k), generator=g)).cuda()
    s4 = torch.rand(n, k // 128, generator=g).cuda() * 0.02
    z4 = torch.randint(0, 16, (n, k // 128), generator=g).to(torch.uint8).cuda()
    xq, xs = quant_fp8(x)

    def all_gemvs():
        return [fp8_gemv(xq, xs, w8, s8, 1 << 30, torch.bfloat16), fp8_gemv(x, None, w8, s8, 1 << 30, torch.bfloat16),
                wo_gemv(x, q4, s4, z4, 128), wo_gemv(x, q4, s4, z4, 128, half2=True),
                wo_gemv(x, q4, s4, z4, 128, half2=True, prescale=True), gemv16(x, w16)]

    plain = all_gemvs()
    try:
        pdl.enable(True)
        assert pdl.active(x.device)
        with_pdl = all_gemvs()
    finally:
        pdl.enable(False)
    for a, b in zip(plain, with_pdl):
        assert torch.equal(a, b)
