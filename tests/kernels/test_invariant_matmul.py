"""invariant_linear against linear_ref, and its contract: a row's bits do not depend on the batch
(TRITON_INTERPRET=1 on CPU, see tests/conftest.py; the same tests run on the GPU).

The invariance tests compute the same rows inside batches of 1, 7 and 64 rows (and 200, more than
one row tile), with other rows of random or NaN-free garbage around them, and compare bitwise.
"""

from __future__ import annotations

import pytest
import torch

from kernels import invariant_matmul as im
from kernels.invariant_matmul import config, invariant_linear
from kernels.reference import linear_ref

from tests.helpers import bits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 40, 24), (7, 96, 72), (70, 33, 130), (5, 2100, 40)]  # (M, K, N): K and N not multiples
# of the tiles; the last K is wider than one segment (summed in 1024-column segments)


def _rand(g, *shape, dtype):
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("bias,gelu", [(False, False), (True, False), (True, True)])
def test_matches_reference(dtype, m, k, n, bias, gelu):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w = _rand(g, m, k, dtype=dtype), _rand(g, n, k, dtype=dtype) / k**0.5
    b = _rand(g, n, dtype=dtype) if bias else None
    out = invariant_linear(x, w, b, gelu=gelu)
    ref = linear_ref(x, w, b, gelu=gelu)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_rows_are_batch_invariant():
    """The same 3 rows inside batches of 1, 7, 64 and 200 rows, at different offsets: bitwise equal."""
    g = torch.Generator().manual_seed(7)
    k, n = 100, 70
    w, b = _rand(g, n, k, dtype=torch.float16) / 10, _rand(g, n, dtype=torch.float16)
    probe = _rand(g, 3, k, dtype=torch.float16)
    alone = torch.cat([invariant_linear(probe[i : i + 1], w, b, gelu=True) for i in range(3)])
    for batch in (7, 64, 200, 1500):  # on the GPU: every config bucket
        x = _rand(g, batch, k, dtype=torch.float16) * 5  # other rows of a very different scale
        at = torch.randperm(batch, generator=g)[:3].to(DEVICE)
        x[at] = probe
        out = invariant_linear(x, w, b, gelu=True)
        assert torch.equal(bits(out[at]), bits(alone)), f"rows changed inside a batch of {batch}"


def test_strided_rows_and_out():
    """x with a row stride (a view of a wider tensor) and a given out."""
    g = torch.Generator().manual_seed(3)
    wide = _rand(g, 9, 80, dtype=torch.float16)
    x = wide[:, :48]
    w = _rand(g, 20, 48, dtype=torch.float16)
    out = torch.full((9, 20), float("nan"), device=DEVICE, dtype=torch.float16)
    invariant_linear(x, w, out=out)
    assert torch.equal(bits(out), bits(invariant_linear(x.contiguous(), w)))
    assert invariant_linear(x[:0], w).shape == (0, 20)


def test_config_choice(monkeypatch):
    """The GPU rule: small tiles for decode rows; past them, the largest tile that still fills the
    GPU (128x256 only for unsegmented weights), else small or narrow tiles; every config a 64- or
    128-row wgmma tile (whose bits agree, see kernels/invariant_matmul.py). After a failed start-up
    check, SMALL for every launch."""
    monkeypatch.setattr(im, "_INTERPRET", False)
    assert all(c.block_m in (64, 128) and c.num_warps % 4 == 0 for c in im.CONFIGS)
    assert config(768, 3072, 1) == config(768, 3072, 128) == im.NARROW  # 24 tiles x 3 segments at one row
    assert config(2048, 8192, 1) == im.SMALL  # 64 x 8 segments: narrow would be 512 programs
    assert config(768, 768, 256) == im.NARROW and config(2304, 768, 256) == im.SMALL
    assert config(768, 3072, 1024) == im.SMALL  # MEDIUM would be 48 tiles
    assert config(50304, 768, 129) == im.LARGE and config(50304, 768, 8192) == im.LARGE
    assert config(2048, 8192, 8192) == im.MEDIUM  # segmented: never LARGE
    assert config(2048, 2048, 1024) == im.MEDIUM  # LARGE would be 64 tiles, MEDIUM 128
    monkeypatch.setattr(im, "_configs_ok", False)
    assert {config(n, k, m) for n, k in ((768, 3072), (50304, 768)) for m in (1, 256, 8192)} == {im.SMALL}


def test_check_configs():
    """On the GPU the check must pass (the H100 gives the same bits for every config); off it, a no-op."""
    assert im.check_configs(torch.device(DEVICE)) == im.ConfigCheck(configs_agree=True, split_agrees=True)
    assert im._configs_ok and im._split_ok


def test_one_row_with_a_parent_stride():
    """A one-row slice of a wider tensor gives the same bits as the row in a dense batch."""
    g = torch.Generator().manual_seed(4)
    parent = _rand(g, 1, 64, dtype=torch.float16)
    x = parent[:, :48]
    w = _rand(g, 20, 48, dtype=torch.float16)
    dense = torch.cat([x, _rand(g, 3, 48, dtype=torch.float16)])
    assert torch.equal(bits(invariant_linear(x, w)[0]), bits(invariant_linear(dense, w)[0]))


def test_segments_are_fixed_by_k():
    """The summation order is a function of the weight's width alone."""
    assert im.segment_k(768) == 768 and im.segment_k(2048) == 2048
    assert im.segment_k(3072) == im.segment_k(8192) == im.SEGMENT_K == 1024


@pytest.mark.parametrize("bias,gelu", [(False, False), (True, True)])
def test_split_over_segments_is_bitwise_unsplit(bias, gelu, monkeypatch):
    """A weight of several K segments: rows computed alone and in small batches (segments spread
    over programs, the last to arrive folding) and inside a batch too large to split (segments
    folded in one program) compare bitwise; the arrival counters are back to zero after each launch."""
    g = torch.Generator().manual_seed(11)
    k, n = 2100, 40
    w = _rand(g, n, k, dtype=torch.float16) / k**0.5
    b = _rand(g, n, dtype=torch.float16) if bias else None
    x = _rand(g, 200, k, dtype=torch.float16)
    cfg = config(n, k, 1)
    monkeypatch.setattr(im, "SPLIT_MAX_TILES", 2)  # 200 rows are 4 tiles: folded in one program
    assert im.split_k(1, n, k, cfg, im.segment_k(k)) and not im.split_k(200, n, k, config(n, k, 200), im.segment_k(k))
    whole = invariant_linear(x, w, b, gelu=gelu)
    for rows in (slice(0, 1), slice(5, 12), slice(100, 170)):
        for split in (True, False):
            part = invariant_linear(x[rows], w, b, gelu=gelu, split=split)
            assert torch.equal(bits(part), bits(whole[rows])), f"rows {rows} split={split}"
            assert not im._arrival_counts(x.device, 1).any() if split else True
    # one segment of the whole width: another summation order, the same values up to rounding
    one = invariant_linear(x[:8], w, b, gelu=gelu, seg_k=4096)
    torch.testing.assert_close(one.float(), whole[:8].float(), atol=4e-3, rtol=4e-3)
