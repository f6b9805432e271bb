"""Grammar-constrained rows on the device: each live row's logits masked to what its grammar allows,
or its greedy choice among those, once the host says the masks are there.

Contract (semantics = ``kernels.reference.grammar_mask_ref``, and for `out` ``argmax_ref`` of it):
  logits   [num_rows, >= num_cols] float16 / bfloat16 / float32, columns contiguous (row stride free).
  bits     [>= num_rows, words] int32, contiguous, XGrammar's layout: token t is allowed in row r when
           bit t % 32 of bits[r, t // 32] is set; words * 32 >= covered. Device memory on a GPU (pinned
           host memory works too, read over the bus and uncached, but slowly: see below).
  live     [>= num_rows] int32, contiguous, likewise: rows with live[r] == 0 are left alone.
  covered  tokens >= covered (the tokenizer's vocabulary ends there) are never allowed in a live row.
  out      None: logits[r, t] = -inf in every live row r for every t < num_cols it does not allow.
           A tensor [num_rows] int32 / int64: out[r] = the first column of the largest allowed logit
           of each live row (NaN counts as +inf, as in torch.argmax; a row that allows nothing, or only
           -inf, gets 0: torch.argmax of an all -inf row); logits and the other rows' out untouched.

`wait_for_flag(flag, step)`: flag [1] int64 (pinned host memory on a GPU); one program spins until
flag[0] >= step, so that what is queued behind it (the copy of the masks, then apply_grammar) runs
after the host wrote them: the host writes the masks, then the flag. After MAX_SPINS reads (seconds)
it goes on without, so that a host that died never leaves the device hung; the host sets the flag
even when filling failed, and then fails the step.

Why wait on the device: a constrained step's masks need the previous step's tokens on the host,
then XGrammar's fill. Launching the step's sampling only after that would leave the device idle while
the host fills and launches; with the wait on the device, the host enqueues the step (and the next)
as an unconstrained one is enqueued, and the fill overlaps the forward.

One program per row walks its columns in blocks: decoding batches are tens of rows, and the mask
is read once per block. Bits in pinned host memory would cost a round trip over the bus per block
(an H100 call measured 0.69x against 0.89x for waiting and copying first), so the runner queues
`wait_for_flag`, one copy of the masks to device memory, then apply_grammar on the copies.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
BLOCK = 1024
MAX_SPINS = 1 << 20  # flag reads before giving up (each crosses the bus: a microsecond or more)
_BIG = tl.constexpr(2**31 - 1)


@triton.jit
def _grammar_kernel(logits_ptr, stride_row, num_cols, covered, bits_ptr, words, live_ptr, out_ptr,
                    BLOCK: tl.constexpr, ARGMAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    live = tl.load(live_ptr + row, volatile=True)
    if live != 0:
        best_v = -float("inf")
        best_i = 0
        for start in range(0, num_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_row = cols < num_cols
            word = tl.load(bits_ptr + row * words + cols // 32, mask=cols < covered, other=0, volatile=True)
            allowed = (((word >> (cols % 32)) & 1) != 0) & (cols < covered)
            at = logits_ptr + row * stride_row + cols
            if ARGMAX:
                x = tl.load(at, mask=in_row & allowed, other=float("-inf")).to(tl.float32)
                x = tl.where(x != x, float("inf"), x)  # NaN
                m = tl.max(x, axis=0)
                first = tl.min(tl.where((x == m) & in_row & allowed, cols, _BIG), axis=0)
                better = m > best_v  # strictly: an earlier block keeps a tie
                best_i = tl.where(better, first, best_i)
                best_v = tl.where(better, m, best_v)
            else:
                tl.store(at, tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
                         mask=in_row & ~allowed)
        if ARGMAX:
            tl.store(out_ptr + row, best_i.to(out_ptr.dtype.element_ty))


@triton.jit
def _wait_kernel(flag_ptr, step, max_spins):
    seen = tl.load(flag_ptr, volatile=True)
    spins = 0
    while (seen < step) & (spins < max_spins):
        seen = tl.load(flag_ptr, volatile=True)
        spins += 1


def wait_for_flag(flag: torch.Tensor, step: int) -> None:
    """Hold the device's queue until flag[0] >= step (one program): what follows, e.g. a copy of the
    masks to device memory, then runs after the host wrote them. See the module docstring."""
    assert flag.dtype == torch.int64 and flag.numel() >= 1
    _wait_kernel[(1,)](flag, step, MAX_SPINS, num_warps=1)


def apply_grammar(logits: torch.Tensor, num_cols: int, bits: torch.Tensor, live: torch.Tensor, covered: int,
                  out: torch.Tensor | None = None) -> None:
    """Mask each live row of `logits` in place, or (`out`) choose each live row's allowed argmax.
    See the module docstring."""
    rows = logits.shape[0]
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits: [rows, cols], columns contiguous"
    assert 1 <= num_cols <= logits.shape[1] and 0 <= covered
    assert bits.dtype == torch.int32 and bits.is_contiguous() and bits.shape[0] >= rows
    assert bits.shape[1] * 32 >= min(covered, num_cols)
    assert live.dtype == torch.int32 and live.is_contiguous() and live.shape[0] >= rows
    if out is not None:
        assert out.shape == (rows,) and out.dtype in (torch.int32, torch.int64) and out.is_contiguous()
    if rows == 0:
        return
    block = 256 if _INTERPRET else BLOCK  # the interpreter runs programs one by one: any size is slow
    _grammar_kernel[(rows,)](logits, logits.stride(0), num_cols, covered, bits, bits.shape[1], live,
                             out if out is not None else live, BLOCK=block, ARGMAX=out is not None,
                             num_warps=1 if _INTERPRET else 4)
