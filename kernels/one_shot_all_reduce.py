"""The one-shot all-reduce of tensor parallelism's small messages, in one launch and without a barrier:
every rank pushes its part into every rank's buffer, then sums what has arrived in its own.

one_shot_all_reduce contract (semantics = ``kernels.reference.all_reduce_ref`` of the ranks' parts):
  x           [n] float16 / bfloat16, contiguous: this rank's part (n >= 1, the same n on every rank).
  out         [n] x's dtype, contiguous: the sum, the same bits on every rank (each element summed in
              fp32 in rank order, then rounded once to the dtype; at two ranks that is NCCL's sum).
  buffers     int64 [world] on the device: every rank's buffer address, in rank order. Each buffer is
              int16 [2, world, slot_elems] (two parities, one slot per sending rank) mapped into every
              rank's address space (symmetric memory, models/parallel/symm_all_reduce.py), n <= slot_elems,
              and holds SENTINEL (-0.0's bits) wherever no message is in flight: so it starts, so each
              call leaves it.
  state       int32 [2], this rank's: the calls it has made (whose low bit picks the parity) and the
              programs of the running call that have finished (0 between calls). Zeros at start.
  rank        this rank's index; every rank calls with the same n, its calls in the same
              order as the others' (a collective: a rank that does not call leaves the others waiting).

one_shot_add_rmsnorm contract (semantics = kernels/rms_norm.py's ``add_rmsnorm`` of x and the
one_shot_all_reduce of part, bit for bit): the all-reduce of a row-parallel projection's output
fused with the residual add and RMSNorm after it (one launch where there were two).
  part        [rows, hidden] float16 / bfloat16, contiguous: this rank's part; rows * hidden <= slot_elems.
  x           [rows, hidden] part's dtype, last dim contiguous: the residual stream; x + sum(parts),
              rounded, is written into it IN PLACE.
  weight      [hidden] part's dtype, contiguous (hidden <= 32768); eps the norm's.
  returns     (x, h): h = RMSNorm(x) as add_rmsnorm computes it, [rows, hidden] contiguous.
  buffers, state, rank, slot_elems: as above (the same buffers and call count as one_shot_all_reduce).
  Each program takes whole rows (pid, pid + programs, ...), sending all of its rows first.

How (the "Lamport" all-reduce of TensorRT-LLM's one-shot kernels): a value's own bits say whether it
has arrived. A rank stores its part (-0.0 written as +0.0, the one value the sum cannot tell from it)
into slot `rank` of the current parity of every rank's buffer over NVLink, then reads its own
buffer's slots with volatile loads until no element is SENTINEL, adds them, and writes SENTINEL back
over what it read. No barrier: the data is the signal. The two parities keep a fast rank's next call
out of the slots a slow rank still reads: a rank's call c + 1 writes the other parity, and it can
reach call c + 2 (this parity again) only after every rank's call c + 1 has sent it data, that is
after every rank has finished (and cleared) call c. The call count lives on the device, so the same
launch in a CUDA graph alternates parities at every replay; the last program to finish advances it.

Each program takes BLOCK-element chunks pid, pid + programs, ...: it sends all of them, then waits for
and sums each (one NVLink latency a call, not one a chunk). Every program sends before it waits, so
a wait ends once the other ranks' programs have started: with no more programs than SMs all are
resident at once (the ranks need not launch the same number).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rms_norm import MAX_ROW, rms_row, row_warps
from kernels.rounding import round_to

SENTINEL = -32768  # 0x8000 as int16: -0.0 in float16 and in bfloat16
_SENTINEL = tl.constexpr(SENTINEL)  # (a kernel reads only constexpr globals)
BLOCK = 1024  # elements a program takes at a time: 8 per thread at 4 warps (16-byte accesses)


@triton.jit
def _start(buffers_ptr, state_ptr, rank):
    """(this call's parity, the call count, this rank's buffer as an int16 pointer)."""
    calls = tl.load(state_ptr)
    # (16-byte aligned, as symmetric memory's buffers are: the accesses below vectorize)
    own = tl.multiple_of(tl.load(buffers_ptr + rank).to(tl.pointer_type(tl.int16)), 16)
    return calls % 2, calls, own


@triton.jit
def _send(x, offs, mask, buffers_ptr, parity, rank, slot_elems, WORLD: tl.constexpr):
    """x (16-bit values) into element offs of slot `rank` of every rank's buffer, -0.0 as +0.0."""
    x = x.to(tl.int16, bitcast=True)
    x = tl.where(x == _SENTINEL, tl.zeros_like(x), x)  # the sentinel is never sent
    for r in tl.static_range(WORLD):
        peer = tl.multiple_of(tl.load(buffers_ptr + r).to(tl.pointer_type(tl.int16)), 16)
        tl.store(peer + (parity * WORLD + rank) * slot_elems + offs, x, mask=mask)


@triton.jit
def _wait_sum(own, offs, mask, parity, slot_elems, dtype: tl.constexpr, WORLD: tl.constexpr,
              BLOCK: tl.constexpr):
    """fp32 sum, in rank order, of element offs of every slot of this rank's buffer, each waited for
    until it is not the sentinel, then cleared back to it."""
    acc = tl.zeros([BLOCK], tl.float32)
    for r in tl.static_range(WORLD):
        slot = own + (parity * WORLD + r) * slot_elems + offs
        v = tl.load(slot, mask=mask, other=0, volatile=True)
        while tl.sum(((v == _SENTINEL) & mask).to(tl.int32)) > 0:
            v = tl.load(slot, mask=mask, other=0, volatile=True)
        acc += v.to(dtype, bitcast=True).to(tl.float32)
        tl.store(slot, tl.full([BLOCK], _SENTINEL, tl.int16), mask=mask)
    return acc


@triton.jit
def _finish(state_ptr, calls):
    """The last program of the call to finish advances the call count (every program has read it)."""
    finished = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if finished == tl.num_programs(0) - 1:
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr, calls + 1)


@triton.jit
def _one_shot_kernel(x_ptr, out_ptr, buffers_ptr, state_ptr, n, rank, slot_elems,
                     WORLD: tl.constexpr, BLOCK: tl.constexpr):
    pid, programs = tl.program_id(0), tl.num_programs(0)
    parity, calls, own = _start(buffers_ptr, state_ptr, rank)
    dtype = x_ptr.dtype.element_ty
    for start in range(pid * BLOCK, n, programs * BLOCK):  # send all of this program's chunks first
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        _send(tl.load(x_ptr + offs, mask=mask), offs, mask, buffers_ptr, parity, rank, slot_elems, WORLD)
    for start in range(pid * BLOCK, n, programs * BLOCK):  # then wait for each and sum it
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        acc = _wait_sum(own, offs, mask, parity, slot_elems, dtype, WORLD, BLOCK)
        tl.store(out_ptr + offs, round_to(acc, dtype), mask=mask)
    _finish(state_ptr, calls)


@triton.jit
def _one_shot_add_rmsnorm_kernel(part_ptr, x_ptr, w_ptr, h_ptr, buffers_ptr, state_ptr, rows, n, eps,
                                 stride_x, stride_h, rank, slot_elems, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    pid, programs = tl.program_id(0), tl.num_programs(0)
    parity, calls, own = _start(buffers_ptr, state_ptr, rank)
    dtype = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    for row in range(pid, rows, programs):  # send every row of this program first
        offs = row * n + cols
        _send(tl.load(part_ptr + offs, mask=mask), offs, mask, buffers_ptr, parity, rank, slot_elems, WORLD)
    for row in range(pid, rows, programs):
        y = round_to(_wait_sum(own, row * n + cols, mask, parity, slot_elems, dtype, WORLD, BLOCK), dtype)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        s = round_to(x + y.to(tl.float32), dtype)  # the residual add, as add_rmsnorm rounds it
        tl.store(x_ptr + row * stride_x + cols, s, mask=mask)
        h = rms_row(s.to(tl.float32), mask, cols, n, eps, w_ptr, dtype)
        tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    _finish(state_ptr, calls)


def one_shot_all_reduce(x: torch.Tensor, out: torch.Tensor, buffers: torch.Tensor, state: torch.Tensor,
                        rank: int, slot_elems: int, max_programs: int) -> torch.Tensor:
    """Sum x over the ranks into out (see the contract above); out. `max_programs`: at most this many
    programs (the SM count: see the module's docstring)."""
    assert x.dtype in (torch.float16, torch.bfloat16) and out.dtype == x.dtype, "16-bit floats only"
    assert x.is_contiguous() and out.is_contiguous() and x.numel() == out.numel()
    n = x.numel()
    assert 0 < n <= slot_elems, f"{n} elements for slots of {slot_elems}"
    programs = min(triton.cdiv(n, BLOCK), max_programs)
    _one_shot_kernel[(programs,)](x, out, buffers, state, n, rank, slot_elems,
                                  WORLD=buffers.numel(), BLOCK=BLOCK, num_warps=4)
    return out


def one_shot_add_rmsnorm(part: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                         buffers: torch.Tensor, state: torch.Tensor, rank: int, slot_elems: int,
                         max_programs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of part over the ranks added into x in place, then RMSNorm: (x, h), the bits of
    kernels/rms_norm.py's add_rmsnorm(x, one_shot_all_reduce(part), weight, eps) in one launch."""
    rows, n = part.shape
    assert part.dtype in (torch.float16, torch.bfloat16) and x.dtype == part.dtype, "16-bit floats only"
    assert part.is_contiguous() and x.shape == part.shape and x.stride(1) == 1
    assert weight.shape == (n,) and weight.dtype == x.dtype and weight.is_contiguous() and n <= MAX_ROW
    assert 0 < rows * n <= slot_elems, f"{rows * n} elements for slots of {slot_elems}"
    h = torch.empty_like(part)
    block = triton.next_power_of_2(n)
    _one_shot_add_rmsnorm_kernel[(min(rows, max_programs),)](
        part, x, weight, h, buffers, state, rows, n, eps, x.stride(0), h.stride(0), rank, slot_elems,
        WORLD=buffers.numel(), BLOCK=block, num_warps=row_warps(block))
    return x, h
