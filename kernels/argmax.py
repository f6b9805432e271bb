"""Greedy sampling on the device: the column of each row's largest logit.

Contract (semantics = ``kernels.reference.argmax_ref``, i.e. torch.argmax over the first num_cols
columns):
  logits    [num_rows, >= num_cols] float16 / bfloat16 / float32, columns contiguous (row stride
            free): the LM head's output, whose columns past the vocabulary (padding up to a
            multiple of 64) are never read, whatever they hold.
  num_cols  >= 1, the vocabulary size.
  out       [num_rows] int32 or int64, contiguous (e.g. a slice of the runner's sampled-ids buffer).
  Ties go to the first column, as in torch.argmax; NaN counts as +inf (torch.argmax also picks a
  NaN, so a row with NaN gets a NaN's column either way unless it also holds +inf).

Two launches: chunks of CHUNK columns reduce to (max, first column) partials in parallel, then one
program per row merges its partials. torch.argmax gives a row of GPT-2's 50k logits to a single
block, which takes ~14 µs on an H100 at batch 1; split, the pair takes a few µs. The partials live
in per-device scratch buffers (kernels/scratch.py: no allocation per call, so the pair can be
captured in a CUDA graph).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.scratch import scratch

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
CHUNK = 2048
_BIG = tl.constexpr(2**31 - 1)


@triton.jit
def _chunk_kernel(x_ptr, val_ptr, idx_ptr, num_cols, stride_row, num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = cols < num_cols
    x = tl.load(x_ptr + row * stride_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN
    m = tl.max(x, axis=0)
    first = tl.min(tl.where((x == m) & ok, cols, _BIG), axis=0)  # an all -inf chunk: its first column
    tl.store(val_ptr + row * num_chunks + chunk, m)
    tl.store(idx_ptr + row * num_chunks + chunk, first)


@triton.jit
def _merge_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, CHUNKS_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNKS_PAD)
    ok = offs < num_chunks
    v = tl.load(val_ptr + row * num_chunks + offs, mask=ok, other=float("-inf"))
    i = tl.load(idx_ptr + row * num_chunks + offs, mask=ok, other=_BIG)
    m = tl.max(v, axis=0)
    first = tl.min(tl.where((v == m) & ok, i, _BIG), axis=0)
    tl.store(out_ptr + row, first.to(out_ptr.dtype.element_ty))


def argmax_rows(logits: torch.Tensor, num_cols: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """out[r] = argmax(logits[r, :num_cols]) for every row. See the module docstring."""
    rows = logits.shape[0]
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits: [rows, cols], columns contiguous"
    assert 1 <= num_cols <= logits.shape[1]
    if out is None:
        out = torch.empty(rows, device=logits.device, dtype=torch.int64)
    assert out.shape == (rows,) and out.dtype in (torch.int32, torch.int64) and out.is_contiguous()
    if rows == 0:
        return out
    chunk = 256 if _INTERPRET else CHUNK  # the interpreter runs programs one by one: any size is slow
    chunks = triton.cdiv(num_cols, chunk)
    dev = logits.device
    val = scratch(("argmax-max", dev), rows * chunks, torch.float32, dev)
    idx = scratch(("argmax-col", dev), rows * chunks, torch.int32, dev)
    _chunk_kernel[(rows, chunks)](logits, val, idx, num_cols, logits.stride(0), chunks, CHUNK=chunk,
                                  num_warps=1 if _INTERPRET else 4)
    _merge_kernel[(rows,)](val, idx, out, chunks, CHUNKS_PAD=max(2, triton.next_power_of_2(chunks)), num_warps=1)
    return out
