"""The sampling noise (kernels/sampling_noise.py): Philox against Random123's known answers, the
kernel's words and Gumbel noise against the reference, and the sampled argmax (kernels/argmax.py
`noise`, `mask`) against sampled_argmax_ref (TRITON_INTERPRET=1 on CPU; see tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels.argmax import argmax_rows
from kernels.reference import (argmax_ref, grammar_mask_ref, gumbel_noise_ref, philox4x32_ref, philox_word_ref,
                               sampled_argmax_ref)
from kernels.sampling_noise import gumbel_noise, philox_word

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Random123's kat_vectors for philox4x32_10: (counter, key, output)
KATS = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("counter,key,want", KATS)
def test_reference_philox_gives_random123s_known_answers(counter, key, want):
    assert tuple(int(w) for w in philox4x32_ref(counter, key)) == want


def test_column_words_are_the_first_words_of_their_calls():
    """Column c of a row is the first word of the call with counter (c, position, 0, 0): seed 0 at
    position 0, column 0 gives Random123's first known answer; seed -1 (key words 0xFFFFFFFF and
    0xFFFFFFFF) at the last position, the direct call's first words."""
    assert int(philox_word_ref(torch.tensor([0]), torch.tensor([0]), 3)[0, 0]) == KATS[0][2][0]
    seed, position = -1, 0xFFFFFFFF
    words = philox_word_ref(torch.tensor([seed]), torch.tensor([position]), 40)[0]
    want = philox4x32_ref((torch.arange(40), position, 0, 0), (0xFFFFFFFF, 0xFFFFFFFF))[0]
    assert torch.equal(words, want)


@triton.jit
def _noise_kernel(seeds_ptr, positions_ptr, words_ptr, noise_ptr, num_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row)
    for start in range(0, num_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < num_cols
        tl.store(words_ptr + row * num_cols + cols, philox_word(seed, position, cols).to(tl.int64), mask=ok)
        tl.store(noise_ptr + row * num_cols + cols, gumbel_noise(seed, position, cols), mask=ok)


def test_kernel_words_and_noise_match_the_reference():
    """Seeds of every kind (0, negative, past 2**32, the int64 extremes) and positions up to 2**32 - 1,
    over a column count that is no multiple of the block."""
    seeds = torch.tensor([0, 1, -1, 2**40 + 5, 2**63 - 1, -(2**63), 12345], dtype=torch.int64)
    positions = torch.tensor([0, 7, 2**32 - 1, 100, 3, 2**31, 1], dtype=torch.int64)
    cols = 1000
    words = torch.zeros(len(seeds), cols, dtype=torch.int64, device=DEVICE)
    noise = torch.zeros(len(seeds), cols, device=DEVICE)
    _noise_kernel[(len(seeds),)](seeds.to(DEVICE), positions.to(DEVICE), words, noise, cols, BLOCK=256)
    assert torch.equal(words.cpu(), philox_word_ref(seeds, positions, cols))
    # the logs are float32 on either side; the device's may differ in the last bits
    torch.testing.assert_close(noise.cpu(), gumbel_noise_ref(seeds, positions, cols), rtol=1e-5, atol=1e-5)
    u_words = words.cpu() >> 9
    assert u_words.min() >= 0 and u_words.max() < 2**23  # u = (w + 0.5) / 2**23 stays in (0, 1)


def assert_same_choice(got: torch.Tensor, x: torch.Tensor, want: torch.Tensor) -> None:
    """got == want, or (the logs' last bits) a near tie: x [rows, cols] the reference's scores."""
    for r in (got != want).nonzero().flatten().tolist():
        assert abs(x[r, got[r]] - x[r, want[r]]) <= 1e-4 * max(1.0, abs(float(x[r, want[r]]))), (r, got[r], want[r])


def scores(logits, cols, inv_t, seeds, positions):
    x = logits[:, :cols].float().cpu()
    x = torch.where(x.isnan(), float("inf"), x)
    hot = inv_t > 0
    return torch.where(hot[:, None], x * inv_t[:, None] + gumbel_noise_ref(seeds, positions, cols), x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,cols,pad", [(1, 1, 0), (1, 50257, 47), (3, 255, 1), (6, 257, 64), (9, 2049, 15)])
def test_sampled_argmax_matches_the_reference(dtype, rows, cols, pad):
    """Greedy and sampled rows in one batch, temperatures from 0.05 to 20, padding columns of NaN
    never read, a NaN and an all -inf row."""
    g = torch.Generator().manual_seed(rows * 13 + cols)
    logits = (torch.randn(rows, cols + pad, generator=g) * 4).to(dtype)
    if pad:
        logits[:, cols:] = float("nan")
    if rows > 2:
        logits[1, cols // 2] = float("nan")
        logits[2, :cols] = float("-inf")
    inv_t = torch.tensor([(0.0, 1.0, 1 / 0.05, 1 / 20.0, 1.5)[r % 5] for r in range(rows)])
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=g)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    dev = logits.to(DEVICE)
    for out_dtype in (torch.int32, torch.int64):
        out = torch.full((rows,), -7, dtype=out_dtype, device=DEVICE)
        argmax_rows(dev, cols, out=out, noise=(inv_t.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE)))
        want = sampled_argmax_ref(logits, cols, inv_t, seeds, positions)
        assert_same_choice(out.long().cpu(), scores(logits, cols, inv_t, seeds, positions), want)
    greedy = inv_t == 0
    assert torch.equal(want[greedy], argmax_ref(logits, cols)[greedy])


def test_a_rows_draw_depends_on_its_seed_and_position_only():
    """The same (seed, position) chooses the same column at any row of any batch; the noise is
    not the batch's: a row's choice differs as its position or seed does."""
    cols = 3000
    row = torch.zeros(cols)  # uniform: the noise alone decides
    chosen = []
    for n, at in ((1, 0), (5, 3), (12, 11)):
        logits = torch.randn(n, cols)
        logits[at] = row
        seeds = torch.arange(n, dtype=torch.int64) * 1000
        positions = torch.arange(n, dtype=torch.int64) + 50
        seeds[at], positions[at] = 42, 9
        out = argmax_rows(logits.to(DEVICE), cols, noise=(torch.ones(n, device=DEVICE), seeds.to(DEVICE),
                                                          positions.to(DEVICE)))
        chosen.append(out[at].item())
    assert len(set(chosen)) == 1
    per_position = [argmax_rows(row[None].to(DEVICE), cols, noise=(torch.ones(1, device=DEVICE),
                                                                    torch.tensor([42], device=DEVICE),
                                                                    torch.tensor([p], device=DEVICE))).item()
                    for p in range(10)]
    assert len(set(per_position)) > 5 and per_position[9] == chosen[0]


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("rows,cols,covered", [(1, 1, 1), (4, 300, 290), (7, 2049, 1500)])
def test_masked_choice_matches_the_reference(sampled, rows, cols, covered):
    """mask: live rows choose among their allowed columns below `covered`, the others as without;
    a live row that allows nothing gets 0; the mask's words past `covered` are never read."""
    g = torch.Generator().manual_seed(rows + cols)
    logits = torch.randn(rows, cols + 5, generator=g) * 3
    words = -(-covered // 32)
    bits = torch.randint(-(2**31), 2**31, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    bits &= torch.randint(-(2**31), 2**31, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)  # sparser
    live = torch.tensor([(1, 0, 1, 1)[r % 4] for r in range(rows)], dtype=torch.int32)
    if rows > 3:
        bits[3] = 0  # allows nothing
    inv_t = torch.full((rows,), 0.8 if sampled else 0.0)
    seeds = torch.arange(rows, dtype=torch.int64) + 77
    positions = torch.arange(rows, dtype=torch.int64) * 3
    out = argmax_rows(logits.to(DEVICE), cols, mask=(bits.to(DEVICE), live.to(DEVICE), covered),
                      noise=(inv_t.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE)) if sampled else None)
    masked = grammar_mask_ref(logits, cols, bits, live, covered)
    want = sampled_argmax_ref(masked, cols, inv_t, seeds, positions)
    assert_same_choice(out.cpu(), scores(masked, cols, inv_t, seeds, positions), want)
    if rows > 3:
        assert out[3].item() == 0
    if rows > 1:
        assert out[1].item() == sampled_argmax_ref(logits[1:2], cols, inv_t[1:2], seeds[1:2], positions[1:2]).item()
