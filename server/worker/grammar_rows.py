"""Grammar-constrained rows on the worker: the host buffers a step's token masks are filled into, the
flag that says they are, and how the step's tokens are chosen from them.

A constrained step's masks need the previous step's tokens on the host and then XGrammar's fill,
while the step itself is enqueued before those tokens are known (asynchronous scheduling). So:

- Each constrained step takes a number and a pair of host buffers (`GrammarFill`: bits [rows, words]
  int32 in XGrammar's layout, live [rows] int32; pinned on a GPU). The engine's grammar job fills
  them, then raises the flag to the step's number (`GrammarFill.done`), also when the fill failed.
- On a GPU the step's choice is enqueued once the job is handed the fill: a kernel that waits on
  the device until the flag reaches the step's number, a copy of the masks to device memory, then
  the choice (kernels/grammar_mask.py). The host never waits for the fill: the next step is
  enqueued behind this one at once, and the fill runs while the device computes the forward.
- On the CPU nothing queues: the choice runs when its ids are first needed (the next launch, whose
  forward reads them, or collect), after waiting on the flag's condition.

Two pairs of buffers, by the step number's parity: the fill of step k+1 may start once step k's ids
are on the host, and must not write the buffers step k may still be reading.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from kernels.grammar_mask import wait_for_flag

FILL_TIMEOUT_S = 60.0  # the CPU path's wait for a fill before it fails the step


class GrammarFlag:
    """The number of the last step whose masks are filled: pinned host memory the device reads, and
    a condition the CPU path waits on."""

    def __init__(self, pinned: bool) -> None:
        self.value = torch.zeros(1, dtype=torch.int64, pin_memory=pinned)
        self._np = self.value.numpy()  # written through numpy: no torch op (and no GIL hand-off)
        self._cond = threading.Condition()

    def raise_to(self, step: int) -> None:
        with self._cond:
            self._np[0] = step  # after every write to the masks (one thread, x86's store order)
            self._cond.notify_all()

    def wait_for(self, step: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: int(self._np[0]) >= step, timeout)


@dataclass(slots=True)
class GrammarFill:
    """What the engine's grammar job fills for one constrained step: row r of `bits` is what the
    step's row r may choose, live[r] = 1 where that row is constrained (0: left alone)."""

    step: int
    bits: torch.Tensor  # [rows, words] int32 (pinned on a GPU)
    live: torch.Tensor  # [rows] int32 (likewise)
    flag: GrammarFlag

    @property
    def bits_np(self) -> np.ndarray:
        return self.bits.numpy()

    @property
    def live_np(self) -> np.ndarray:
        return self.live.numpy()

    def done(self) -> None:
        """The masks are written (or the fill failed, its rows left alone): release the step."""
        self.flag.raise_to(self.step)

    def wait(self, timeout: float = FILL_TIMEOUT_S) -> bool:
        return self.flag.wait_for(self.step, timeout)


class GrammarBuffers:
    """The two pairs of mask buffers and the flag, made when the first constrained step comes."""

    def __init__(self, max_rows: int, covered: int, device: torch.device) -> None:
        self.covered = covered  # the tokenizer's vocabulary: tokens past it are never allowed
        words = -(-covered // 32)
        pinned = device.type == "cuda"
        # where a GPU copies a step's masks once they are filled (reading them over the bus block
        # by block cost a round trip each)
        self.device_bits = torch.zeros(max_rows, words, dtype=torch.int32, device=device)
        self.device_live = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.bits = [torch.zeros(max_rows, words, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        self.live = [torch.zeros(max_rows, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        self.flag = GrammarFlag(pinned)
        # the step each parity's wait is for, written by the host before it queues the wait (which
        # reads it when it runs: a captured choice reads the step of its replay; see ChoiceGraphs)
        self.targets = torch.zeros(2, dtype=torch.int64, pin_memory=pinned)
        self._targets_np = self.targets.numpy()
        self.step = 0

    def next(self, rows: int) -> GrammarFill:
        self.step += 1
        k = self.step % 2
        return GrammarFill(self.step, self.bits[k][:rows], self.live[k][:rows], self.flag)

    def masks(self, fill: GrammarFill, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(bits, live) of a step for its choice. On a GPU: enqueued, a wait on the device for the
        fill's flag, then one copy to device memory (read block by block over the bus, the masks
        cost a round trip each); on the CPU the host buffers, once the fill is waited for."""
        if self.device_bits.device.type != "cuda":
            return fill.bits, fill.live
        wait_for_flag(fill.flag.value, self.target(fill))
        return (self.device_bits[:rows].copy_(fill.bits, non_blocking=True),
                self.device_live[:rows].copy_(fill.live, non_blocking=True))

    def target(self, fill: GrammarFill) -> torch.Tensor:
        """The wait target of the fill's parity, set to its step (a [1] view for the wait kernel).
        Step k's wait has run before the host queues step k + 2's: the host queues that one after
        collecting step k + 1, whose ids come after step k's choice."""
        k = fill.step % 2
        self._targets_np[k] = fill.step
        return self.targets[k : k + 1]
