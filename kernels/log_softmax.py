"""Row-wise log-softmax whose bits do not depend on where a row sits in the batch.

Contract (semantics = ``torch.log_softmax(x, dim=-1)``, within a few fp32 ulp):
  x        [num_rows, num_cols] float32, last dim contiguous (row stride free)
  returns  out [num_rows, num_cols] float32, contiguous: x - log(sum(exp(x - max))) - max per row.

Why not torch's: its CUDA kernel splits a row among threads from the row's address modulo the
vector width, so a row of 50,257 fp32 logits is summed in a different order at row 0 than at
row 1 of a batch, and the same request's log-probabilities differ in the last bit with its
position in the batch (measured on an H100 by benchmarks/engine/bench_determinism.py: up to 49 distinct
logprob sequences for one greedy prompt, identical tokens). Here one program owns a row and reads
it in fixed CHUNK-column chunks in ascending order (an online max and rescaled sum), so the order
of every operation is a function of the column index only, whatever the row count or stride.
Used by the deterministic mode (server/worker/sampler.py's softmax helpers); -inf entries (masked
tokens) are fine, a row of all -inf gives NaN as torch does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 2048


# Not specialised on the row stride or length: a one-row slice of the LM head's padded output keeps
# the padded stride (50304, a multiple of 16) where a batch of rows gets 50257, and Triton's variant
# for a multiple of 16 lays the chunk out 4 elements a thread instead of 1, which sums each row in
# another order: the lone request's logprobs differed in the last bit from the same request's
# among others (H100, benchmarks/engine/bench_determinism.py).
@triton.jit(do_not_specialize=["num_cols", "stride_x"])
def _log_softmax_kernel(x_ptr, out_ptr, num_cols, stride_x, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNK)
    m = tl.full([CHUNK], float("-inf"), dtype=tl.float32)  # per-lane running max and sum
    s = tl.zeros([CHUNK], dtype=tl.float32)
    for c0 in range(0, num_cols, CHUNK):
        x = tl.load(x_ptr + row * stride_x + c0 + offs, mask=c0 + offs < num_cols, other=float("-inf"))
        m_new = tl.maximum(m, x)
        # lanes still at -inf stay at sum 0 (no -inf - -inf)
        s = tl.where(m_new == float("-inf"), 0.0, s * tl.exp(m - m_new) + tl.exp(x - m_new))
        m = m_new
    row_max = tl.max(m, 0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - row_max)), 0)
    lse = row_max + tl.log(total)
    for c0 in range(0, num_cols, CHUNK):
        ok = c0 + offs < num_cols
        x = tl.load(x_ptr + row * stride_x + c0 + offs, mask=ok, other=0.0)
        tl.store(out_ptr + row * num_cols + c0 + offs, x - lse, mask=ok)


def log_softmax_rows(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim of a 2-D fp32 tensor, each row's bits independent of the batch."""
    assert x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1
    out = torch.empty(x.shape, device=x.device, dtype=torch.float32)
    if x.numel():
        _log_softmax_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), CHUNK=CHUNK, num_warps=8,
                                           enable_fp_fusion=False)
    return out
