"""The small all-reduce of tensor parallelism on one host's CUDA GPUs: a one-shot over symmetric
memory in one kernel of ours (kernels/one_shot_all_reduce.py), vLLM's "custom all-reduce".

Why: a decode step's row-parallel sums are a few rows (8 KB a row at Llama-3.1-8B's hidden 4096),
two a layer, and NCCL's all-reduce of such a message costs 10.6 us in a CUDA graph on two H100s
(13.8 at four), whatever its size: 64 a token at the 8B shape, 0.68 ms of the 4.32 ms TPOT at TP=2
against a weight-read floor of 2.68 ms. torch's own one-shot (torch.ops.symm_mem, two barriers over
signal pads around the loads) measured 9.3 us: no faster in TPOT (tp_llama-3.1-8b_h100.json).

How: every rank holds one buffer of symmetric memory (`torch.distributed._symmetric_memory.empty`;
`rendezvous`, once at start-up, maps each rank's buffer into every other's address space over
NVLink), filled with the kernel's sentinel before it is shared. The kernel pushes this rank's part
into every rank's buffer and sums what arrives in its own, with no barrier (the values' bits say
whether they have arrived; its docstring has the protocol). It runs on the current stream, so the
decode and prefill CUDA graphs capture it like any other kernel; its call count lives on the
device, so a replay needs nothing re-registered. Every rank gets the same bits: each element summed
in fp32 in rank order, rounded once (at two ranks, NCCL's sum).

NVLink multicast (NVLS) stays off (server/worker/parallel/peers.py NCCL_ENV; the GPU machines
require it): the kernel's peer-to-peer stores and local loads need none.

What it serves (`fits`): bf16 and fp16 (the sentinel is -0.0's 16 bits; fp32 goes to NCCL),
contiguous, on this rank's device, up to `max_bytes(size)`. A one-shot rank sends the whole message
to each of the size - 1 others, where NCCL's ring moves about twice the message in total, so it wins
while latency, not bandwidth, is the cost: vLLM's custom all-reduce uses its one-shot kernel at two
GPUs for any message up to its buffer, at up to four below 512 KB, at up to eight below 256 KB. Here
2 MiB at two ranks: a decode step of up to 256 rows (--max-num-seqs' default) at hidden 4096, 128 at
8192 (2 MiB: 15.6 us against NCCL's 31.3 on two H200s). At three or four, 1 MiB: 64 rows at hidden
8192 (four H200s, in a CUDA graph: 1 MiB 19.1 us against NCCL's 22.3, 2 MiB 36.1 against 31.5;
benchmarks/results/tp_llama-3.1-70b_h200.json). At up to eight, vLLM's 256 KiB (not measured
here). Larger messages (long prefill chunks, bandwidth-bound) go to NCCL. The buffer holds two
parities of one slot per rank of that size: 8 MiB of each GPU at two or four ranks, 6 MiB at
three, 4 MiB at eight.
Deterministic mode keeps its own path (group.py).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.one_shot_all_reduce import SENTINEL, one_shot_add_rmsnorm, one_shot_all_reduce
from kernels.rms_norm import MAX_ROW

log = logging.getLogger("flashpage.parallel")

MIB = 1 << 20
DTYPES = (torch.bfloat16, torch.float16)  # the kernel's (its sentinel is -0.0 in both)


def max_bytes(size: int) -> int:
    """The largest message the one-shot serves at `size` ranks (0: none; see the module's docstring)."""
    if size < 2:
        return 0
    if size == 2:
        return 2 * MIB
    if size <= 4:
        return MIB
    return MIB // 4 if size <= 8 else 0


@dataclass(frozen=True, eq=False)
class SymmAllReduce:
    """This rank's end of the one-shot all-reduce: its symmetric buffer and the kernel's arguments."""

    buffer: torch.Tensor  # int16 [2, size, slot_elems]: this rank's symmetric memory (the kernel's layout)
    buffers: torch.Tensor  # int64 [size] on the device: every rank's buffer address, in rank order
    state: torch.Tensor  # int32 [2] on the device: the kernel's call count and finished programs
    rank: int
    max_programs: int  # the kernel's programs at most: the device's SM count
    handle: object = None  # rendezvous's handle (held for the buffer's lifetime)

    @property
    def slot_elems(self) -> int:
        return self.buffer.shape[-1]

    def fits(self, x: torch.Tensor) -> bool:
        """Whether this all-reduce serves x (else NCCL's): the same answer on every rank, which
        holds the same shape and dtype."""
        return (x.dtype in DTYPES and x.device == self.buffer.device and x.is_contiguous()
                and 0 < x.numel() <= self.slot_elems)

    def fits_add_rmsnorm(self, part: torch.Tensor, x: torch.Tensor) -> bool:
        """Whether add_rmsnorm serves this row-parallel output and residual stream (the same answer
        on every rank)."""
        return (self.fits(part) and part.dim() == 2 and x.shape == part.shape and x.dtype == part.dtype
                and x.stride(1) == 1 and part.shape[1] <= MAX_ROW)

    def add_rmsnorm(self, part: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x += the sum of part over the ranks (in place), then (x, RMSNorm(x)): in one launch, the
        bits of add_rmsnorm(x, self(part), ...). Every rank calls it where it would call self."""
        return one_shot_add_rmsnorm(part, x, weight, eps, self.buffers, self.state, self.rank, self.slot_elems,
                                    self.max_programs)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, a new tensor (x is left as it was). Every rank calls it with
        its part, in the same order as its other collectives."""
        out = torch.empty_like(x)
        one_shot_all_reduce(x.view(-1), out.view(-1), self.buffers, self.state, self.rank, self.slot_elems,
                            self.max_programs)
        return out


# Group names this process has set symmetric memory up for. A second set-up under one name in one
# process (a second engine after the first closed: the tests build them so) never completed on two
# H200s (torch 2.11.0, 2026-11-28): rank 1's rendezvous lost its store and rank 0 waited for good. So
# start() refuses it, on every rank, and that group's all-reduces are NCCL's.
_SET_UP: set[str] = set()


def unsupported(size: int, device: torch.device) -> str | None:
    """Why the one-shot cannot serve a group of `size` ranks on `device`, where every rank's answer
    is the same (None: it may; peer access is checked with the group, in `start`)."""
    if device.type != "cuda":
        return f"{device.type} is not a CUDA device"
    if not max_bytes(size):
        return f"{size} ranks (it serves 2 to 8)"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except (ImportError, RuntimeError) as e:
        return f"torch {torch.__version__} has no symmetric memory ({e})"
    return None


def start(rank: int, size: int, device: torch.device, group_name: str, agree: Callable[[bool], bool],
          devices: Callable[[], list[int]], nbytes: int | None = None) -> SymmAllReduce | None:
    """This rank's SymmAllReduce (None where it cannot run: logged once, here, and every all-reduce
    stays NCCL's). Every rank of the group calls it, right after the group starts and before any
    CUDA graph capture. `agree(ok)`: whether every rank's ok is true (a collective); `devices()`:
    every rank's CUDA device index (a collective); `nbytes`: the buffer's size (default max_bytes)."""
    why = unsupported(size, device)
    if why is not None:  # the same on every rank: none of them goes on to the collectives below
        if rank == 0:
            (log.info if device.type != "cuda" else log.warning)(
                "custom all-reduce: off (%s); the group's all-reduces are %s's", why,
                "NCCL" if device.type == "cuda" else "gloo")
        return None
    peers = [d for d in devices() if d != device.index]
    fresh = group_name not in _SET_UP  # (rank 0's process is the one that lives on; the others are new)
    if not agree(fresh and all(torch.cuda.can_device_access_peer(device, d) for d in peers)):
        if rank == 0:
            log.warning("custom all-reduce: off (%s); NCCL's all-reduces",
                        "the group's GPUs are not all peer-accessible" if fresh else
                        f"this process set symmetric memory up for a group named {group_name!r} before")
        return None
    _SET_UP.add(group_name)
    comm = None
    try:
        comm = _register(rank, size, device, group_name, nbytes or max_bytes(size))
    except Exception:  # noqa: BLE001 - any failure of the set-up leaves NCCL's path, which works
        log.warning("custom all-reduce: symmetric memory set-up failed on rank %d", rank, exc_info=True)
    if not agree(comm is not None):
        if rank == 0:
            log.warning("custom all-reduce: off (its set-up failed on a rank); NCCL's all-reduces")
        return None
    if rank == 0:
        log.info("custom all-reduce: one-shot over symmetric memory for 16-bit messages up to %d KiB (%d ranks)",
                 comm.slot_elems * 2 // 1024, size)
    return comm


def _register(rank: int, size: int, device: torch.device, group_name: str, nbytes: int) -> SymmAllReduce:
    """Allocate this rank's buffer, fill it with the sentinel and register it with the group (a
    collective: when it returns, every rank's buffer is filled and mapped)."""
    import torch.distributed._symmetric_memory as symm_mem

    if torch.torch_version.TorchVersion(torch.__version__) < "2.11":
        # before 2.11 the group's store had to be handed over first (deprecated since; pytorch#172163)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)
    if hasattr(symm_mem, "get_backend") and symm_mem.get_backend(device) not in (None, "CUDA"):
        symm_mem.set_backend("CUDA")  # CUDA IPC's peer mappings (not NVSHMEM's or NCCL's windows)
    slot_elems = nbytes // 2
    buffer = symm_mem.empty(2 * size * slot_elems, dtype=torch.int16, device=device)
    buffer.fill_(SENTINEL)
    torch.cuda.synchronize(device)  # filled before any peer can write into it (rendezvous waits for all)
    handle = symm_mem.rendezvous(buffer, group_name)
    # the peers' buffers sit at the same offset into their allocations as this one into its own
    offset = buffer.data_ptr() - handle.buffer_ptrs[rank]
    buffers = torch.tensor([p + offset for p in handle.buffer_ptrs], dtype=torch.int64, device=device)
    state = torch.zeros(2, dtype=torch.int32, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return SymmAllReduce(buffer.view(2, size, slot_elems), buffers, state, rank, sms, handle)
