"""The tensor-parallel group a model runs in: this process's rank among the processes that split one
model, and the collectives its sharded layers call (models/parallel/layers.py).

One process per rank (server/worker/parallel/ starts them and the group); every rank runs the same
forward over its shard of the weights, and the collectives here join the shards: an all-reduce
after each row-parallel projection and after the vocabulary-parallel embedding, an all-gather of
the LM head's columns (every rank gets the whole logits; rank 0 chooses the tokens), and a
broadcast of the ids rank 0 chose (the placeholders of the next step name them: models/base.py).
NCCL on CUDA (captured in the CUDA graphs like any other kernel), gloo on the CPU. Size 1, the
default, is one process with the whole model, and every collective is a no-op.

The custom all-reduce (`init_tensor_parallel(custom_all_reduce=True)`, the server's default; off
with --disable-custom-all-reduce): on CUDA, an all-reduce of a message that fits (bf16 or fp16, up to
2 MiB at two ranks: a decode step's rows) is a one-shot over symmetric memory instead of NCCL's
(models/parallel/symm_all_reduce.py), also inside the CUDA graphs; larger ones, other dtypes, and
a group where it cannot be set up (logged once at start-up) keep NCCL's. It returns a new tensor,
not x: callers use the returned sum.

Deterministic mode (`invariant`): NCCL sums a buffer in an order that follows its size (each rank
reduces its own chunk of it, and the algorithm is picked by size), so a row's sum could change
with the batch. The invariant all-reduce gathers every rank's part and adds them in rank order
(the custom all-reduce is not used there).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from models.parallel import symm_all_reduce
from models.parallel.symm_all_reduce import SymmAllReduce
from models.spec import ModelSpec

TIMEOUT = timedelta(minutes=30)  # a collective that waits longer for a rank fails (a slow rank's load included)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # the one-shot all-reduce over symmetric memory where it is on and set up (None: NCCL's, or gloo's)
    custom: SymmAllReduce | None = field(default=None, compare=False, repr=False)

    def split(self, n: int, what: str) -> int:
        """This rank's share of n (heads, columns, ...), which must divide evenly."""
        if n % self.size:
            raise ValueError(f"--tensor-parallel-size {self.size} does not divide the model's {what} ({n})")
        return n // self.size

    def all_reduce(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """The sum of x over the ranks: x itself, summed in place, where NCCL (or gloo) sums it; a new
        tensor where the custom all-reduce does, or invariant."""
        if self.size == 1:
            return x
        if not invariant:
            if self.custom is not None and self.custom.fits(x):
                return self.custom(x)
            dist.all_reduce(x)
            return x
        parts = _all_gather(x)
        total = parts[0].float()
        for part in parts[1:]:  # in rank order, one add at a time: the same bits whatever the batch
            total += part
        return total.to(x.dtype)

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[n, cols] on each rank -> [n, size * cols]: rank r's columns at r * cols (the vocabulary
        shards of the LM head, in order)."""
        if self.size == 1:
            return x
        parts = _all_gather(x)  # [size, n, cols]
        return parts.permute(1, 0, 2).reshape(x.shape[0], -1)

    def broadcast(self, x: torch.Tensor) -> None:
        """Rank 0's x into every rank's x."""
        if self.size > 1:
            dist.broadcast(x, 0)

    def min(self, n: int, device: torch.device) -> int:
        """The smallest n of any rank."""
        if self.size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def _all_gather(x: torch.Tensor) -> torch.Tensor:
    """[size, *x.shape]: every rank's x, in rank order."""
    size = dist.get_world_size()
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    # all_gather_single is torch 2.13's name for all_gather_into_tensor (deprecated there; the GPU
    # machines run torch 2.11, which has only the old one)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x.contiguous())
    return out.view(size, *x.shape)


def kv_heads(num_kv_heads: int, tp: TensorParallel | None = None) -> tuple[int, int]:
    """(first, count) of the K/V heads this rank holds: split while there are enough of them, else
    one each, shared by the ranks whose query heads use it."""
    tp = tp or tensor_parallel()
    if num_kv_heads >= tp.size:
        share = tp.split(num_kv_heads, "key/value heads")
        return tp.rank * share, share
    if tp.size % num_kv_heads:
        raise ValueError(f"--tensor-parallel-size {tp.size} is neither a divisor nor a multiple of the model's "
                         f"key/value heads ({num_kv_heads})")
    return tp.rank // (tp.size // num_kv_heads), 1


def shard_spec(spec: ModelSpec, tp: TensorParallel | None = None) -> ModelSpec:
    """The shape of one rank's shard of a model of `spec`: its query and K/V heads (the rest is whole)."""
    tp = tp or tensor_parallel()
    return replace(spec, num_heads=tp.split(spec.num_heads, "attention heads"), num_kv_heads=kv_heads(spec.num_kv_heads, tp)[1])


_current = TensorParallel()


def tensor_parallel() -> TensorParallel:
    """The group this process's models are built for (size 1 unless init_tensor_parallel ran)."""
    return _current


def init_tensor_parallel(rank: int, size: int, store: dist.Store, device: torch.device,
                         custom_all_reduce: bool = False) -> TensorParallel:
    """Join the group of `size` ranks that meet at `store` (NCCL on a CUDA device, gloo on the CPU);
    models built from now on hold rank `rank`'s shard. Every rank calls it, with the same
    `custom_all_reduce` (set up the one-shot all-reduce where it can run); it returns when all have."""
    global _current
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel group is already running in this process (one engine per process)")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # device_id: the communicator is made now, not by the first collective, which may be in a
        # CUDA graph capture
        dist.init_process_group("nccl", store=store, rank=rank, world_size=size, timeout=TIMEOUT, device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=TIMEOUT)
    _current = TensorParallel(rank, size)
    if custom_all_reduce and size > 1:
        _current = replace(_current, custom=start_custom_all_reduce(_current, device))
    return _current


def start_custom_all_reduce(tp: TensorParallel, device: torch.device,
                            nbytes: int | None = None) -> SymmAllReduce | None:
    """symm_all_reduce.start over the running group (every rank calls it; its agreements are eager
    collectives, before any capture): init_tensor_parallel's, and benchmarks' of other buffer sizes."""
    def devices() -> list[int]:
        return _all_gather(torch.tensor([device.index or 0], device=device)).flatten().tolist()

    return symm_all_reduce.start(tp.rank, tp.size, device, dist.group.WORLD.group_name,
                                 lambda ok: bool(tp.min(int(ok), device)), devices, nbytes)


@contextmanager
def built_as(tp: TensorParallel) -> Iterator[TensorParallel]:
    """Models built inside hold rank tp.rank's shard of a group of tp.size, with no process group:
    building and loading communicate nothing (a split checked before the ranks start; tests)."""
    global _current
    saved, _current = _current, tp
    try:
        yield tp
    finally:
        _current = saved


def close_tensor_parallel() -> None:
    """Leave the group (models built after this are whole again). Drop this rank's CUDA graphs
    first: NCCL's destroy hangs while a graph that captured collectives lives (pytorch/pytorch#115388);
    one in a reference cycle lives until the collector runs, so it runs here, after thawing what
    gc.freeze() froze (the server and the benchmarks freeze start-up's heap, graphs included: a
    frozen cycle is never collected, and a 70B TP=4 engine's exit waited on it for minutes)."""
    global _current
    if dist.is_initialized():
        gc.unfreeze()
        gc.collect()
        dist.destroy_process_group()
    _current = TensorParallel()
