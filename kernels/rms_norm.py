"""RMSNorm, alone or fused with the residual add before it.

add_rmsnorm contract (semantics = ``kernels.reference.add_rmsnorm_ref``):
  x, y      [num_tokens, hidden] float16 / bfloat16 / float32, the same dtype, last dim contiguous
            (row strides free). x is the residual stream, y what a sub-layer adds to it.
  weight    [hidden], x's dtype, contiguous.
  out       optional [num_tokens, hidden] x's dtype, last dim contiguous, for h (allocated when None).
  returns   (s, h): s = x + y rounded to x's dtype, written into x IN PLACE (s is x), and
            h = RMSNorm(s) as ``rmsnorm`` computes it.

rmsnorm contract (semantics = ``kernels.reference.rmsnorm_ref``):
  x         [num_tokens, hidden] or [num_tokens, heads, head_dim] (per-head Q/K norms), normalised
            over the last dim; last dim contiguous, the other strides free (a view of a merged QKV
            output works without a copy).
  weight    [last dim], x's dtype, contiguous.
  out       optional, x's shape and dtype, last dim contiguous (allocated contiguous when None;
            out=x normalises in place).
  returns   h = weight * (x * rsqrt(mean(x^2) + eps)), as transformers' RMSNorm computes it: the mean
            square and the normalisation in fp32, that rounded to x's dtype, THEN multiplied by the
            weight with the product rounded to x's dtype (kernels/rounding.py).

One program per row (a token, or a token's head); the row must fit one block (<= 32768 elements).

Bit-exactness vs torch: the add, both roundings and the weight product are exact; only the fp32
sum of squares is reduced in a different order than torch's (and on the GPU torch's mean and rsqrt
are its own), so rsqrt(mean + eps) can differ from torch's in the last bits of fp32, and an element
of normalised x can round to its neighbour (1 ulp), which the weight product can stretch to 2 ulp.
s is always bit-identical; h matches torch to <= 2 ulp of the model dtype with nearly every element
identical. Measured on an H100 (triton 3.6) against the model's RMSNorm, 4096 x 4096: fp16 411 of
16.8M elements differ (max 2 ulp), bf16 36 (max 1 ulp), fp32 15% (max 5 ulp of fp32); per-head
rows of 128: none. Under the interpreter: about 1 in 50000 (fp16/bf16).

Not checked: NaN/inf in the input (they propagate as in torch), aliasing of out with x other than
out=x exactly.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.rounding import round_to

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAX_ROW = 32768


@triton.jit
def rms_row(s, mask, cols, n, eps, w_ptr, dt: tl.constexpr):
    """weight * round(s * rsqrt(mean(s^2) + eps)) rounded to dt; s a [BLOCK] fp32 row (0 past n).
    Also the norm of kernels/fp8_quant.py's fused norm-and-quantize kernels."""
    rstd = tl.math.rsqrt(tl.sum(s * s, axis=0) / n + eps)
    hn = round_to(s * rstd, dt).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return round_to(w * hn, dt)


@triton.jit
def _rms_store(s, mask, cols, n, eps, w_ptr, h_row_ptr):
    """h_row = weight * round(s * rsqrt(mean(s^2) + eps)); s a [BLOCK] fp32 row (0 past n)."""
    tl.store(h_row_ptr + cols, rms_row(s, mask, cols, n, eps, w_ptr, h_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rmsnorm_kernel(x_ptr, y_ptr, w_ptr, h_ptr, n, eps, stride_x, stride_y, stride_h, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    pdl.launch_dependents(PDL)  # (kernels/pdl.py: a GEMV after it may start its weight stream)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    s = round_to(x + y, x_ptr.dtype.element_ty)  # the residual add in x's dtype, as torch rounds it
    tl.store(x_ptr + row * stride_x + cols, s, mask=mask)
    _rms_store(s.to(tl.float32), mask, cols, n, eps, w_ptr, h_ptr + row * stride_h)


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, h_ptr, n, eps, heads, stride_xt, stride_xh, stride_ht, stride_hh,
                    BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    tok = pid // heads
    head = pid % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    s = tl.load(x_ptr + tok * stride_xt + head * stride_xh + cols, mask=mask, other=0.0).to(tl.float32)
    _rms_store(s, mask, cols, n, eps, w_ptr, h_ptr + tok * stride_ht + head * stride_hh)


def row_warps(block: int) -> int:
    """Warps for a kernel that takes one row of `block` (a power of two) elements a program: one
    per 512 elements, 1 to 16 (1 under the interpreter). Also fp8_quant's and one_shot_all_reduce's."""
    return 1 if _INTERPRET else max(1, min(16, block // 512))


def add_rmsnorm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x += y (in place, rounded to x's dtype); returns (x, RMSNorm(x)). See the module docstring."""
    n_rows, hidden = x.shape
    assert y.shape == x.shape and y.dtype == x.dtype, "x, y: [num_tokens, hidden], one dtype"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert x.stride(1) == 1 and y.stride(1) == 1, "x, y: last dim contiguous"
    assert weight.shape == (hidden,) and weight.dtype == x.dtype and weight.is_contiguous()
    assert hidden <= MAX_ROW
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == x.dtype and out.stride(1) == 1
    if n_rows:
        block = triton.next_power_of_2(hidden)
        _add_rmsnorm_kernel[(n_rows,)](x, y, weight, out, hidden, eps, x.stride(0), y.stride(0), out.stride(0),
                                       BLOCK=block, PDL=pdl.active(x.device), num_warps=row_warps(block))
    return x, out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [n, hidden] or [n, heads, head_dim] over the last dim. See the module docstring."""
    assert x.dim() in (2, 3), "x: [n, hidden] or [n, heads, head_dim]"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert x.stride(-1) == 1, "x: last dim contiguous"
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.dtype == x.dtype and weight.is_contiguous()
    assert n <= MAX_ROW
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == x.dtype and out.stride(-1) == 1
    x3, o3 = (x, out) if x.dim() == 3 else (x[:, None], out[:, None])
    rows = x3.shape[0] * x3.shape[1]
    if rows:
        block = triton.next_power_of_2(n)
        _rmsnorm_kernel[(rows,)](x3, weight, o3, n, eps, x3.shape[1], x3.stride(0), x3.stride(1),
                                 o3.stride(0), o3.stride(1), BLOCK=block, num_warps=row_warps(block))
    return out
