"""The repetition, frequency and presence penalties of a step's penalized rows, in one launch.

Contract (semantics = ``kernels.reference.apply_penalties_ref``, vLLM's definitions):
  logits     [num_rows, vocab] float32, columns contiguous (row stride free); edited in place.
  rows       [n] int64: the logits rows to penalize (distinct), each with
  slots      [n] int64: its sequence's slot in the three per-sequence tables below.
  counts     [num_slots, vocab] int32, contiguous rows: how often the sequence generated each token.
  in_prompt  [num_slots, vocab] bool, contiguous rows: whether the token occurs in its prompt.
  penalties  [num_slots, 3] float32, contiguous: (repetition, frequency, presence) per slot.
  For each (row, slot) and token t, with c = counts[slot, t]:
    a token seen in the prompt or the output (in_prompt or c > 0) has its logit divided by the
    repetition penalty when positive, multiplied by it otherwise; then
    logit -= frequency * c + presence * (c > 0).
  Rows not in `rows` and columns past vocab are not touched. n = 0 launches nothing.

Greedy rows whose only control is penalties are penalized inside the greedy argmax instead
(kernels/argmax.py `penalty`, with `penalize` from here and `table_addresses`), in the decode graph.

Why a kernel: in PyTorch the same formula is a dozen launches over [n, vocab] gathers, copies and
masks, run outside the captured decode graph every step (server/worker/logits.py): measured on
an H100 at batch 64 of GPT-2 small, penalized greedy decoding ran at 0.73x plain
(benchmarks/results/structured_h100.json). Here each program reads one block of a row's logits,
counts and prompt flags once and writes the logits back: one pass over the bytes that matter.
Elementwise, so a row's result does not depend on the batch (the deterministic mode keeps it).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
BLOCK = 2048


@triton.jit
def penalize(x, c, in_prompt, rep, freq, pres):
    """The penalties of one block of a row: x float32 logits, c its counts, in_prompt its flags."""
    # IEEE division (Triton's `/` is the approximate one) and no multiply-add contraction (the launch
    # sets enable_fp_fusion=False): the same roundings as the reference's separate torch ops.
    seen = in_prompt | (c > 0)
    x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, rep), x * rep), x)
    return x - (freq * c.to(tl.float32) + pres * (c > 0).to(tl.float32))


@triton.jit
def _penalties_kernel(logits_ptr, stride_logits, rows_ptr, slots_ptr, counts_ptr, prompt_ptr, penalties_ptr,
                      vocab, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    rep = tl.load(penalties_ptr + slot * 3)
    freq = tl.load(penalties_ptr + slot * 3 + 1)
    pres = tl.load(penalties_ptr + slot * 3 + 2)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < vocab
    x = tl.load(logits_ptr + row * stride_logits + cols, mask=ok, other=0.0)
    c = tl.load(counts_ptr + slot * vocab + cols, mask=ok, other=0)
    p = tl.load(prompt_ptr + slot * vocab + cols, mask=ok, other=0) != 0
    x = penalize(x, c, p, rep, freq, pres)
    tl.store(logits_ptr + row * stride_logits + cols, x, mask=ok)


def table_addresses(counts: torch.Tensor, in_prompt: torch.Tensor, penalties: torch.Tensor) -> list[int]:
    """The tables' device addresses, in the order kernels/argmax.py's penalized argmax reads them."""
    return [counts.data_ptr(), in_prompt.data_ptr(), penalties.data_ptr()]


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                    in_prompt: torch.Tensor, penalties: torch.Tensor) -> None:
    """Penalize logits[rows] in place from their sequences' slots. See the module docstring."""
    assert logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1
    vocab = logits.shape[1]
    assert counts.dtype == torch.int32 and counts.is_contiguous() and counts.shape[1] == vocab
    assert in_prompt.dtype == torch.bool and in_prompt.is_contiguous() and in_prompt.shape == counts.shape
    assert penalties.dtype == torch.float32 and penalties.is_contiguous() and penalties.shape[1] == 3
    assert rows.shape == slots.shape and rows.dim() == 1
    if not rows.numel():
        return
    block = 256 if _INTERPRET else BLOCK  # the interpreter runs programs one by one: any size is slow
    _penalties_kernel[(rows.numel(), triton.cdiv(vocab, block))](
        logits, logits.stride(0), rows, slots, counts, in_prompt.view(torch.uint8), penalties, vocab, BLOCK=block,
        num_warps=1 if _INTERPRET else 4, enable_fp_fusion=False)
