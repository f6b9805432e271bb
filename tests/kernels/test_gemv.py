"""The decode GEMVs (kernels/gemv.py) against their references, under the interpreter on the CPU:
FP8 weights per channel and in 128-column blocks, the input quantized before or in the GEMV (bit
for bit the same row as kernels/fp8_quant.py's), int4 in groups (a partial last group, groups of
32), per channel and with GPTQ's g_idx, fp8 weights decoded from their bits; N not a multiple of
the tile, K splits that do not divide K evenly, bias, output dtypes."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_quant import quant_fp8
from kernels.gemv import GemvConfig, fp8_gemv, gemv16, wo_gemv
from kernels.quant_reference import dequant_fp8, fp8_matmul_ref, pack_int4, quant_fp8_ref, wo_matmul_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPLITS = [GemvConfig(32, 256, 1, 1), GemvConfig(16, 128, 1, 3)]  # one split; three over K (uneven)


def _fp8_operands(n, k, group, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, k, generator=g) * 3).to(torch.bfloat16)
    w, ws = quant_fp8_ref(torch.randn(n, k, generator=g) * 0.05, group)
    return x.to(DEVICE), w.to(DEVICE), ws.to(DEVICE)


@pytest.mark.parametrize("cfg", SPLITS)
@pytest.mark.parametrize("group,n,k", [(1 << 30, 40, 200), (128, 33, 384), (128, 50, 200)])
def test_fp8_gemv_matches_reference(cfg, group, n, k):
    x, w, ws = _fp8_operands(n, k, group, n + k)
    xq, xs = quant_fp8(x, group)
    bias = (torch.randn(n) * 0.1).to(torch.bfloat16).to(DEVICE) if n % 2 else None
    out = fp8_gemv(xq, xs, w, ws, group, torch.bfloat16, bias, cfg=cfg)
    ref = fp8_matmul_ref(xq.cpu(), xs.cpu(), w.cpu(), ws.cpu(), group, torch.float32,
                         None if bias is None else bias.cpu())
    assert out.shape == (1, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().float(), ref, atol=1e-2, rtol=8e-3)  # one bf16 rounding
    exact = fp8_gemv(xq, xs, w, ws, group, torch.float32, cfg=cfg)
    torch.testing.assert_close(exact.cpu(), fp8_matmul_ref(xq.cpu(), xs.cpu(), w.cpu(), ws.cpu(), group,
                                                           torch.float32), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cfg", SPLITS)
@pytest.mark.parametrize("act", ["token", "group128", "static"])
def test_fp8_gemv_quantizes_its_input_as_quant_fp8_does(cfg, act):
    # A 16-bit row quantized in the GEMV gives the bits of quant_fp8's row through the same GEMV
    # (every program quantizes its own K range; the per-token scale needs the whole row's amax).
    group = 128 if act == "group128" else 1 << 30
    x, w, ws = _fp8_operands(40, 392, group, 7)
    x[0, 5] = 40.0  # one large value sets the token's scale, wherever its split is
    static = torch.tensor([0.03], device=DEVICE) if act == "static" else None
    fused = fp8_gemv(x, None, w, ws, group, torch.float32, None, group, static, cfg=cfg)
    xq, xs = quant_fp8(x, group, static)
    assert torch.equal(fused, fp8_gemv(xq, xs, w, ws, group, torch.float32, cfg=cfg))


@pytest.mark.parametrize("cfg", SPLITS)
@pytest.mark.parametrize("group,n,k", [(1 << 30, 40, 200), (128, 33, 384), (128, 50, 200)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_gemv_of_an_unquantized_row(cfg, group, n, k, dtype):
    # weight_only (w8a16): the 16-bit row as it is times the weight dequantized in fp32
    x, w, ws = _fp8_operands(n, k, group, 3 * n + k)
    x = x.to(dtype)
    bias = (torch.randn(n) * 0.1).to(DEVICE) if n % 2 or group > k else None  # per channel with bias too
    out = fp8_gemv(x, None, w, ws, group, torch.float32, bias, cfg=cfg, weight_only=True)
    ref = x.cpu().double() @ dequant_fp8(w.cpu(), ws.cpu(), group, torch.float64).t()
    ref = ref if bias is None else ref + bias.cpu().double()
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-5)
    rounded = fp8_gemv(x, None, w, ws, group, dtype, None if bias is None else bias.to(dtype), cfg=cfg,
                       weight_only=True)
    assert rounded.dtype == dtype and torch.isfinite(rounded).all()
    with pytest.raises(AssertionError):  # an FP8 row has its scale: not weight-only
        fp8_gemv(*quant_fp8(x, group), w, ws, group, torch.float32, cfg=cfg, weight_only=True)


def _int4(n, k, group, seed, gidx=False):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group) if group < k else 1
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    zero = torch.randint(0, 16, (n, groups), generator=g).to(torch.uint8)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    g_idx = (torch.randperm(k, generator=g) // group).to(torch.int32) if gidx else None
    return x, pack_int4(q), scale, zero, g_idx


@pytest.mark.parametrize("cfg", SPLITS)
@pytest.mark.parametrize("group,n,k,gidx", [(128, 40, 256, False), (128, 33, 200, False), (32, 17, 136, False),
                                            (1 << 30, 24, 264, False), (128, 24, 384, True)])
def test_int4_gemv_matches_reference(cfg, group, n, k, gidx):
    x, qw, scale, zero, g_idx = _int4(n, k, group, n * k, gidx)
    bias = (torch.randn(n) * 0.1).to(torch.bfloat16) if n % 2 else None
    dev = [t.to(DEVICE) if t is not None else None for t in (x, qw, scale, zero, bias, g_idx)]
    out = wo_gemv(*dev[:4], group, dev[4], dev[5], cfg=cfg)
    ref = wo_matmul_ref(x, qw, scale, zero, group, bias, g_idx)
    # the weight stays in fp32 here (the reference rounds it to bf16 first): within bf16's rounding
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=2e-2, rtol=1e-2)
    if gidx:
        assert not torch.allclose(ref, wo_matmul_ref(x, qw, scale, zero, group), atol=0.1)  # g_idx matters


@pytest.mark.parametrize("cfg", SPLITS)
@pytest.mark.parametrize("group,n,k,dtype,symmetric", [(128, 33, 200, torch.bfloat16, False),
                                                       (32, 17, 136, torch.float16, True),
                                                       (128, 40, 128, torch.float16, False),
                                                       (1 << 30, 24, 264, torch.bfloat16, True)])
def test_int4_half2_gemv_matches_reference(cfg, group, n, k, dtype, symmetric):
    """wo_gemv's half2 option (kernels/gemv_int4.py): a partial last group, groups of 32, one group,
    per channel; symmetric zeros (8) and not; bf16 and fp16 rows; bias on odd N. Within the default
    loop's tolerance of the reference, and near the default loop (fp16 sums of four products)."""
    x, qw, scale, zero, _ = _int4(n, k, group, n + k)
    if symmetric:
        zero = torch.full_like(zero, 8)
    x = x.to(dtype)
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.1).to(dtype) if n % 2 else None
    dev = [t.to(DEVICE) if t is not None else None for t in (x, qw, scale, zero, bias)]
    out = wo_gemv(*dev[:4], group, dev[4], cfg=cfg, half2=True)
    ref = wo_matmul_ref(x, qw, scale, zero, group, bias)
    assert out.shape == (1, n) and out.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=2e-2, rtol=1e-2)
    default = wo_gemv(*dev[:4], group, dev[4], cfg=cfg).cpu().float()
    # near the default loop: fp32 sums a little apart may round to neighbouring outputs (bf16: 2^-7 apart;
    # the bias drawn from the global generator once made one such pair fail 4e-3)
    torch.testing.assert_close(out.cpu().float(), default, atol=8e-3, rtol=8e-3 if dtype == torch.bfloat16 else 4e-3)


@pytest.mark.parametrize("cfg", SPLITS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the plain loop's, on purpose
def test_int4_half2_prescale_takes_any_range(cfg, dtype):
    """half2 with prescale: columns of |x| 3000-30000 (as down_proj's inputs can hold, in one K step
    and not the other) overflow the plain half2 loop's fp16 sums (inf / NaN out); each step scaled
    by its power of two gives the default loop's result, and where x is small the plain loop's bits."""
    n, k, group = 33, 264, 128
    x, qw, scale, zero, _ = _int4(n, k, group, 7)
    big = x.clone().float()
    big[0, [3, 40, 41]] = torch.tensor([3000.0, -30000.0, 12000.0])  # the first K step (of 256) only
    dev = [t.to(DEVICE) for t in (big.to(dtype), qw, scale, zero)]
    plain = wo_gemv(*dev, group, cfg=cfg, half2=True).cpu().float()
    assert not plain.isfinite().all()  # what the prescale is for
    out = wo_gemv(*dev, group, cfg=cfg, half2=True, prescale=True).cpu().float()
    default = wo_gemv(*dev, group, cfg=cfg).cpu().float()
    torch.testing.assert_close(out, default, atol=1e-2 * default.abs().max().item(), rtol=4e-3)
    small = [t.to(DEVICE) for t in (x.to(dtype), qw, scale, zero)]  # every step's max below 512: scale 1
    assert torch.equal(wo_gemv(*small, group, cfg=cfg, half2=True, prescale=True),
                       wo_gemv(*small, group, cfg=cfg, half2=True))


@pytest.mark.parametrize("cfg", SPLITS)
@pytest.mark.parametrize("group", [128, 1 << 30])
def test_fp8_weight_only_gemv_matches_reference(cfg, group):
    g = torch.Generator().manual_seed(group % 97)
    n, k = 36, 272
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, -(-k // group) if group < k else 1, generator=g) * 0.01
    x = torch.randn(1, k, generator=g).to(torch.float16)
    out = wo_gemv(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), None, group, cfg=cfg)
    torch.testing.assert_close(out.cpu(), wo_matmul_ref(x, w, scale, None, group), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("cfg", SPLITS)
@pytest.mark.parametrize("n,k", [(1, 1), (40, 200), (33, 384), (50, 517)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv16_matches_reference(cfg, n, k, dtype):
    # a 16-bit weight at one row: output channels and K off the tiles, K split unevenly, with and
    # without a bias; one rounding of the fp32 sum to the row's dtype
    g = torch.Generator().manual_seed(n * 1000 + k)
    x = (torch.randn(1, k, generator=g) * 3).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    bias = (torch.randn(n, generator=g) * 0.1).to(dtype) if n % 2 else None
    out = gemv16(x.to(DEVICE), w.to(DEVICE), None if bias is None else bias.to(DEVICE), cfg=cfg)
    ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    assert out.shape == (1, n) and out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-2, rtol=8e-3)  # one 16-bit rounding
    # against the same sum rounded once: at most one unit in the last place apart (fp32 order)
    ulp = (ref.abs() * 2.0 ** (-7 if dtype == torch.bfloat16 else -10)).clamp(min=2.0 ** -20)
    assert ((out.cpu().double() - ref.to(dtype).double()).abs() <= ulp).all()
    with pytest.raises(AssertionError):  # the weight in the row's dtype, one row
        gemv16(x.to(DEVICE), w.float().to(DEVICE), cfg=cfg)


def test_no_output_channels():
    x, w, ws = _fp8_operands(0, 128, 1 << 30, 0)
    xq, xs = quant_fp8(x)
    assert fp8_gemv(xq, xs, w, ws.reshape(0, 1), 1 << 30, torch.bfloat16).shape == (1, 0)


def test_the_gpu_configs_are_the_sweeps_picks(monkeypatch):
    """kernels/gemv.config on a GPU: the tiles bench_quant's H100 sweep found fastest at one row for
    each Llama-3.1-8B linear (benchmarks/results/quant_gemv_h100.json's `tuned`), and for the
    unquantized row the H200's (experiments/quant_w8a16_sweep_h200.json)."""
    import json
    from pathlib import Path

    import kernels.gemv as gemv

    monkeypatch.setattr(gemv, "_INTERPRET", False)
    tuned = json.loads((Path(__file__).parents[2] / "benchmarks/results/quant_gemv_h100.json").read_text())["tuned"]
    for key, cfg in tuned.items():
        fmt, n, k = key.split()
        if fmt in ("fp8", "int4"):  # (the half2 loop's picks are its own: an option, not config()'s)
            assert list(gemv.config(int(n), int(k), fmt == "int4")) == cfg, key
    # fp8_gemv of a 16-bit row (weight_only): the H200's sweep
    tuned = json.loads((Path(__file__).parents[2] / "benchmarks/results/experiments/quant_w8a16_sweep_h200.json").read_text())
    for key, cfg in tuned["tuned"].items():
        fmt, n, k = key.split()
        if fmt == "fp8_w8a16":
            assert list(gemv.config(int(n), int(k), False, w8a16=True)) == cfg, key
