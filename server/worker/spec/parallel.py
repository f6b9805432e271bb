"""Speculative decoding under tensor parallelism: the draft whole on rank 0, the verification on
every rank.

The target's verification is a forward like any other: its eager steps go to the other ranks as
`EagerStep`s (server/worker/parallel/), and its graphs' replays as `GraphStep`s (`verify`:
`capture_spec_graphs` hooks them to the peers), so every rank runs it, in rank 0's order, and the
collectives inside meet.

The draft (a draft model or an EAGLE-3 head) runs whole on rank 0 alone, as vLLM's
`draft_tensor_parallel_size: 1` does; the other ranks wait for the verification meanwhile. A draft
is a small model taking k chained steps a round: split, each of its layers would add two
all-reduces to every step (a latency of their own, as large as a small layer's work at batch 1), to
save a read of weights that one GPU reads in a fraction of the target's step, and every rank would
need each of the round's inputs sent as the target's are. Whole, it keeps its runner, graphs and
warm-up as they are with one GPU. It is built under built_as(TensorParallel(0, 1)): its layers'
collectives are no-ops.

An EAGLE-3 head reads the target's states at its aux layers: the residual stream, which every rank
holds whole (each row-parallel projection is all-reduced before its residual add), so rank 0's
target shard hands its head the states one GPU's would. A head without a token table of its own
reads the target's, of which each rank holds a share: every rank gathers it whole once at start-up
(`eagle3_token_table`, the one collective of this module, skipped on every rank for a head with a
table of its own; the other ranks drop their copy).

The KV cache: rank 0's blocks hold the draft's K/V (and a head's fused states) beside the
target's, the other ranks' the target's alone; each rank computes how many blocks its own memory
holds, and the group takes the smallest (server/worker/setup.py).
"""

from __future__ import annotations

import torch

from models import TensorParallel, built_as, eagle3_token_table, resolve_model_path, tensor_parallel
from server.worker.spec.draft import DraftRunner, load_draft
from server.worker.spec.eagle import load_eagle3


def load_proposer(config, target, dtype: torch.dtype, device: torch.device, attention: str, max_model_len: int,
                  block_size: int, max_tokens: int) -> DraftRunner | None:
    """The draft model or EAGLE-3 head of the speculative config, on this process's device; None
    for ngram or without speculation, and on every rank but 0. Every rank of a tensor-parallel
    group calls it (an EAGLE-3 head's token table is gathered from all of them)."""
    spec, tp = config.speculative_config, tensor_parallel()
    table = None
    if spec is not None and spec.method == "eagle3" and tp.size > 1:
        table = eagle3_token_table(target, resolve_model_path(spec.model))
    if tp.rank != 0:
        return None
    with built_as(TensorParallel(0, 1)):  # whole, whatever the group
        return (load_draft(config, target, dtype, device, attention, max_model_len, block_size, max_tokens)
                or load_eagle3(config, target, dtype, device, attention, max_model_len, block_size, max_tokens,
                               table))
