"""SiLU-gated product of a merged gate/up projection: silu(gate) * up.

Contract (semantics = ``kernels.reference.silu_mul_ref``):
  gate_up   [num_tokens, 2 * inter] float16 / bfloat16 / float32, last dim contiguous (row stride
            free): gate = gate_up[:, :inter], up = gate_up[:, inter:], as a merged gate/up GEMM
            writes them.
  out       optional [num_tokens, inter], gate_up's dtype, last dim contiguous (allocated when None).
  returns   out = F.silu(gate) * up in gate_up's dtype, with torch's rounding: silu computed in fp32
            as gate / (1 + exp(-gate)) and rounded to the dtype, then the product of the two
            dtype values rounded to the dtype (kernels/rounding.py).

Grid: (num_tokens, cdiv(inter, BLOCK)); any inter (non-powers of two masked).

Bit-exactness vs torch: the division is IEEE (div_rn) and both roundings are exact; exp is the only
approximate step. On the GPU the kernel uses libdevice's expf, the same routine torch's CUDA silu
calls: measured bit-identical to the model's ``F.silu(gate) * up`` on an H100 (triton 3.6, torch
2.11) in fp16, bf16 and fp32 (58.7M elements each; Triton's fast tl.exp would give 12784 fp16
elements off by up to 2 ulp). Under the interpreter it uses numpy's exp, which can differ from
torch's CPU exp (SLEEF) in fp32's last bit, so a rare fp16/bf16 element (~2e-4 of them) rounds to
the neighbouring value (1 ulp) and fp32 agrees to a few ulp.

Not checked: NaN/inf (they propagate as in torch).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels import pdl
from kernels.rounding import round_to

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def silu_mul_values(g, u, dt: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    """silu(g) * u rounded to dt as torch rounds it (g, u: fp32 values of dt). Also the first half
    of kernels/fp8_quant.py's silu_mul_fp8."""
    if LIBDEVICE_EXP:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    silu = round_to(tl.math.div_rn(g, 1.0 + e), dt).to(tl.float32)
    return round_to(silu * u, dt)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_out, BLOCK: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                     PDL: tl.constexpr):
    pdl.launch_dependents(PDL)  # (kernels/pdl.py: a GEMV after it may start its weight stream)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, silu_mul_values(g, u, out_ptr.dtype.element_ty, LIBDEVICE_EXP),
             mask=mask)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate_up[:, :inter]) * gate_up[:, inter:] -> [num_tokens, inter]. See the module docstring."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, "gate_up: [num_tokens, 2 * inter]"
    assert gate_up.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert gate_up.stride(1) == 1, "gate_up: last dim contiguous"
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    assert out.shape == (n, inter) and out.dtype == gate_up.dtype and out.stride(1) == 1
    if n and inter:
        # The interpreter's cost is per program: few, wide ones there.
        block = min(triton.next_power_of_2(inter), 8192 if _INTERPRET else 1024)
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block,
            LIBDEVICE_EXP=not _INTERPRET and gate_up.is_cuda, PDL=pdl.active(gate_up.device),
            num_warps=1 if _INTERPRET else max(1, min(4, block // 256)))
    return out
