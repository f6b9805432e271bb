"""The randomness of sampled rows: Gumbel noise from a counter-based generator, so that a row's draw
is a pure function of (its seed, its position, the column) and sampling is an argmax.

Contract (semantics = ``kernels.reference.gumbel_noise_ref``):
  seed      a row's 64-bit key (an int64; negative seeds count by their two's complement bits).
  position  the position in its sequence of the token whose logits the row holds (the last input
            token of the row; the sampled token goes at position + 1), 0 <= position < 2**32.
  column    the token id, 0 <= column < 2**32.
  noise     g = -log(-log(u)), u = ((w >> 9) + 0.5) / 2**23 in (0, 1), where w is the first word of
            Philox-4x32-10 (Salmon et al., SC'11; the Random123 constants and key schedule) with
            key (seed & 0xFFFFFFFF, seed >> 32) and counter (column, position, 0, 0). All integer
            steps are exact; u is exact in float32; the logs are float32 (the kernel's may differ
            from torch's in the last bit).

Sampling with it (kernels/argmax.py `noise`): the row's choice is argmax over columns of
logits * (1 / temperature) + g, which draws from softmax(logits / temperature) (the Gumbel-max
trick: the same distribution as multinomial, or as the exponential race argmax(p / E)).

Why counter-based: a torch.Generator per seeded row cost one launch or two per row per step (at 64
seeded rows, ~1 ms of host time a step, more than the forward), and its state advanced with each
draw, so the draw depended on how many were made before. Here every row of a batch gets its noise in
the same launch as the argmax, a request's tokens depend on its seed and positions only (not on its
batch, a preemption or a recompute), and the CPU path (the reference) draws the same integers.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Philox-4x32's multipliers and key increments (Random123)
M0: tl.constexpr = tl.constexpr(0xD2511F53)
M1: tl.constexpr = tl.constexpr(0xCD9E8D57)
W0: tl.constexpr = tl.constexpr(0x9E3779B9)
W1: tl.constexpr = tl.constexpr(0xBB67AE85)
ROUNDS: tl.constexpr = tl.constexpr(10)


@triton.jit
def philox_word(seed, position, cols):
    """The first word of Philox-4x32-10 for counter (cols, position, 0, 0) under key `seed` (int64
    scalar); cols a block of column indices, position a scalar."""
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = cols.to(tl.uint32)
    c1 = tl.zeros_like(c0) + position.to(tl.uint32)
    c2 = tl.zeros_like(c0)
    c3 = tl.zeros_like(c0)
    for _ in tl.static_range(ROUNDS):
        a0, a2 = c0, c2
        c0 = tl.umulhi(a2, M1) ^ c1 ^ k0
        c2 = tl.umulhi(a0, M0) ^ c3 ^ k1
        c1 = a2 * M1
        c3 = a0 * M0
        k0 = k0 + W0
        k1 = k1 + W1
    return c0


@triton.jit
def gumbel_noise(seed, position, cols):
    """Gumbel(0, 1) noise [cols] float32 of one row (see the module docstring)."""
    w = philox_word(seed, position, cols)
    u = ((w >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(-tl.log(u))
