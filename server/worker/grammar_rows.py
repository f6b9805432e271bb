"""Grammar-constrained rows on the worker: the memory a step's token masks are filled into, the
flag that says they are, and how the step's tokens are chosen from them.

A constrained step's masks need the previous step's tokens on the host and then XGrammar's fill,
while the step itself is enqueued before those tokens are known (asynchronous scheduling). So:

- The masks are filled by the grammar process (server/engine/grammar_process.py) into memory it
  shares with this one (`MaskLayout`: two flags, then two pairs of buffers; page-locked and mapped
  for the device on a GPU). Each constrained step takes a number and the pair of its parity
  (`GrammarFill`: bits [rows, words] int32 in XGrammar's layout, live [rows] int32). The process
  fills them, then writes the step's number to the flag, also when the fill failed (then it writes
  the number to the second flag first, and leaves every row's live at 0).
- On a GPU the step's choice is enqueued once the process is sent the job: a kernel that waits on
  the device until the flag reaches the step's number, a copy of the masks to device memory, then
  the choice (kernels/grammar_mask.py). The host never waits for the fill: the next step is
  enqueued behind this one at once, and the fill runs while the device computes the forward.
- On the CPU nothing queues: the choice runs when its ids are first needed (the next launch, whose
  forward reads them, or collect), after polling the flag.

Two pairs of buffers, by the step number's parity: the fill of step k+1 may start once step k's ids
are on the host, and must not write the buffers step k may still be reading.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kernels.grammar_mask import wait_for_flag

FILL_TIMEOUT_S = 60.0  # the CPU path's wait for a fill before it fails the step
POLL_S = 5e-5  # the CPU path's poll of the flag


@dataclass(frozen=True)
class MaskLayout:
    """Where the masks lie in the shared memory: flags int64 [2] (the last step filled, the last
    step whose fill failed), live int32 [2][rows], bits int32 [2][rows, words], each part 64-byte
    aligned. The grammar process and the runner map the same bytes by this."""

    rows: int
    words: int

    def _offsets(self) -> tuple[int, int, int]:
        up = lambda n: -(-n // 64) * 64  # noqa: E731
        live = 64
        bits = live + 2 * up(4 * self.rows)
        return live, bits, bits + 2 * up(4 * self.rows * self.words)

    @property
    def nbytes(self) -> int:
        return self._offsets()[2]

    def views(self, buffer) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
        """(flags [2] int64, live [2] of [rows] int32, bits [2] of [rows, words] int32) over `buffer`."""
        live, bits, _ = self._offsets()
        stride_live, stride_bits = (bits - live) // 2, (self.nbytes - bits) // 2
        flags = np.frombuffer(buffer, np.int64, 2, 0)
        lives = [np.frombuffer(buffer, np.int32, self.rows, live + k * stride_live) for k in range(2)]
        bitss = [np.frombuffer(buffer, np.int32, self.rows * self.words, bits + k * stride_bits)
                 .reshape(self.rows, self.words) for k in range(2)]
        return flags, lives, bitss


class GrammarFlag:
    """The number of the last step whose masks are filled (and of the last whose fill failed), in
    the shared memory: the device reads the first, the CPU path polls it (while `alive()`)."""

    def __init__(self, flags: np.ndarray, alive: Callable[[], bool]) -> None:
        self._np = flags
        self.alive = alive
        self.value = torch.from_numpy(flags[:1])  # what the device's wait reads

    def wait_for(self, step: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        polls = 0
        while int(self._np[0]) < step:
            polls += 1
            if time.monotonic() > deadline or (polls % 100 == 0 and not self.alive()):
                return False
            time.sleep(POLL_S)
        return True


@dataclass(slots=True)
class GrammarFill:
    """What the grammar process fills for one constrained step: row r of `bits` is what the step's
    row r may choose, live[r] = 1 where that row is constrained (0: left alone)."""

    step: int
    bits: torch.Tensor  # [rows, words] int32, in the shared memory
    live: torch.Tensor  # [rows] int32, likewise
    flag: GrammarFlag

    def wait(self, timeout: float = FILL_TIMEOUT_S) -> bool:
        return self.flag.wait_for(self.step, timeout)


@dataclass(frozen=True)
class MaskMemory:
    """The shared memory the engine's grammar process fills (the engine hands it to the runner)."""

    buffer: object  # writable, layout.nbytes (an mmap of a memfd both processes map)
    layout: MaskLayout
    covered: int  # the tokenizer's vocabulary: tokens past it are never allowed
    alive: Callable[[], bool]  # whether a grammar process is there to fill them


class GrammarBuffers:
    """The two pairs of mask buffers and the flags over the shared memory, and the device's copies;
    made when the first constrained step comes."""

    def __init__(self, memory: MaskMemory, device: torch.device) -> None:
        self.covered = memory.covered
        layout = memory.layout
        rows, words = layout.rows, layout.words
        flags, lives, bitss = layout.views(memory.buffer)
        self._unregister: weakref.finalize | None = None
        if device.type == "cuda":  # page-locked and mapped: async copies from it, and the wait reads it
            base = torch.from_numpy(np.frombuffer(memory.buffer, np.uint8))
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(base.data_ptr(), layout.nbytes, 3)  # portable | mapped
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of the grammar masks failed: {err}")
            # Unregistered by close(), or when these buffers go without it (an engine dropped
            # unclosed): before the views below let go of the memory, which may then be unmapped
            # and a later mapping at the same address fail to register.
            self._unregister = weakref.finalize(self, cudart.cudaHostUnregister, base.data_ptr())
        # where a GPU copies a step's masks once they are filled (reading them over the bus block
        # by block cost a round trip each)
        self.device_bits = torch.zeros(rows, words, dtype=torch.int32, device=device)
        self.device_live = torch.zeros(rows, dtype=torch.int32, device=device)
        self.bits = [torch.from_numpy(b) for b in bitss]
        self.live = [torch.from_numpy(v) for v in lives]
        self.flag = GrammarFlag(flags, memory.alive)
        # the step each parity's wait is for, written by the host before it queues the wait (which
        # reads it when it runs: a captured choice reads the step of its replay; see ChoiceGraphs)
        self.targets = torch.zeros(2, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._targets_np = self.targets.numpy()
        self.step = int(flags[0])  # a new grammar process starts its numbers past the last one

    def close(self) -> None:
        """Unregister the shared memory from CUDA (before it is unmapped)."""
        if self._unregister is not None:
            self._unregister()  # once: a finalizer that has run does nothing

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
