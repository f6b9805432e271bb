"""Fused residual add + LayerNorm, and the fused token + position embedding.

A GPT-2 decode step at small batch is bound by kernel launches, not by bytes: each of these
replaces three kernels (add, then norm; two gathers, then add) with one.

add_layernorm contract (semantics = ``kernels.reference.add_layernorm_ref``):
  x, y      [num_tokens, hidden] float16 / bfloat16 / float32, rows contiguous. x is the residual
            stream, y what a sub-layer adds to it.
  weight,
  bias      [hidden], same dtype.
  returns   (s, h): s = x + y rounded to x's dtype (written into x, in place), and
            h = LayerNorm(s) * weight + bias computed in float32 and rounded to x's dtype.
  One program per token; hidden must fit one block (<= 16384).

embed contract (semantics = ``kernels.reference.embed_ref``):
  input_ids, positions  [num_tokens] int32 / int64.
  wte [vocab, hidden], wpe [max_positions, hidden], same dtype, rows contiguous.
  returns   wte[input_ids] + wpe[positions], [num_tokens, hidden], rounded to the weights' dtype.
  Ids are not range-checked (the engine validates prompts; sampled ids are in range by construction).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_layernorm_kernel(x_ptr, y_ptr, w_ptr, b_ptr, h_ptr, hidden, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0)
    y = tl.load(y_ptr + row * hidden + cols, mask=mask, other=0.0)
    # Add in fp32, round to the model dtype: exactly what torch's fp16/bf16 add does.
    s = (x.to(tl.float32) + y.to(tl.float32)).to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + row * hidden + cols, s, mask=mask)
    s = s.to(tl.float32)
    mean = tl.sum(s, axis=0) / hidden
    d = tl.where(mask, s - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(h_ptr + row * hidden + cols, (d * rstd * w + b).to(h_ptr.dtype.element_ty), mask=mask)


def add_layernorm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    n, hidden = x.shape
    assert y.shape == x.shape and x.is_contiguous() and y.is_contiguous(), "x, y: [n, hidden], contiguous"
    assert hidden <= 16384
    h = torch.empty_like(x)
    if n:
        _add_layernorm_kernel[(n,)](x, y, weight, bias, h, hidden, eps, BLOCK=triton.next_power_of_2(hidden),
                                    num_warps=4 if hidden <= 4096 else 8)
    return x, h


@triton.jit
def _embed_kernel(ids_ptr, pos_ptr, wte_ptr, wpe_ptr, out_ptr, hidden, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    tok = tl.load(ids_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    e = tl.load(wte_ptr + tok * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(wpe_ptr + pos * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (e + p).to(out_ptr.dtype.element_ty), mask=mask)


def embed(input_ids: torch.Tensor, positions: torch.Tensor, wte: torch.Tensor, wpe: torch.Tensor) -> torch.Tensor:
    n, hidden = input_ids.shape[0], wte.shape[1]
    assert wte.is_contiguous() and wpe.is_contiguous()
    out = torch.empty(n, hidden, dtype=wte.dtype, device=wte.device)
    if n:
        _embed_kernel[(n,)](input_ids, positions, wte, wpe, out, hidden, BLOCK=triton.next_power_of_2(hidden))
    return out
