"""The small all-reduce of tensor parallelism on one host's CUDA GPUs, over PyTorch's symmetric
memory: vLLM's "custom all-reduce" (its SymmMemCommunicator calls the same torch ops).

Why: a decode step's row-parallel sums are a few rows (8 KB a row at Llama-3.1-8B's hidden 4096),
two a layer, and NCCL's all-reduce of such a message costs ~20-30 us of latency whatever its size.
At two H100s the Llama-3.1-8B shape's batch-1 TPOT was 4.33 ms at TP=2 against a weight-read floor
of 2.68 ms; its 64 all-reduces a token account for most of the difference.

How: every rank holds one buffer of symmetric memory (`torch.distributed._symmetric_memory.empty`;
`rendezvous`, once at start-up, maps each rank's buffer into every other's address space over
NVLink). `torch.ops.symm_mem.one_shot_all_reduce_out` is then one kernel: the ranks meet at a
barrier on the buffers' signal pads, each loads every rank's buffer (peer-to-peer) and sums them in
rank order (every rank gets the same bits; at two ranks, the one rounded bf16 add NCCL makes too),
and a second barrier keeps the buffer from being overwritten while a peer still reads it. The input
goes into the buffer first: inside the kernel where torch has `one_shot_all_reduce_copy_out` and the
message is 16-byte aligned (Llama's hidden sizes are), else by a copy before it (an odd size is
padded to 16 bytes; the padding's sum is dropped). It runs on the current stream, so the decode and
prefill CUDA graphs capture it like any other kernel; the buffer is the same every call, so a
replay needs nothing re-registered.

NVLink multicast (NVLS) stays off (server/worker/parallel/peers.py NCCL_ENV; the GPU machines
require it): no multimem op is used, and the one-shot's peer-to-peer loads need none.

What it serves (`fits`): bf16 and fp32 (the ops' dtypes; fp16 goes to NCCL), contiguous, on this
rank's device, up to `max_bytes(size)`. A one-shot rank reads the whole message from each of the
size - 1 others, where NCCL's ring moves about twice the message in total, so it wins while latency,
not bandwidth, is the cost: vLLM's custom all-reduce uses its one-shot kernel at two GPUs for any
message up to its buffer, at up to four below 512 KB, at up to eight below 256 KB. Here 2 MiB at
two ranks: a decode step of up to 256 rows (--max-num-seqs' default) at hidden 4096, 128 at 8192;
larger messages (long prefill chunks, bandwidth-bound) go to NCCL. The buffer is that size (it
serves nothing larger): 2 MiB of each GPU. Deterministic mode keeps its own path (group.py).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("flashpage.parallel")

MIB = 1 << 20
DTYPES = (torch.bfloat16, torch.float32)  # the one-shot kernel's (AT_DISPATCH_FLOAT_AND_BFLOAT16)
ALIGN = 16  # bytes: the kernel's widest vector access; the buffer's share and the in-kernel copy's rule


def max_bytes(size: int) -> int:
    """The largest message the one-shot serves at `size` ranks (0: none; see the module's docstring)."""
    if size < 2:
        return 0
    if size == 2:
        return 2 * MIB
    if size <= 4:
        return MIB // 2
    return MIB // 4 if size <= 8 else 0


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _ops():
    return torch.ops.symm_mem


@dataclass(frozen=True, eq=False)
class SymmAllReduce:
    """This rank's end of the one-shot all-reduce: its symmetric buffer, registered with the group."""

    buffer: torch.Tensor  # uint8 [max bytes]: this rank's symmetric memory
    group_name: str  # the process group it was registered with (the ops take its name)
    copy_in_kernel: bool  # torch has one_shot_all_reduce_copy_out (the input copied in by the kernel)
    handle: object = None  # rendezvous's handle (held for the buffer's lifetime)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether this all-reduce serves x (else NCCL's): the same answer on every rank, which
        holds the same shape and dtype."""
        nbytes = x.numel() * x.element_size()
        return (x.dtype in DTYPES and x.device == self.buffer.device and x.is_contiguous()
                and 0 < _round_up(nbytes, ALIGN) <= self.buffer.numel())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, a new tensor (x is left as it was). Every rank calls it with
        its part, in the same order as its other collectives."""
        n, item = x.numel(), x.element_size()
        padded = _round_up(n * item, ALIGN) // item
        # a view at the buffer's start: the pointer rendezvous registered (some torch versions find
        # the registration by the exact pointer, not by any address inside the buffer)
        symm = self.buffer.view(x.dtype)[:padded]
        out = torch.empty(padded, dtype=x.dtype, device=x.device)
        flat = x.view(-1)
        if self.copy_in_kernel and padded == n and (x.storage_offset() * item) % ALIGN == 0:
            _ops().one_shot_all_reduce_copy_out(symm, flat, "sum", self.group_name, out)
        else:
            symm[:n].copy_(flat)
            _ops().one_shot_all_reduce_out(symm, "sum", self.group_name, out)
        return out[:n].view(x.shape)


def unsupported(size: int, device: torch.device) -> str | None:
    """Why the one-shot cannot serve a group of `size` ranks on `device`, where every rank's answer
    is the same (None: it may; peer access is checked with the group, in `start`)."""
    if device.type != "cuda":
        return f"{device.type} is not a CUDA device"
    if not max_bytes(size):
        return f"{size} ranks (it serves 2 to 8)"
    try:
        if not hasattr(_ops(), "one_shot_all_reduce_out"):
            return f"torch {torch.__version__} has no torch.ops.symm_mem.one_shot_all_reduce_out"
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
    if not agree(all(torch.cuda.can_device_access_peer(device, d) for d in peers)):
        if rank == 0:
            log.warning("custom all-reduce: off (the group's GPUs are not all peer-accessible); NCCL's all-reduces")
        return None
    comm = None
    try:
        comm = _register(device, group_name, nbytes or max_bytes(size))
    except Exception:  # noqa: BLE001 - any failure of the set-up leaves NCCL's path, which works
        log.warning("custom all-reduce: symmetric memory set-up failed on rank %d", rank, exc_info=True)
    if not agree(comm is not None):
        if rank == 0:
            log.warning("custom all-reduce: off (its set-up failed on a rank); NCCL's all-reduces")
        return None
    if rank == 0:
        log.info("custom all-reduce: one-shot over symmetric memory for messages up to %d KiB (%d ranks)%s",
                 comm.buffer.numel() // 1024, size, "" if comm.copy_in_kernel else ", input copied in before it")
    return comm


def _register(device: torch.device, group_name: str, nbytes: int) -> SymmAllReduce:
    """Allocate this rank's buffer and register it with the group (a collective)."""
    import torch.distributed._symmetric_memory as symm_mem

    if torch.torch_version.TorchVersion(torch.__version__) < "2.11":
        # before 2.11 the group's store had to be handed over first (deprecated since; pytorch#172163)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)
    if hasattr(symm_mem, "get_backend") and symm_mem.get_backend(device) not in (None, "CUDA"):
        symm_mem.set_backend("CUDA")  # CUDA IPC's peer mappings (not NVSHMEM's or NCCL's windows)
    buffer = symm_mem.empty(_round_up(nbytes, ALIGN), dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buffer, group_name)
    return SymmAllReduce(buffer, group_name, hasattr(_ops(), "one_shot_all_reduce_copy_out"), handle)
