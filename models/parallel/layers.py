"""The sharded layers a model family builds under tensor parallelism, and which part of each
checkpoint tensor a rank loads (Megatron-LM's split, as vLLM, SGLang and nano-vllm make it):

- `ColumnParallelLinear`: a projection's output rows split by rank (Q/K/V by heads, gate/up and
  GPT-2's first MLP projection by columns); a merged projection keeps one GEMM per rank, its rank's
  slice of each part concatenated. Its output stays split: the attention and the activation run on
  the rank's own heads and columns.
- `RowParallelLinear`: the projection back (o_proj, down_proj, GPT-2's c_proj), its input columns
  split to match; each rank computes a partial sum over its columns, and one all-reduce adds them.
  The bias is added once (rank 0 holds it, the others zeros).
- `VocabParallelEmbedding`: the token table's rows split by rank (padded to a multiple of 64 rows a
  rank, so the LM head's GEMM stays aligned); each rank looks up the ids in its range, zeros the
  rest, and an all-reduce adds the one non-zero row per token. The LM head multiplies by the same
  rows (`parallel_logits`) and gathers every rank's columns: every rank gets the whole logits.

K/V heads are split like the query heads while there are at least as many as ranks; with fewer
(grouped-query checkpoints at a large size) each K/V head is held by the size / num_kv_heads ranks
whose query heads attend to it. `shard_spec` is the shape of one rank's shard, which is what the
engine sizes the KV cache and the attention backend from.

Each layer names its parameters' `Shard`s in `tp_shards` (by parameter name); `load_shard` cuts a
checkpoint tensor, loaded whole, to the part this rank holds. At size 1 every Shard is the whole
tensor (with the vocabulary's padding rows zeroed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.base import resolve_placeholders
from models.linear import Linear, head_matmul
from models.parallel.group import TensorParallel, kv_heads, tensor_parallel
from models.spec import ModelSpec

VOCAB_ALIGN = 64  # rows of a rank's share of the token table: a multiple of this (an aligned N for the head's GEMM)


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor one rank holds: the `pieces` (start, length) along `dim` of a
    tensor `total` long there, concatenated, with zeros for what lies past its end (the vocabulary's
    padding rows); `zero`: zeros of the whole tensor's shape (a row-parallel bias on ranks other than
    0). A tensor of another length is returned whole, for the loader's shape check to refuse."""

    pieces: tuple[tuple[int, int], ...] = ()
    dim: int = 0
    total: int = 0
    zero: bool = False

    def take(self, full: torch.Tensor) -> torch.Tensor:
        if self.zero:
            return torch.zeros_like(full)
        dim = self.dim % full.dim()
        if full.shape[dim] != self.total:
            return full
        parts = []
        for start, length in self.pieces:
            have = max(0, min(length, full.shape[dim] - start))
            if have:
                parts.append(full.narrow(dim, start, have))
            if have < length:
                shape = list(full.shape)
                shape[dim] = length - have
                parts.append(full.new_zeros(shape))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def pieces(*spans: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """(start, length) spans with adjacent ones merged (a merged projection at size 1 is one piece)."""
    out: list[tuple[int, int]] = []
    for start, length in spans:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return tuple(out)


def split_parts(sizes: list[int], what: str, tp: TensorParallel | None = None) -> tuple[tuple[int, int], ...]:
    """This rank's span of each part of a merged output (parts of `sizes`, in order, each split evenly)."""
    tp = tp or tensor_parallel()
    spans, offset = [], 0
    for size in sizes:
        share = tp.split(size, what)
        spans.append((offset + tp.rank * share, share))
        offset += size
    return pieces(*spans)


def qkv_parts(spec: ModelSpec, tp: TensorParallel | None = None) -> tuple[tuple[int, int], ...]:
    """This rank's rows of a merged [q; k; v] projection of the whole model's `spec`."""
    tp = tp or tensor_parallel()
    d, q, kv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    heads = tp.split(q, "attention heads")
    first, count = kv_heads(kv, tp)
    return pieces((tp.rank * heads * d, heads * d), (q * d + first * d, count * d), ((q + kv) * d + first * d, count * d))


def vocab_rows(vocab_size: int, size: int) -> int:
    """Rows of the whole token table: the vocabulary padded to VOCAB_ALIGN rows a rank."""
    step = VOCAB_ALIGN * size
    return -(-vocab_size // step) * step


class ColumnParallelLinear(Linear):
    """This rank's rows of a (merged) projection of `out_features` outputs in all: `parts`, (start,
    length) spans of them (split_parts, qkv_parts). No communication: the output stays split."""

    def __init__(self, in_features: int, out_features: int, parts: tuple[tuple[int, int], ...], bias: bool = True,
                 invariant: bool = False) -> None:
        super().__init__(in_features, sum(n for _, n in parts), bias=bias, invariant=invariant)
        shard = Shard(parts, 0, out_features)
        self.tp_shards = {"weight": shard, "bias": shard}


FUSED_ADD_RMSNORM_ENV = "FLASHPAGE_FUSED_ADD_RMSNORM"


class RowParallelLinear(Linear):
    """A projection whose input columns are split by rank (`in_features` is the whole layer's): each
    rank's partial product, summed over the ranks by an all-reduce; the bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, invariant: bool = False,
                 what: str = "input features") -> None:
        self.tp = tensor_parallel()
        share = self.tp.split(in_features, what)
        super().__init__(share, out_features, bias=bias, invariant=invariant)
        self.tp_shards = {"weight": Shard(((self.tp.rank * share, share),), 1, in_features),
                          "bias": Shard(((0, out_features),), 0, out_features, zero=self.tp.rank > 0)}
        # reduce_add_rmsnorm's one launch, FUSED_ADD_RMSNORM_ENV=1 (read in the processes built after it is
        # set: the tensor-parallel ranks inherit it). Off by default: on two H200s (2026-11-28) its kernel
        # gave the unfused bits (tests/kernels/test_one_shot_all_reduce.py) and an engine with it NCCL's
        # tokens (test_gpu_tp.py's custom all-reduce test, run with it set), and the 8B TP=2 step went
        # 3.405 -> 3.347 ms (profile_step, benchmarks/results/experiments/profile_step_llama-3.1-8b_tp2_
        # fused-on_h200.json), bench_tp's batch-1 TPOT 3.285 -> 3.225 ms (experiments/tp2_fused_add_rmsnorm_
        # ab_h200.json, one call); it has not run at four ranks, so it stays off
        self.fuse_add_rmsnorm = os.environ.get(FUSED_ADD_RMSNORM_ENV, "0") == "1"

    def forward(self, x: torch.Tensor, gelu: bool = False, reduce: bool = True) -> torch.Tensor:
        """The whole product (summed over the ranks), or with reduce=False this rank's part of it,
        for `reduce` or `reduce_add_rmsnorm` to finish."""
        assert not gelu  # an activation applies to the sum, not to a rank's part of it
        part = super().forward(x)
        return self.reduce(part) if reduce else part

    def reduce(self, part: torch.Tensor) -> torch.Tensor:
        """The sum of the ranks' parts (forward's)."""
        return self.tp.all_reduce(part, self.invariant)

    def reduce_add_rmsnorm(self, part: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """x += reduce(part), then (x, RMSNorm(x)), in the custom all-reduce's one launch where it
        serves them (the bits of reduce and add_rmsnorm); None where it does not: the caller does both."""
        custom = self.tp.custom if self.tp.size > 1 and not self.invariant and self.fuse_add_rmsnorm else None
        if custom is None or not custom.fits_add_rmsnorm(part, x):
            return None
        return custom.add_rmsnorm(part, x, weight, eps)


class VocabParallelEmbedding(nn.Module):
    """The token table, this rank's rows of it (all of them at size 1), with the placeholder rule
    (models/base.py): `sampled_ids` are rank 0's, so the other ranks take them first."""

    def __init__(self, vocab_size: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp = tensor_parallel()
        self.rows = vocab_rows(vocab_size, self.tp.size) // self.tp.size
        self.start = self.tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, embedding_dim))
        self.tp_shards = {"weight": Shard(((self.start, self.rows),), 0, vocab_size)}

    def forward(self, input_ids: torch.Tensor, sampled_ids: torch.Tensor | None = None) -> torch.Tensor:
        if sampled_ids is not None:
            self.tp.broadcast(sampled_ids)
        ids = resolve_placeholders(input_ids, sampled_ids)
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(x)  # one non-zero row per token: exact in any order


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, invariant: bool, tp: TensorParallel) -> torch.Tensor:
    """The LM head over this rank's vocabulary rows `weight`, every rank's columns gathered:
    [n, padded vocabulary] on every rank. `tp`: the group the model was built for (its embedding's:
    a process may hold a whole model beside a group's shard)."""
    return tp.gather_columns(head_matmul(hidden, weight, invariant))


def load_shard(model: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The part of a checkpoint tensor this rank holds, for the model's parameter `name` (the
    owning module's `tp_shards`); a parameter no Shard names is whole on every rank."""
    holder, _, leaf = name.rpartition(".")
    module = model.get_submodule(holder) if holder else model
    shard = getattr(module, "tp_shards", {}).get(leaf)
    return tensor if shard is None else shard.take(tensor)
