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
  input_ids, positions  [num_tokens] int32 / int64. An id < 0 is a placeholder for a token sampled
            by the previous step and still on the device only: id -1 - r stands for sampled_ids[r].
  sampled_ids  [>= 1] int32 / int64, or None when no id is a placeholder.
  token_table [vocab, hidden], pos_table [max_positions, hidden], same dtype, rows contiguous.
  returns   x = token_table[ids] + pos_table[positions], [num_tokens, hidden], rounded to the weights' dtype;
            embed_layernorm also h = LayerNorm(x) * weight + bias (the first block's pre-norm),
            as add_layernorm computes it.
  Ids are not range-checked (the engine validates prompts; sampled ids are in range by construction).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_store(s, mask, cols, row, hidden, eps, w_ptr, b_ptr, h_ptr):
    """h[row] = LayerNorm(s) * w + b, s a [BLOCK] fp32 row (0 past hidden)."""
    mean = tl.sum(s, axis=0) / hidden
    d = tl.where(mask, s - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(h_ptr + row * hidden + cols, (d * rstd * w + b).to(h_ptr.dtype.element_ty), mask=mask)


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
    _norm_store(s.to(tl.float32), mask, cols, row, hidden, eps, w_ptr, b_ptr, h_ptr)


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
def _embed_kernel(ids_ptr, pos_ptr, sampled_ptr, token_table_ptr, pos_table_ptr, out_ptr, w_ptr, b_ptr, h_ptr, hidden, eps,
                  BLOCK: tl.constexpr, SAMPLED: tl.constexpr, NORM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    tok = tl.load(ids_ptr + row).to(tl.int64)
    if SAMPLED:
        held = tl.load(sampled_ptr + tl.maximum(-1 - tok, 0)).to(tl.int64)
        tok = tl.where(tok < 0, held, tok)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    e = tl.load(token_table_ptr + tok * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(pos_table_ptr + pos * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    x = (e + p).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * hidden + cols, x, mask=mask)
    if NORM:
        _norm_store(x.to(tl.float32), mask, cols, row, hidden, eps, w_ptr, b_ptr, h_ptr)


def _embed(input_ids, positions, token_table, pos_table, sampled_ids, norm) -> tuple[torch.Tensor, torch.Tensor]:
    n, hidden = input_ids.shape[0], token_table.shape[1]
    assert token_table.is_contiguous() and pos_table.is_contiguous()
    out = torch.empty(n, hidden, dtype=token_table.dtype, device=token_table.device)
    h = torch.empty_like(out) if norm is not None else out
    w, b, eps = norm if norm is not None else (out, out, 0.0)
    if n:
        _embed_kernel[(n,)](input_ids, positions, sampled_ids if sampled_ids is not None else input_ids, token_table, pos_table,
                            out, w, b, h, hidden, eps, BLOCK=triton.next_power_of_2(hidden),
                            SAMPLED=sampled_ids is not None, NORM=norm is not None)
    return out, h


def embed(input_ids: torch.Tensor, positions: torch.Tensor, token_table: torch.Tensor, pos_table: torch.Tensor,
          sampled_ids: torch.Tensor | None = None) -> torch.Tensor:
    return _embed(input_ids, positions, token_table, pos_table, sampled_ids, None)[0]


def embed_layernorm(input_ids: torch.Tensor, positions: torch.Tensor, token_table: torch.Tensor, pos_table: torch.Tensor,
                    weight: torch.Tensor, bias: torch.Tensor, eps: float,
                    sampled_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, LayerNorm(x)) in one kernel: the embedding and the first block's pre-norm."""
    return _embed(input_ids, positions, token_table, pos_table, sampled_ids, (weight, bias, eps))
