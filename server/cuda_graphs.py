"""Decode steps replayed from CUDA graphs.

A decode step of GPT-2 small launches ~150 small kernels; on an H100 launching them from Python
costs more than running them. So for a ladder of batch sizes we capture the whole decode forward
(embedding, every layer's KV write and paged attention, final norm, LM head) once, over static
input buffers, and each step only fills those buffers and replays the graph of the next larger
size. Padding rows write their K/V nowhere (slot -1) and attend to one token of block 0.

The static inputs are views of one device buffer with two pinned host mirrors used in turn (see
server/batch.py for why two), so a step's inputs travel in a single host-to-device copy. A token
whose id is still on the device (asynchronous scheduling) is taken inside the graph from the last
step's sampled ids: `src[i] >= 0` names its row there.
"""

from __future__ import annotations

import logging
import time

import torch

from kvcache import slot_of
from server.batch import fill_rows
from models import AttentionMetadata, GPT2LMHeadModel

log = logging.getLogger("flashpage.graphs")


def batch_ladder(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, model: GPT2LMHeadModel, kv_caches, max_batch: int, max_blocks: int, device: torch.device,
                 last_ids: torch.Tensor) -> None:
        self.model, self.kv_caches, self.device, self.last_ids = model, kv_caches, device, last_ids
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.sizes = batch_ladder(max_batch)
        b = -(-max_batch // 4) * 4  # section length: keeps every view 16-byte aligned (Triton specialises on it)
        # Layout: input_ids | positions | slot_mapping | context_lens | src | block_tables (b x max_blocks)
        self.hosts = [torch.zeros(b * (5 + max_blocks), dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self.host_nps = [h.numpy() for h in self.hosts]
        self.turn = 0
        self.dev = torch.zeros_like(self.hosts[0], device=device)
        self._views = lambda buf: (buf[:b], buf[b : 2 * b], buf[2 * b : 3 * b], buf[3 * b : 4 * b], buf[4 * b : 5 * b],
                                   buf[5 * b :].reshape(b, max_blocks))
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _forward(self, n: int) -> torch.Tensor:
        ids, pos, slots, ctx, src, bt = self._views(self.dev)
        meta = AttentionMetadata(slot_mapping=slots[:n], num_prefill_tokens=0, context_lens=ctx[:n],
                                 decode_block_tables=bt[:n])
        src = src[:n]
        ids = torch.where(src >= 0, self.last_ids[src.clamp(min=0)], ids[:n])
        return self.model.compute_logits(self.model(ids, pos[:n], self.kv_caches, meta))

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.monotonic()
        _, _, slots, ctx, src, _ = self._views(self.host_nps[0])
        slots[:], ctx[:], src[:] = -1, 1, -1
        self.dev.copy_(self.hosts[0])
        pool = None
        for n in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            for _ in range(2):  # warm-up: Triton compiles and autotunes outside the capture
                self._forward(n)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(n)
            pool = graph.pool()
            self.graphs[n] = (graph, logits)
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s", len(self.sizes), self.sizes[0],
                 self.sizes[-1], time.monotonic() - t0)

    def run(self, decodes, block_size: int) -> torch.Tensor:
        """Fill the static inputs for these decode items, replay, return logits [len(decodes), V]."""
        n = len(decodes)
        size = next(s for s in self.sizes if s >= n)
        self.turn = 1 - self.turn
        host = self.hosts[self.turn]
        ids, pos, slots, ctx, src, bt = self._views(self.host_nps[self.turn])
        seqs = [item.seq for item in decodes]
        starts = [item.start for item in decodes]
        ids[:n], src[:n] = zip(*[s.input_token(p) for s, p in zip(seqs, starts)])
        pos[:n] = starts
        ctx[:n] = pos[:n] + 1
        slots[:n] = [slot_of(s.blocks.block_table, p, block_size) for s, p in zip(seqs, starts)]
        fill_rows(bt, [s.blocks.block_table for s in seqs])
        slots[n:size], ctx[n:size], ids[n:size], pos[n:size], src[n:size] = -1, 1, 0, 0, -1
        bt[n:size, 0] = 0
        self.dev.copy_(host, non_blocking=True)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]

