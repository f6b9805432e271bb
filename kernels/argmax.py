"""The choice of each row's token on the device: the column of its largest logit (greedy), of its
largest logit plus Gumbel noise (sampled), among the columns a grammar allows.

Contract (semantics = ``kernels.reference.argmax_ref``, i.e. torch.argmax over the first num_cols
columns):
  logits    [num_rows, >= num_cols] float16 / bfloat16 / float32, columns contiguous (row stride
            free): the LM head's output, whose columns past the vocabulary (padding up to a
            multiple of 64) are never read, whatever they hold.
  num_cols  >= 1, the vocabulary size.
  out       [num_rows] int32 or int64, contiguous (e.g. a slice of the runner's sampled-ids buffer).
  Ties go to the first column, as in torch.argmax; NaN counts as +inf (torch.argmax also picks a
  NaN, so a row with NaN gets a NaN's column either way unless it also holds +inf).
  penalty   optional (slots, tables) (semantics = ``kernels.reference.penalized_argmax_ref``):
            slots [num_rows] int32, each row's token-count slot, or -1; tables [3] int64 on the
            device, the addresses of the count tables (kernels/penalties.py `table_addresses`:
            counts [slots, num_cols] int32, in_prompt [slots, num_cols] bool, penalties [slots, 3]
            float32). A row with a slot chooses among its logits in float32 after the repetition,
            frequency and presence penalties (kernels/penalties.py, the same roundings), and its
            choice is counted: counts[slot, out[row]] += 1. Slots distinct. The tables are read
            only for rows with a slot and through their addresses, so a CUDA graph captured with
            this launch keeps working when the tables are allocated or grown later.

  noise     optional (inv_temperature, seeds, positions) (semantics = ``kernels.reference.
            sampled_argmax_ref``): [>= num_rows] float32, int64, int32/int64, contiguous. A row with
            inv_temperature > 0 samples: it chooses argmax(x * inv_temperature + g) in float32, x its
            (penalized) logits, g the Gumbel noise of (seed, position, column)
            (kernels/sampling_noise.py); a row with 0 is greedy.
  mask      optional (bits, live, covered), a grammar's token masks in kernels/grammar_mask.py's
            layout: a row with live[r] != 0 chooses among the columns < covered whose bit is set
            (the others count as -inf, after the NaN rule and the noise); a row that allows
            nothing gets 0, as an all -inf row does.

Why sampling here: Gumbel-max makes a sampled row's choice an argmax, so a batch of sampled rows
costs the same two launches as a greedy one (no softmax, no [rows, vocab] temporaries, no launch
per seeded row), and a captured graph can sample.

Why the penalties here: penalized greedy decoding then costs the decode graph no launch and little
time (a penalized row's chunks read its counts and prompt flags beside its logits, in parallel
like the rest); chosen by a pass of their own, one program per row, they took ~5% of GPT-2
small's step at batch 64 on an H100.

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

from kernels.grammar_mask import allowed_columns
from kernels.penalties import penalize
from kernels.sampling_noise import gumbel_noise
from kernels.scratch import scratch

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
CHUNK = 2048
_BIG = tl.constexpr(2**31 - 1)


@triton.jit
def _chunk_kernel(x_ptr, val_ptr, idx_ptr, num_cols, stride_row, num_chunks, slots_ptr, tables_ptr,
                  inv_temp_ptr, seeds_ptr, positions_ptr, bits_ptr, words, live_ptr, covered,
                  CHUNK: tl.constexpr, PENALTY: tl.constexpr, NOISE: tl.constexpr, MASK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = cols < num_cols
    x = tl.load(x_ptr + row * stride_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
    if PENALTY:
        slot = tl.load(slots_ptr + row).to(tl.int64)
        if slot >= 0:
            counts_ptr = tl.load(tables_ptr).to(tl.pointer_type(tl.int32))
            prompt_ptr = tl.load(tables_ptr + 1).to(tl.pointer_type(tl.uint8))
            penalties_ptr = tl.load(tables_ptr + 2).to(tl.pointer_type(tl.float32))
            c = tl.load(counts_ptr + slot * num_cols + cols, mask=ok, other=0)
            p = tl.load(prompt_ptr + slot * num_cols + cols, mask=ok, other=0) != 0
            x = penalize(x, c, p, tl.load(penalties_ptr + slot * 3), tl.load(penalties_ptr + slot * 3 + 1),
                         tl.load(penalties_ptr + slot * 3 + 2))
    x = tl.where(x != x, float("inf"), x)  # NaN
    if NOISE:
        inv_t = tl.load(inv_temp_ptr + row)
        if inv_t > 0:  # a sampled row: Gumbel-max
            x = x * inv_t + gumbel_noise(tl.load(seeds_ptr + row), tl.load(positions_ptr + row), cols)
    if MASK:
        if tl.load(live_ptr + row, volatile=True) != 0:
            x = tl.where(allowed_columns(bits_ptr, row, words, cols, covered), x, float("-inf"))
    m = tl.max(x, axis=0)
    first = tl.min(tl.where((x == m) & ok, cols, _BIG), axis=0)  # an all -inf chunk: its first column
    tl.store(val_ptr + row * num_chunks + chunk, m)
    tl.store(idx_ptr + row * num_chunks + chunk, first)


@triton.jit
def _merge_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, num_cols, slots_ptr, tables_ptr,
                  CHUNKS_PAD: tl.constexpr, PENALTY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNKS_PAD)
    ok = offs < num_chunks
    v = tl.load(val_ptr + row * num_chunks + offs, mask=ok, other=float("-inf"))
    i = tl.load(idx_ptr + row * num_chunks + offs, mask=ok, other=_BIG)
    m = tl.max(v, axis=0)
    first = tl.min(tl.where((v == m) & ok, i, _BIG), axis=0)
    tl.store(out_ptr + row, first.to(out_ptr.dtype.element_ty))
    if PENALTY:
        slot = tl.load(slots_ptr + row).to(tl.int64)
        if slot >= 0:  # count the choice (the next step's penalties see it)
            at = tl.load(tables_ptr).to(tl.pointer_type(tl.int32)) + slot * num_cols + first
            tl.store(at, tl.load(at) + 1)


def argmax_rows(logits: torch.Tensor, num_cols: int, out: torch.Tensor | None = None,
                penalty: tuple[torch.Tensor, torch.Tensor] | None = None,
                noise: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                mask: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """out[r] = argmax(logits[r, :num_cols]) for every row, penalized where `penalty` gives the row a
    slot, sampled where `noise` gives it a temperature, among the allowed columns where `mask` has
    the row live. See the module docstring."""
    rows = logits.shape[0]
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits: [rows, cols], columns contiguous"
    assert 1 <= num_cols <= logits.shape[1]
    if out is None:
        out = torch.empty(rows, device=logits.device, dtype=torch.int64)
    assert out.shape == (rows,) and out.dtype in (torch.int32, torch.int64) and out.is_contiguous()
    slots = tables = inv_temp = seeds = positions = bits = live = out  # placeholders never read when off
    words = covered = 0
    if penalty is not None:
        slots, tables = penalty
        assert slots.shape == (rows,) and slots.dtype == torch.int32 and slots.is_contiguous()
        assert tables.shape == (3,) and tables.dtype == torch.int64
    if noise is not None:
        inv_temp, seeds, positions = noise
        assert inv_temp.dtype == torch.float32 and inv_temp.is_contiguous() and inv_temp.shape[0] >= rows
        assert seeds.dtype == torch.int64 and seeds.is_contiguous() and seeds.shape[0] >= rows
        assert positions.dtype in (torch.int32, torch.int64) and positions.is_contiguous()
        assert positions.shape[0] >= rows
    if mask is not None:
        bits, live, covered = mask
        assert bits.dtype == torch.int32 and bits.is_contiguous() and bits.shape[0] >= rows
        assert bits.shape[1] * 32 >= min(covered, num_cols) and 0 <= covered
        assert live.dtype == torch.int32 and live.is_contiguous() and live.shape[0] >= rows
        words = bits.shape[1]
    if rows == 0:
        return out
    chunk = 256 if _INTERPRET else CHUNK  # the interpreter runs programs one by one: any size is slow
    chunks = triton.cdiv(num_cols, chunk)
    dev = logits.device
    val = scratch(("argmax-max", dev), rows * chunks, torch.float32, dev)
    idx = scratch(("argmax-col", dev), rows * chunks, torch.int32, dev)
    on = penalty is not None
    # No multiply-add contraction: the penalties and the temperature round as their torch references do.
    _chunk_kernel[(rows, chunks)](logits, val, idx, num_cols, logits.stride(0), chunks, slots, tables,
                                  inv_temp, seeds, positions, bits, words, live, covered, CHUNK=chunk,
                                  PENALTY=on, NOISE=noise is not None, MASK=mask is not None,
                                  num_warps=1 if _INTERPRET else 4, enable_fp_fusion=False)
    _merge_kernel[(rows,)](val, idx, out, chunks, num_cols, slots, tables,
                           CHUNKS_PAD=max(2, triton.next_power_of_2(chunks)), PENALTY=on, num_warps=1)
    return out
