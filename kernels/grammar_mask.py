"""Grammar-constrained rows on the device: each live row's logits masked to what its grammar allows,
once the host says the masks are there. (A greedy row's allowed argmax is kernels/argmax.py's `mask`.)

Contract (semantics = ``kernels.reference.grammar_mask_ref``):
  logits   [num_rows, >= num_cols] float16 / bfloat16 / float32, columns contiguous (row stride free).
  bits     [>= num_rows, words] int32, contiguous, XGrammar's layout: token t is allowed in row r when
           bit t % 32 of bits[r, t // 32] is set; words * 32 >= covered. Device memory on a GPU (pinned
           host memory works too, read over the bus and uncached, but slowly: see below).
  live     [>= num_rows] int32, contiguous, likewise: rows with live[r] == 0 are left alone.
  covered  tokens >= covered (the tokenizer's vocabulary ends there) are never allowed in a live row.
  result   logits[r, t] = -inf in every live row r for every t < num_cols it does not allow, in place;
           the columns past num_cols are not written.

`wait_for_flag(flag, target)`: flag, target [1] int64 (pinned host memory on a GPU); one program spins
until flag[0] >= target[0] (read when it runs: a captured graph waits for the step the host names),
so that what is queued behind it (the copy of the masks, then the masking or the masked argmax)
runs after the host wrote them: the host writes the masks, then the flag. After
MAX_SPINS reads (seconds) it goes on without, so that a host that died never leaves the device hung;
the host sets the flag even when filling failed, and then fails the step.

Why wait on the device: a constrained step's masks need the previous step's tokens on the host,
then XGrammar's fill. Launching the step's sampling only after that would leave the device idle while
the host fills and launches; with the wait on the device, the host enqueues the step (and the next)
as an unconstrained one is enqueued, and the fill overlaps the forward.

One program per row walks its columns in blocks: decoding batches are tens of rows, and the mask
is read once per block. Bits in pinned host memory would cost a round trip over the bus per block
(an H100 call measured 0.69x against 0.89x for waiting and copying first), so the runner queues
`wait_for_flag`, one copy of the masks to device memory, then the kernels on the copies.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
BLOCK = 1024
MAX_SPINS = 1 << 20  # flag reads before giving up (each crosses the bus: a microsecond or more)


@triton.jit
def allowed_columns(bits_ptr, row, words, cols, covered):
    """Which of the columns `cols` row `row`'s mask allows (the layout above; none >= covered).
    Volatile: the host wrote the masks while the device may have cached an earlier step's."""
    word = tl.load(bits_ptr + row * words + cols // 32, mask=cols < covered, other=0, volatile=True)
    return (((word >> (cols % 32)) & 1) != 0) & (cols < covered)


@triton.jit
def _grammar_kernel(logits_ptr, stride_row, num_cols, covered, bits_ptr, words, live_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    live = tl.load(live_ptr + row, volatile=True)
    if live != 0:
        for start in range(0, num_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_row = cols < num_cols
            allowed = allowed_columns(bits_ptr, row, words, cols, covered)
            tl.store(logits_ptr + row * stride_row + cols,
                     tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
                     mask=in_row & ~allowed)


@triton.jit
def _wait_kernel(flag_ptr, target_ptr, max_spins):
    step = tl.load(target_ptr, volatile=True)
    seen = tl.load(flag_ptr, volatile=True)
    spins = 0
    while (seen < step) & (spins < max_spins):
        seen = tl.load(flag_ptr, volatile=True)
        spins += 1


def wait_for_flag(flag: torch.Tensor, target: torch.Tensor) -> None:
    """Hold the device's queue until flag[0] >= target[0] (one program; target read when it runs,
    so that a captured graph can wait for another step each replay): what follows, e.g. a copy of
    the masks to device memory, then runs after the host wrote them. See the module docstring."""
    assert flag.dtype == torch.int64 and flag.numel() >= 1
    assert target.dtype == torch.int64 and target.numel() >= 1
    _wait_kernel[(1,)](flag, target, MAX_SPINS, num_warps=1)


def apply_grammar(logits: torch.Tensor, num_cols: int, bits: torch.Tensor, live: torch.Tensor, covered: int) -> None:
    """Mask each live row of `logits` in place. See the module docstring."""
    rows = logits.shape[0]
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits: [rows, cols], columns contiguous"
    assert 1 <= num_cols <= logits.shape[1] and 0 <= covered
    assert bits.dtype == torch.int32 and bits.is_contiguous() and bits.shape[0] >= rows
    assert bits.shape[1] * 32 >= min(covered, num_cols)
    assert live.dtype == torch.int32 and live.is_contiguous() and live.shape[0] >= rows
    if rows == 0:
        return
    block = 256 if _INTERPRET else BLOCK  # the interpreter runs programs one by one: any size is slow
    _grammar_kernel[(rows,)](logits, logits.stride(0), num_cols, covered, bits, bits.shape[1], live, BLOCK=block,
                             num_warps=1 if _INTERPRET else 4)
