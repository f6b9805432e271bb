"""add_layernorm and embed against their references (TRITON_INTERPRET=1 on CPU; see tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_norm import add_layernorm, embed, embed_layernorm
from kernels.reference import add_layernorm_ref, embed_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 8e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,hidden", [(1, 768), (7, 96), (33, 100), (0, 64)])
def test_add_layernorm_matches_reference(dtype, n, hidden):
    g = torch.Generator().manual_seed(n * 1000 + hidden)
    x = (torch.randn(n, hidden, generator=g) * 3).to(dtype).to(DEVICE)
    y = torch.randn(n, hidden, generator=g).to(dtype).to(DEVICE)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype).to(DEVICE)
    b = torch.randn(hidden, generator=g).to(dtype).to(DEVICE)
    ref_s, ref_h = add_layernorm_ref(x.clone(), y, w, b, 1e-5)
    x_in = x.clone()
    s, h = add_layernorm(x_in, y, w, b, 1e-5)
    assert s.data_ptr() == x_in.data_ptr()  # the residual stream is updated in place
    torch.testing.assert_close(s, ref_s, rtol=0, atol=TOL[dtype] * 4)
    torch.testing.assert_close(h, ref_h, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_embed_matches_reference(dtype, id_dtype):
    g = torch.Generator().manual_seed(3)
    wte = torch.randn(97, 40, generator=g).to(dtype).to(DEVICE)
    wpe = torch.randn(31, 40, generator=g).to(dtype).to(DEVICE)
    for n in (1, 5, 64):
        ids = torch.randint(0, 97, (n,), generator=g).to(id_dtype).to(DEVICE)
        pos = torch.randint(0, 31, (n,), generator=g).to(id_dtype).to(DEVICE)
        ids[-1], pos[-1] = 96, 30  # the last rows of both tables
        # Exact, up to one bf16 rounding step (Triton's interpreter rounds bf16 differently from torch).
        rtol = 8e-3 if dtype == torch.bfloat16 else 0
        torch.testing.assert_close(embed(ids, pos, wte, wpe), embed_ref(ids, pos, wte, wpe), rtol=rtol, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_embed_placeholders_and_first_norm(dtype, id_dtype):
    """Ids -1 - r read the previous step's sampled id r on the device; embed_layernorm also gives
    the first block's pre-norm, as add_layernorm would."""
    g = torch.Generator().manual_seed(5)
    hidden = 48
    wte = torch.randn(97, hidden, generator=g).to(dtype).to(DEVICE)
    wpe = torch.randn(31, hidden, generator=g).to(dtype).to(DEVICE)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype).to(DEVICE)
    b = torch.randn(hidden, generator=g).to(dtype).to(DEVICE)
    sampled = torch.tensor([96, 3, 40, 7], dtype=torch.int32, device=DEVICE)
    ids = torch.tensor([5, -1, -4, 0, -3, 96, -2], dtype=id_dtype, device=DEVICE)
    pos = torch.tensor([0, 30, 2, 3, 4, 5, 6], dtype=id_dtype, device=DEVICE)
    ref = embed_ref(ids, pos, wte, wpe, sampled)
    assert torch.equal(ref[1].float(), (wte[96] + wpe[30]).float())  # the reference resolves placeholders
    rtol = 8e-3 if dtype == torch.bfloat16 else 0
    torch.testing.assert_close(embed(ids, pos, wte, wpe, sampled), ref, rtol=rtol, atol=0)
    x, h = embed_layernorm(ids, pos, wte, wpe, w, b, 1e-5, sampled)
    torch.testing.assert_close(x, ref, rtol=rtol, atol=0)
    ref_h = torch.nn.functional.layer_norm(ref.float(), (hidden,), w.float(), b.float(), 1e-5).to(dtype)
    torch.testing.assert_close(h, ref_h, rtol=TOL[dtype], atol=TOL[dtype])
    x0, h0 = embed_layernorm(ids[:0], pos[:0], wte, wpe, w, b, 1e-5)
    assert x0.shape == h0.shape == (0, hidden)
