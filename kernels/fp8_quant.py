"""FP8 (e4m3) activation quantization for the FP8 GEMMs: per token, per token in groups of columns,
or with one static scale; alone, or fused into the residual add + RMSNorm that produces the input.

quant_fp8 contract (semantics = ``kernels.quant_reference.quant_fp8_ref``):
  x             [M, K] float16 / bfloat16 / float32, last dim contiguous (row stride free).
  group         columns per scale: K (or more) = one scale per token; else a power of two >= 16
                (128 for the 128x128-block checkpoints): one scale per token per `group` columns,
                the last group of a row possibly partial.
  static_scale  optional fp32 tensor of one element: every element divided by it (compressed-tensors'
                static per-tensor FP8); the groups are then ignored and the scale is written per row.
  returns       (q [M, K] float8_e4m3fn contiguous, scale [M, ceil(K / group)] fp32 contiguous) with,
                per row and group, scale = max(amax(|x|) / 448, MIN_SCALE) (dynamic) and
                q = round-to-nearest-even(clamp(x / scale, -448, 448)); x ~= q * scale.

add_rmsnorm_fp8 / rmsnorm_fp8 (semantics = ``quant_fp8_ref`` of ``add_rmsnorm_ref`` / ``rmsnorm_ref``):
  the residual add (written into x in place, as kernels/rms_norm.py) and the RMSNorm in the model's
  dtype, exactly as ``add_rmsnorm``/``rmsnorm`` round them, then the normalised row quantized as
  above without being stored: the GEMM after the norm reads one byte per element instead of two
  and no launch is spent on quantizing.

silu_mul_fp8 (semantics = ``quant_fp8_ref`` of ``silu_mul_ref``): gate_up [M, 2 * inter] -> (q, scale)
  of silu(gate) * up, computed and rounded exactly as kernels/silu_mul.py's ``silu_mul`` does, then
  quantized as above: the input of an FP8 down projection in the launch that makes it.

One program per row (<= 32768 elements), except silu_mul_fp8 on rows longer than SPLIT_COLS (14336
on the Llama-3.1-8B shape): one program a row there holds the whole row in 16 warps' registers, one
such program an SM, and is latency-bound at any row count (H200, benchmarks/quant/bench_act_quant.py,
benchmarks/results/experiments/act_quant_llama-3.1-8b_h200.json: 8.7 us at one row, 18.7 at 256,
261 at 4096). It cuts each row into SPLIT_COLS-column chunks instead (3.7 / 12.0 / 151 us there):
with one scale a row (dynamic, per token), a first launch writes each chunk's silu_mul values and
their largest magnitude, a second takes the row's largest and quantizes its chunk; with a static
scale or groups (<= the chunk) one launch does a chunk whole. The values, the row's amax and the
division are those of the one-program kernel, so are the bits. The chunks' values are a buffer of
[rows, inter] in gate_up's dtype for the launch (224 MiB at 8,192 rows of the 8B shape: the start-up
memory profile's prefill step holds it too).
Exactness: the division is IEEE (div_rn) and the rounding to e4m3 is to nearest-even
(``e4m3_round``: by the conversion instruction on sm_90 and later, on the bits elsewhere:
``e4m3_cvt`` says why), so q and scale equal the reference bit for bit wherever the kernel's input
equals the reference's (the fused versions: wherever h does, see kernels/rms_norm.py).

Not checked: NaN/inf in x (a NaN amax propagates to the scale).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.rms_norm import MAX_ROW, rms_row, row_warps
from kernels.rounding import round_to
from kernels.silu_mul import silu_mul_values

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # an all-zero row still gets a finite scale (vLLM's floor)
SPLIT_MAX_ROWS = 1 << 31  # silu_mul_fp8 splits rows at any count (bench_act_quant: faster at 1 to 4096 rows)
SPLIT_COLS = 1024  # columns a program of the split silu_mul_fp8 takes (14 chunks a row on the 8B shape)


def e4m3_cvt(device: torch.device) -> bool:
    """Whether a kernel on `device` rounds to e4m3 by Triton's conversion (E4M3_CVT): on sm_90 and
    later it is one cvt.rn.satfinite.e4m3x2.f32, nearest-even. Not under the interpreter, whose
    conversion does not round to nearest-even, nor on sm_89, where Triton 3.6 converts through fp16
    truncated first (two roundings: 1.0625 + 2^-20 -> 1.0, not 1.125); there it rounds on the bits."""
    if _INTERPRET or device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@triton.jit
def e4m3_round(v, CVT: tl.constexpr):
    """v (fp32, |v| <= 448) rounded to nearest-even on e4m3's grid, as an fp32 value (which the
    GEMV of kernels/gemv.py multiplies as it is: the value an fp8 conversion would hold). CVT
    (e4m3_cvt): by the conversion instruction and back, else on the bits."""
    if CVT:
        return v.to(tl.float8e4nv).to(tl.float32)
    exp = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, -6)  # below 2^-6 the grid is the subnormals' 2^-9
    ulp = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23: adding it rounds |v / ulp| < 2^22 to an integer, ties to even
    r = ((tl.abs(v) / ulp + magic) - magic) * ulp
    return tl.where(v < 0, -r, r)  # the sign kept, -0 included


@triton.jit
def dynamic_scale(amax):
    """The dynamic scale of values whose largest magnitude is amax: max(amax / 448, MIN_SCALE)."""
    return tl.maximum(tl.math.div_rn(amax, 448.0), 1.0 / (448.0 * 512.0))


@triton.jit
def quantize_values(h, s, CVT: tl.constexpr):
    """h / s clamped to e4m3's range and rounded onto its grid (fp32 values); s broadcasts over h."""
    v = tl.math.div_rn(h, tl.zeros(h.shape, tl.float32) + s)
    return e4m3_round(tl.minimum(tl.maximum(v, -448.0), 448.0), CVT)


@triton.jit
def _quantize_row(h, mask, cols, q_row_ptr, s_row_ptr, static_ptr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                  STATIC: tl.constexpr, CVT: tl.constexpr):
    """Quantize one row held in registers (fp32 [BLOCK], 0 past the row) and store q and its scales."""
    if STATIC:
        s = tl.load(static_ptr)
        tl.store(s_row_ptr, s)
        r = quantize_values(h, s, CVT)
    elif GROUP >= BLOCK:
        s = dynamic_scale(tl.max(tl.abs(h), axis=0))
        tl.store(s_row_ptr, s)
        r = quantize_values(h, s, CVT)
    else:
        hg = tl.reshape(h, [BLOCK // GROUP, GROUP])
        s = dynamic_scale(tl.max(tl.abs(hg), axis=1))
        g = tl.arange(0, BLOCK // GROUP)
        n_groups = (tl.max(tl.where(mask, cols, 0), axis=0) // GROUP) + 1
        tl.store(s_row_ptr + g, s, mask=g < n_groups)
        r = tl.reshape(quantize_values(hg, s[:, None], CVT), [BLOCK])
    tl.store(q_row_ptr + cols, r.to(tl.float8e4nv), mask=mask)  # exact: r is on e4m3's grid


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, static_ptr, n, stride_x, stride_s, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                  STATIC: tl.constexpr, CVT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    _quantize_row(h, mask, cols, q_ptr + row * n, s_ptr + row * stride_s, static_ptr, BLOCK, GROUP, STATIC, CVT)


@triton.jit
def _norm_quant_kernel(x_ptr, y_ptr, w_ptr, q_ptr, s_ptr, static_ptr, n, eps, stride_x, stride_y, stride_s,
                       ADD: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, STATIC: tl.constexpr,
                       CVT: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_dependents(PDL)  # (kernels/pdl.py: a GEMV after it may start its weight stream)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dt = x_ptr.dtype.element_ty
    s = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        s = round_to(s + y, dt)  # the residual add in x's dtype, as torch rounds it
        tl.store(x_ptr + row * stride_x + cols, s, mask=mask)
        s = s.to(tl.float32)
    h = rms_row(s, mask, cols, n, eps, w_ptr, dt).to(tl.float32)
    _quantize_row(h, mask, cols, q_ptr + row * n, s_ptr + row * stride_s, static_ptr, BLOCK, GROUP, STATIC, CVT)


@triton.jit
def _silu_chunk(gu_ptr, inter, stride_gu, BLOCK: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    """(row, first column, local columns, mask, h): program (row, chunk)'s BLOCK columns of
    silu(gate) * up, rounded to gate_up's dtype (fp32 values, 0 past the row)."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * BLOCK
    local = tl.arange(0, BLOCK)
    mask = first + local < inter
    base = gu_ptr + row * stride_gu + first + local
    g = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(base + inter, mask=mask, other=0.0).to(tl.float32)
    return row, first, local, mask, silu_mul_values(g, u, gu_ptr.dtype.element_ty, LIBDEVICE_EXP).to(tl.float32)


@triton.jit
def _silu_quant_kernel(gu_ptr, q_ptr, s_ptr, static_ptr, inter, stride_gu, stride_s, BLOCK: tl.constexpr,
                       GROUP: tl.constexpr, STATIC: tl.constexpr, CVT: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                       PDL: tl.constexpr):
    # grid (rows, chunks): one chunk a row, or (static scale, or GROUP dividing BLOCK) chunks whole
    pdl.launch_dependents(PDL)  # (kernels/pdl.py: a GEMV after it may start its weight stream)
    row, first, local, mask, h = _silu_chunk(gu_ptr, inter, stride_gu, BLOCK, LIBDEVICE_EXP)
    s_row_ptr = s_ptr + row * stride_s
    if not STATIC:  # (a static scale is written once a row, the same by every chunk)
        s_row_ptr += first // GROUP
    _quantize_row(h, mask, local, q_ptr + row * inter + first, s_row_ptr, static_ptr, BLOCK, GROUP, STATIC, CVT)


@triton.jit
def _silu_amax_kernel(gu_ptr, h_ptr, amax_ptr, inter, stride_gu, chunks, BLOCK: tl.constexpr,
                      LIBDEVICE_EXP: tl.constexpr, PDL: tl.constexpr):
    # split, one scale a row, first launch: the chunk's values (in gate_up's dtype, exactly) and amax
    pdl.launch_dependents(PDL)
    row, first, local, mask, h = _silu_chunk(gu_ptr, inter, stride_gu, BLOCK, LIBDEVICE_EXP)
    tl.store(h_ptr + row * inter + first + local, h.to(h_ptr.dtype.element_ty), mask=mask)
    tl.store(amax_ptr + row * chunks + tl.program_id(1), tl.max(tl.abs(h), axis=0))


@triton.jit
def _chunk_quant_kernel(h_ptr, amax_ptr, q_ptr, s_ptr, inter, chunks, stride_s, BLOCK: tl.constexpr,
                        CHUNKS: tl.constexpr, CVT: tl.constexpr, PDL: tl.constexpr):
    # second launch: the row's amax from its chunks', its scale (stored by chunk 0), the chunk's q
    pdl.launch_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    c = tl.arange(0, CHUNKS)
    s = dynamic_scale(tl.max(tl.load(amax_ptr + row * chunks + c, mask=c < chunks, other=0.0), axis=0))
    if chunk == 0:
        tl.store(s_ptr + row * stride_s, s)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    h = tl.load(h_ptr + row * inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + row * inter + cols, quantize_values(h, s, CVT).to(tl.float8e4nv), mask=mask)


def _outputs(x: torch.Tensor, group: int, static_scale: torch.Tensor | None, k: int | None = None):
    m, k = x.shape[0], k or x.shape[1]
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32) and x.stride(1) == 1
    assert k <= MAX_ROW
    block = triton.next_power_of_2(k)
    if static_scale is not None:
        assert static_scale.numel() == 1 and static_scale.dtype == torch.float32
        group = block
    group = min(group, block)
    assert group >= 16 and group & (group - 1) == 0, "group: a power of two >= 16"
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, -(-k // group)), dtype=torch.float32, device=x.device)
    static = static_scale if static_scale is not None else scale  # never read when dynamic
    warps = row_warps(block)
    return q, scale, static, block, group, warps


def quant_fp8(x: torch.Tensor, group: int = 1 << 30,
              static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q fp8 [M, K], scale fp32 [M, groups]). See the module docstring."""
    q, scale, static, block, group, warps = _outputs(x, group, static_scale)
    if x.shape[0]:
        _quant_kernel[(x.shape[0],)](x, q, scale, static, x.shape[1], x.stride(0), scale.stride(0), BLOCK=block,
                                     GROUP=group, STATIC=static_scale is not None, CVT=e4m3_cvt(x.device),
                                     num_warps=warps)
    return q, scale


def add_rmsnorm_fp8(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, group: int = 1 << 30,
                    static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x += y (in place); returns (x, q, scale): RMSNorm(x) quantized as ``quant_fp8`` does."""
    assert y.shape == x.shape and y.dtype == x.dtype and y.stride(1) == 1
    assert weight.shape == (x.shape[1],) and weight.dtype == x.dtype and weight.is_contiguous()
    q, scale, static, block, group, warps = _outputs(x, group, static_scale)
    if x.shape[0]:
        _norm_quant_kernel[(x.shape[0],)](x, y, weight, q, scale, static, x.shape[1], eps, x.stride(0), y.stride(0),
                                          scale.stride(0), ADD=True, BLOCK=block, GROUP=group,
                                          STATIC=static_scale is not None, CVT=e4m3_cvt(x.device),
                                          PDL=pdl.active(x.device), num_warps=warps)
    return x, q, scale


def rmsnorm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int = 1 << 30,
                static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): RMSNorm(x) [M, K] quantized as ``quant_fp8`` does (x is not changed)."""
    assert weight.shape == (x.shape[1],) and weight.dtype == x.dtype and weight.is_contiguous()
    q, scale, static, block, group, warps = _outputs(x, group, static_scale)
    if x.shape[0]:
        _norm_quant_kernel[(x.shape[0],)](x, x, weight, q, scale, static, x.shape[1], eps, x.stride(0), x.stride(0),
                                          scale.stride(0), ADD=False, BLOCK=block, GROUP=group,
                                          STATIC=static_scale is not None, CVT=e4m3_cvt(x.device),
                                          PDL=pdl.active(x.device), num_warps=warps)
    return q, scale


def silu_mul_fp8(gate_up: torch.Tensor, group: int = 1 << 30, static_scale: torch.Tensor | None = None,
                 split_cols: int = SPLIT_COLS, split_rows: int = SPLIT_MAX_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): silu(gate_up[:, :inter]) * gate_up[:, inter:] quantized as ``quant_fp8`` does;
    rows cut into `split_cols`-column chunks (a power of two) at up to `split_rows` rows."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, "gate_up: [num_tokens, 2 * inter]"
    assert split_cols >= 16 and split_cols & (split_cols - 1) == 0, "split_cols: a power of two >= 16"
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    q, scale, static, block, group, warps = _outputs(gate_up, group, static_scale, inter)
    if m == 0:
        return q, scale
    common = dict(LIBDEVICE_EXP=not _INTERPRET and gate_up.is_cuda, PDL=pdl.active(gate_up.device))
    split = m <= split_rows and block > split_cols
    chunks, chunk_warps = -(-inter // split_cols), 1 if _INTERPRET else 4
    if split and (static_scale is not None or group <= split_cols):  # whole chunks in one launch
        _silu_quant_kernel[(m, chunks)](gate_up, q, scale, static, inter, gate_up.stride(0), scale.stride(0),
                                        BLOCK=split_cols, GROUP=min(group, split_cols), STATIC=static_scale is not None,
                                        CVT=e4m3_cvt(gate_up.device),
                                        num_warps=chunk_warps, **common)
    elif split and group >= block:  # one scale a row: the chunks' values and amax, then the row's scale and q
        h = torch.empty((m, inter), dtype=gate_up.dtype, device=gate_up.device)
        amax = torch.empty((m, chunks), dtype=torch.float32, device=gate_up.device)
        _silu_amax_kernel[(m, chunks)](gate_up, h, amax, inter, gate_up.stride(0), chunks, BLOCK=split_cols,
                                       num_warps=chunk_warps, **common)
        _chunk_quant_kernel[(m, chunks)](h, amax, q, scale, inter, chunks, scale.stride(0), BLOCK=split_cols,
                                         CHUNKS=triton.next_power_of_2(chunks), CVT=e4m3_cvt(gate_up.device),
                                         PDL=common["PDL"], num_warps=chunk_warps)
    else:
        _silu_quant_kernel[(m, 1)](gate_up, q, scale, static, inter, gate_up.stride(0), scale.stride(0), BLOCK=block,
                                   GROUP=group, STATIC=static_scale is not None, CVT=e4m3_cvt(gate_up.device),
                                   num_warps=warps, **common)
    return q, scale
