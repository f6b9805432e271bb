"""one_shot_all_reduce against all_reduce_ref, its ranks emulated in one process (TRITON_INTERPRET=1 on
the CPU; on one GPU there, every rank's buffer on it; tests/gpu/test_gpu_tp.py runs it across two GPUs against NCCL's sum, eagerly and in graphs).

The ranks' kernels run one after another here, not at once: before rank r's kernel runs, the parts
of the ranks after it (which have not run yet) are put into its buffer as their kernels would have
sent them, so that it finds every part there; the kernels of those ranks then send them again, after
rank r has read and cleared its buffer, and the emulation checks and clears that second copy. So the
tests see where each rank sends its part, what it reads, sums and clears, and how the call count
alternates the parities; not the waiting itself, which needs ranks that run at once (the GPU test).
"""

from __future__ import annotations

import pytest
import torch

from kernels.one_shot_all_reduce import SENTINEL, one_shot_add_rmsnorm, one_shot_all_reduce
from kernels.reference import all_reduce_ref
from kernels.rms_norm import add_rmsnorm

from tests.helpers import bits  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (on one GPU: the ranks' buffers all on it)


class Ranks:
    """`world` ranks' buffers (int16 [2, world, slot]), their addresses and states, in one process."""

    def __init__(self, world: int, slot: int):
        self.world, self.slot = world, slot
        self.buffers = [torch.full((2, world, slot), SENTINEL, dtype=torch.int16, device=DEVICE) for _ in range(world)]
        self.addresses = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64, device=DEVICE)
        self.states = [torch.zeros(2, dtype=torch.int32, device=DEVICE) for _ in range(world)]
        self.calls = 0

    def all_reduce(self, parts: list[torch.Tensor], max_programs: int = 64) -> list[torch.Tensor]:
        def run(r: int, part: torch.Tensor) -> torch.Tensor:
            return one_shot_all_reduce(part, torch.empty_like(part), self.addresses, self.states[r], r, self.slot,
                                       max_programs)
        return self.call(parts, run)

    def call(self, parts: list[torch.Tensor], run) -> list:
        """run(r, parts[r]) for each rank in turn (its kernel), each finding the later ranks' parts."""
        parity, n = self.calls % 2, parts[0].numel()
        sent = [_as_sent(p) for p in parts]
        outs = []
        for r in range(self.world):
            for later in range(r + 1, self.world):  # what their kernels would have sent by now
                self.buffers[r][parity, later, :n] = sent[later]
            outs.append(run(r, parts[r]))
        for r in range(self.world):
            for later in range(r + 1, self.world):  # their second copy, sent after rank r cleared its buffer
                assert torch.equal(self.buffers[r][parity, later, :n], sent[later])
                self.buffers[r][parity, later, :n] = SENTINEL
        self.calls += 1
        return outs

    def clean(self) -> bool:
        return all(bool((b == SENTINEL).all()) for b in self.buffers)


def _as_sent(x: torch.Tensor) -> torch.Tensor:
    """x's bits as a rank sends them: -0.0 as +0.0."""
    b = x.reshape(-1).view(torch.int16).clone()
    b[b == SENTINEL] = 0
    return b


def _same(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """The same bits, but for a NaN's (any NaN where the reference has one)."""
    nan = ref.isnan()
    return torch.equal(out.isnan(), nan) and torch.equal(bits(out)[~nan], bits(ref)[~nan])


def _parts(world: int, n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    parts = [(torch.randn(n, generator=g) * 4).to(dtype).to(DEVICE) for _ in range(world)]
    parts[0][: min(n, 3)] = -0.0  # the sentinel's value: sent as +0.0
    if n > 8:
        parts[-1][5] = -0.0  # -0.0 from every rank at one element (sums to +0.0 here)
        parts[0][5] = -0.0
        parts[1][6], parts[0][7] = float("nan"), float("inf")  # not the sentinel: summed as they are
    return parts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world,n,max_programs", [(2, 1, 64), (2, 5, 64), (2, 4096, 64), (2, 1025, 64),
                                                  (3, 1023, 64), (4, 3000, 2), (2, 5000, 1)])
def test_sums_every_ranks_part_and_leaves_the_buffers_clean(world, n, max_programs, dtype):
    ranks = Ranks(world, slot=5000)
    for call, size in enumerate([n, max(1, n // 3), n]):  # parity 0, 1, then 0 again with a longer message
        parts = _parts(world, size, dtype, seed=call)
        before = [p.clone() for p in parts]
        outs = ranks.all_reduce(parts, max_programs)
        ref = all_reduce_ref(parts)
        for r, out in enumerate(outs):
            assert _same(out, ref), f"rank {r}, call {call}"
        assert all(torch.equal(bits(p), bits(b)) for p, b in zip(parts, before))  # the parts left as they were
        assert ranks.clean(), f"a buffer holds data after call {call}"
        assert all(s.tolist() == [call + 1, 0] for s in ranks.states)


def test_negative_zero_is_sent_as_zero_and_sums_as_the_reference_does():
    ranks = Ranks(2, slot=16)
    parts = [torch.tensor([-0.0, -0.0, 1.0, -0.0], dtype=torch.bfloat16, device=DEVICE),
             torch.tensor([-0.0, 2.0, -0.0, -1.0], dtype=torch.bfloat16, device=DEVICE)]
    outs = ranks.all_reduce(parts)
    assert outs[0].tolist() == outs[1].tolist() == [0.0, 2.0, 1.0, -1.0]
    assert bits(outs[0])[0].item() == 0  # +0.0: -0.0 never reaches the sum


def test_the_reference_rounds_once_after_an_fp32_sum():
    parts = [torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([2 ** -8], dtype=torch.bfloat16),
             torch.tensor([2 ** -8], dtype=torch.bfloat16)]
    assert all_reduce_ref(parts).item() == 1.0 + 2 ** -7  # two bf16 adds would round 1 + 2^-8 to 1 twice (a tie, to even)


def test_refuses_what_its_contract_does_not_cover():
    ranks = Ranks(2, slot=8)
    with pytest.raises(AssertionError, match="16-bit"):
        one_shot_all_reduce(torch.zeros(4, device=DEVICE), torch.zeros(4, device=DEVICE), ranks.addresses,
                            ranks.states[0], 0, 8, 4)
    with pytest.raises(AssertionError, match="9 elements"):
        x = torch.zeros(9, dtype=torch.bfloat16, device=DEVICE)
        one_shot_all_reduce(x, torch.empty_like(x), ranks.addresses, ranks.states[0], 0, 8, 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world,rows,hidden,max_programs", [(2, 1, 4096, 64), (2, 3, 1000, 64), (4, 5, 64, 2),
                                                             (3, 2, 96, 1)])
def test_fused_add_rmsnorm_is_the_all_reduce_then_add_rmsnorm(world, rows, hidden, max_programs, dtype):
    """one_shot_add_rmsnorm: the residual stream plus the sum of the ranks' parts, written into x, and
    its RMSNorm, bit for bit what add_rmsnorm makes of the all-reduce's output, on every rank; the
    buffers left clean, the call counted (then a plain all-reduce of the other parity follows)."""
    ranks = Ranks(world, slot=5000)
    g = torch.Generator().manual_seed(rows)
    parts = [(torch.randn(rows, hidden, generator=g) * 2).to(dtype).to(DEVICE) for _ in range(world)]
    parts[0][0, :2] = -0.0
    residual = (torch.randn(rows, hidden, generator=g) * 4).to(dtype).to(DEVICE)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype).to(DEVICE)
    want_x, want_h = add_rmsnorm(residual.clone(), all_reduce_ref(parts), weight, 1e-5)
    xs = [residual.clone() for _ in range(world)]

    def run(r, part):
        return one_shot_add_rmsnorm(part, xs[r], weight, 1e-5, ranks.addresses, ranks.states[r], r, ranks.slot,
                                    max_programs)

    for r, (x, h) in enumerate(ranks.call(parts, run)):
        assert x is xs[r] and torch.equal(bits(x), bits(want_x)), f"rank {r}: the residual"
        assert torch.equal(bits(h), bits(want_h)), f"rank {r}: the norm"
    assert ranks.clean() and all(s.tolist() == [1, 0] for s in ranks.states)
    again = _parts(world, 7, dtype, seed=5)
    assert all(_same(out, all_reduce_ref(again)) for out in ranks.all_reduce(again)) and ranks.clean()
