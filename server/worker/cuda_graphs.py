"""Decode steps replayed from CUDA graphs.

A decode step of GPT-2 small launches ~150 small kernels; on an H100 launching them from Python
costs more than running them. So for a ladder of batch sizes we capture the whole decode forward
(embedding, every layer's KV write and paged attention, final norm, LM head) once, over static
input buffers, and each step only fills those buffers and replays the graph of the next larger
size. Padding rows write their K/V nowhere (slot -1) and attend to one token of block 0.

The static inputs are views of one device buffer with two pinned host mirrors used in turn (see
server/worker/inputs.py for why two), so a step's inputs travel in a single host-to-device copy. A token
whose id is still on the device (asynchronous scheduling) is taken inside the graph from the last
step's sampled ids: input id -1 - r names row r there. The graphs end with the choice of every
row (kernels/argmax.py): the decode graph writes it straight into the sampled ids, so a step whose
rows need nothing but that argmax launches nothing after the replay but the copy of its ids to the
host. Static inputs make that choice cover sampling and penalties too (`ArgmaxChoice`): each row's
1/temperature (0: greedy) and noise key, sampled by Gumbel-max with the row's position as the
noise counter (kernels/sampling_noise.py), and its token-count slot (-1 for none), with which the
argmax penalizes and counts the row (kernels/argmax.py `penalty`, which reads the count tables
through their addresses, so that the tables may be allocated and grown after capture).

Prefill steps are captured too (`PrefillGraphs`), for a ladder of token counts up to 2048 and at
most PREFILL_GRAPH_SEQS chunks: run eagerly, a prefill step's ~150 launches cost a few
milliseconds of host time, so under load (a prompt admitted every few steps) they would take a
large share of the engine's time. Padding tokens write no K/V and belong to no sequence; the
attention backend may keep a per-step work map in the graph's inputs (the Triton backend's tile
map, with idle tiles: models/attention/triton_backend.py); backends whose prefill reads host values
(eager, sdpa) are not captured. Larger steps run eagerly: their GPU time dwarfs the launches.

Under tensor parallelism every rank captures the same graphs (their all-reduces and gathers
included), and before rank 0 replays one, `on_replay` sends the other ranks the inputs it filled
(`exported`: the sections before the page tables, and the page tables' rows and columns in use),
which each loads into its own buffers and replays (`replay_exported`; server/worker/parallel/).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kernels.argmax import argmax_rows
from models import CausalLM, KVCaches, StepRows
from server.worker.inputs import ScheduledChunk, Staging, align16, fill_rows, pack_prefills
from server.worker.logits import TokenCounts
from server.worker.steps import ArgmaxChoice

log = logging.getLogger("flashpage.graphs")


def batch_ladder(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def export_rows(host: np.ndarray, head: int, tables: np.ndarray, rows: int, width: int) -> np.ndarray:
    """A graph's filled inputs: host[:head] (every section before the page tables), then the first
    `width` entries of the first `rows` page-table rows."""
    return np.concatenate([host[:head], tables[:rows, :width].reshape(-1)])


def load_rows(host: np.ndarray, head: int, tables: np.ndarray, rows: int, width: int, words: np.ndarray) -> None:
    """export_rows' words into another rank's host buffer of the same layout."""
    host[:head] = words[:head]
    tables[:rows, :width] = words[head:].reshape(rows, width)


def capture_ladder(sizes: list[int], forward, device: torch.device, inputs=None) -> dict:
    """{size: (graph, output)} of forward(size) for each size. Largest first, so that the smaller
    graphs reuse its memory pool; each runs twice before capture, so that Triton compiles and
    autotunes outside it. inputs(size), if given, fills the static inputs first."""
    graphs, pool = {}, None
    for size in reversed(sizes):
        if inputs is not None:
            inputs(size)
        for _ in range(2):
            forward(size)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward(size)
        pool = graph.pool()
        graphs[size] = (graph, out)
    torch.cuda.synchronize(device)
    return graphs


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv_caches: KVCaches, max_batch: int, max_blocks: int, device: torch.device,
                 last_ids: torch.Tensor, counts: TokenCounts) -> None:
        self.model, self.kv_caches, self.device, self.last_ids = model, kv_caches, device, last_ids
        self.counts = counts
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.sizes = batch_ladder(max_batch)
        b = align16(max_batch)  # section length: every view starts 16-byte aligned
        # Layout: input_ids | positions | slot_mapping | context_lens | penalty slots | 1/temperature
        # (float32) | noise keys (int64, two words each) | the deferred choice's penalty slots |
        # its 1/temperature (float32) | block_tables (b x max_blocks)
        self.staging = Staging(b * (10 + max_blocks), device)
        self._b = b
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Per host buffer: the version of the page table each row holds a copy of (kvcache.SeqBlocks:
        # a version names one page table's contents, whichever sequence it belongs to).
        self._copied = [[0] * b for _ in self.staging.hosts]
        # Tensor parallelism, rank 0: called with (size, page-table rows, their width) before each
        # replay, to send the other ranks the inputs (exported) (server/worker/parallel/)
        self.on_replay = None

    def _views(self, buf):
        """(ids, positions, slots, context_lens, penalty slots, 1/temperature, noise keys, block
        tables, deferred penalty slots, deferred 1/temperature) of a host mirror (numpy) or the
        device buffer (torch)."""
        b = self._b
        f32, i64 = (np.float32, np.int64) if isinstance(buf, np.ndarray) else (torch.float32, torch.int64)
        return (buf[:b], buf[b : 2 * b], buf[2 * b : 3 * b], buf[3 * b : 4 * b], buf[4 * b : 5 * b],
                buf[5 * b : 6 * b].view(f32), buf[6 * b : 8 * b].view(i64), buf[10 * b :].reshape(b, self.max_blocks),
                buf[8 * b : 9 * b], buf[9 * b : 10 * b].view(f32))

    def choice_inputs(self, size: int) -> tuple[torch.Tensor, ...]:
        """What a deferred choice (server/worker/choice.py ChoiceGraphs) reads for the graph of
        `size`: (its logits [size, padded vocab], penalty slots, 1/temperature, noise keys, positions)."""
        _, pos, _, _, _, _, keys, _, dslots, dinv_t = self._views(self.staging.dev)
        return self.graphs[size][1], dslots[:size], dinv_t[:size], keys[:size], pos[:size]

    def size_for(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def _forward(self, n: int) -> torch.Tensor:
        ids, pos, slots, ctx, pslots, inv_t, keys, bt, _, _ = self._views(self.staging.dev)
        meta = self.model.attention.metadata(StepRows(slots[:n], 0, context_lens=ctx[:n], decode_block_tables=bt[:n]))
        logits = self.model.lm_head(self.model.forward(ids[:n], pos[:n], self.kv_caches, meta, sampled_ids=self.last_ids))
        # Sampled and penalized rows choose in the argmax too (penalized rows count their choice):
        # neither adds a launch to a step; a greedy row without penalties reads two values more.
        argmax_rows(logits, self.model.vocab_size, out=self.last_ids[:n], penalty=(pslots[:n], self.counts.addresses),
                    noise=(inv_t[:n], keys[:n], pos[:n]))
        return logits

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.monotonic()
        ids, _, slots, ctx, pslots, inv_t, keys, _, dslots, dinv_t = self._views(self.staging.next_host())
        ids[:], slots[:], ctx[:], pslots[:], inv_t[:], keys[:], dslots[:], dinv_t[:] = 0, -1, 1, -1, 0.0, 0, -1, 0.0
        self.staging.upload(non_blocking=False)
        self.graphs = capture_ladder(self.sizes, self._forward, self.device)
        log.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s", len(self.sizes), self.sizes[0],
                 self.sizes[-1], time.monotonic() - t0)

    def run(self, decodes: list[ScheduledChunk], block_size: int, choice: ArgmaxChoice | None = None,
            deferred: ArgmaxChoice | None = None) -> torch.Tensor:
        """Fill the static inputs for these decode items and replay: raw logits [len(decodes), padded
        vocab] come back, and each row's choice is in last_ids[:len(decodes)]: the greedy one, or
        where `choice` is given (its first len(decodes) rows), the one it describes (penalized rows
        counted). `deferred`: a choice made after the replay (a constrained step's), whose inputs
        ride along for choice_inputs."""
        n = len(decodes)
        size = self.size_for(n)
        ids, pos, slots, ctx, pslots, inv_t, keys, bt, dslots, dinv_t = self._views(self.staging.next_host())
        # Page-table rows are copied only where this host buffer holds another version than the
        # row's sequence now has: in steady decoding a row changes once per block_size steps, and
        # copying every row every step (~10k ids at batch 256) took most of this method.
        copied = self._copied[self.staging.turn]
        toks, starts = [], []
        for i, item in enumerate(decodes):  # one pass of plain ints (hundreds of sequences a step)
            seq = item.seq
            blocks = seq.blocks
            toks.append(seq.input_token(item.start))
            starts.append(item.start)
            if copied[i] != blocks.version:
                table = blocks.block_table
                bt[i, : len(table)] = table
                copied[i] = blocks.version
        ids[:n], pos[:n] = toks, starts
        p = pos[:n]
        slots[:n] = bt[np.arange(n), p // block_size] * block_size + p % block_size  # kvcache.slot_of
        ctx[:n] = p + 1
        if choice is None:
            pslots[:n], inv_t[:n] = -1, 0.0
        else:
            pslots[:n], inv_t[:n], keys[:n] = choice.penalty_slots[:n], choice.inv_temperature[:n], choice.keys[:n]
        if deferred is not None:
            dslots[:n], dinv_t[:n] = deferred.penalty_slots[:n], deferred.inv_temperature[:n]
            keys[:n] = deferred.keys[:n]
            dslots[n:size], dinv_t[n:size] = -1, 0.0  # padding rows: nothing counted
        slots[n:size], ctx[n:size], ids[n:size], pos[n:size], pslots[n:size], inv_t[n:size] = -1, 1, 0, 0, -1, 0.0
        bt[n:size, 0] = 0
        copied[n:size] = [0] * (size - n)
        self.staging.upload()
        if self.on_replay is not None:
            self.on_replay(size, size, int(p.max()) // block_size + 1 if n else 1)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]

    def exported(self, rows: int, width: int) -> np.ndarray:
        """The inputs run() filled last (host words), for replay_exported on another rank."""
        host = self.staging.host_nps[self.staging.turn]
        return export_rows(host, 10 * self._b, self._views(host)[7], rows, width)

    def replay_exported(self, size: int, rows: int, width: int, words: np.ndarray) -> None:
        """Another rank's run() (its exported inputs) here: fill, upload, replay the graph of `size`.
        The choice in this rank's graph is greedy whatever rank 0's was: only rank 0 has the token
        counts a penalized row reads (this rank's tables are empty), and only its choice is used."""
        host = self.staging.next_host()
        load_rows(host, 10 * self._b, self._views(host)[7], rows, width, words)
        _, _, _, _, pslots, inv_t, _, _, _, _ = self._views(host)
        pslots[:], inv_t[:] = -1, 0.0
        self.staging.upload()
        self.graphs[size][0].replay()


PREFILL_GRAPH_SEQS = 16  # chunks one captured prefill step holds; a step with more runs eagerly
PREFILL_GRAPH_MAX_TOKENS = 2048


def prefill_ladder(max_tokens: int) -> list[int]:
    sizes = [t for t in (16, 32, 64, 128, 256, 512, 1024, 2048) if t <= min(max_tokens, PREFILL_GRAPH_MAX_TOKENS)]
    if max_tokens < PREFILL_GRAPH_MAX_TOKENS and (not sizes or sizes[-1] != max_tokens):
        sizes.append(max_tokens)
    return sizes


class PrefillGraphs:
    def __init__(self, model: CausalLM, kv_caches: KVCaches, max_tokens: int, max_blocks: int,
                 device: torch.device, max_chunks: int = PREFILL_GRAPH_SEQS, max_rows: int | None = None,
                 sampled_ids: torch.Tensor | None = None, max_chunk_len: int | None = None) -> None:
        """`max_chunks` chunks a step, and logits for `max_rows` of its tokens (default one a
        chunk; a speculative step's verification samples every token: server/worker/spec/), its
        input ids' placeholders resolved from `sampled_ids` (models/base.py); `max_chunk_len`: the
        longest chunk a step will hold, where known (a verification's k + 1: the attention backend
        may take another kernel for short chunks)."""
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.attention = model.attention
        self.sizes = prefill_ladder(max_tokens)
        self.max_chunks, self.max_rows = max_chunks, max_rows or max_chunks
        self.sampled_ids, self.max_chunk_len = sampled_ids, max_chunk_len
        # The backend's per-step work map (tile_seq | tile_start sections), if it keeps one.
        self.num_tiles = {t: self.attention.graph_tiles(t, max_chunks, device, max_chunk_len) for t in self.sizes}
        t_max, n_max, s, r = self.sizes[-1], max(self.num_tiles.values()), max_chunks, self.max_rows
        # Layout: ids | positions | slots (t_max each) | cu_seqlens (s+1) | prefix_lens (s) | ends (r) |
        # tile_seq | tile_start (n_max each) | block_tables (s x max_blocks); sections 16-byte aligned.
        lens = [align16(t_max)] * 3 + [align16(s + 1), align16(s), align16(r), align16(n_max), align16(n_max)]
        self.offsets = np.concatenate([[0], np.cumsum(lens)]).tolist()
        self.max_blocks = max_blocks
        size = self.offsets[-1] + s * max_blocks
        self.staging = Staging(size, device)
        self.ids = torch.zeros(r, dtype=torch.int32, device=device)  # greedy id of each sampled row
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.on_replay = None  # as DecodeGraphs

    def _views(self, buf):
        o = self.offsets
        sec = [buf[o[i] : o[i + 1]] for i in range(8)]
        s = self.max_chunks
        return (sec[0], sec[1], sec[2], sec[3][: s + 1], sec[4][:s], sec[5][: self.max_rows], sec[6], sec[7],
                buf[o[8] :].reshape(s, self.max_blocks))

    def rows_for(self, t: int) -> int:
        """Logit rows the graph of t tokens computes (never more rows than tokens)."""
        return min(t, self.max_rows) if self.max_rows > self.max_chunks else self.max_rows

    def _forward(self, t: int) -> torch.Tensor:
        ids, pos, slots, cu, prefix, ends, tseq, tstart, bt = self._views(self.staging.dev)
        n, r = self.num_tiles[t], self.rows_for(t)
        rows = StepRows(slots[:t], t, cu_seqlens=cu, prefix_lens=prefix, prefill_block_tables=bt)
        meta = self.attention.graph_metadata(rows, t, (tseq[:n], tstart[:n]) if n else None, self.max_chunk_len)
        hidden = self.model.forward(ids[:t], pos[:t], self.kv_caches, meta, sampled_ids=self.sampled_ids)
        logits = self.model.lm_head(hidden[ends[:r]])
        argmax_rows(logits, self.model.vocab_size, out=self.ids[:r])
        return logits

    def _fill(self, buf, t: int, ids, pos, slots, lens, prefix, tables, ends) -> None:
        v_ids, v_pos, v_slots, cu, v_prefix, v_ends, tseq, tstart, bt = self._views(buf)
        n, k = len(ids), len(lens)
        v_ids[:n], v_pos[:n], v_slots[:n] = ids, pos, slots
        v_ids[n:t], v_pos[n:t], v_slots[n:t] = 0, 0, -1  # padding: written nowhere, in no sequence
        cu[0] = 0
        cu[1 : k + 1] = np.cumsum(lens)
        cu[k + 1 :] = n
        v_prefix[:k], v_prefix[k:] = prefix, 0
        v_ends[: len(ends)], v_ends[len(ends) :] = ends, 0
        nt = self.num_tiles[t]
        if nt:
            self.attention.fill_graph_tiles(t, lens, prefix, tseq[:nt], tstart[:nt])
        fill_rows(bt, tables)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.monotonic()

        def inputs(t: int) -> None:  # one chunk of t tokens, nothing cached, no K/V written
            pos = np.arange(t) % self.model.spec.max_position_embeddings  # t may pass the model's positions
            self._fill(self.staging.next_host(), t, np.zeros(t), pos, np.full(t, -1), [t], [0], [[0]], [t - 1])
            self.staging.upload(non_blocking=False)

        self.graphs = capture_ladder(self.sizes, self._forward, self.device, inputs)
        log.info("captured %d prefill CUDA graphs (%d..%d tokens) in %.1f s", len(self.sizes), self.sizes[0],
                 self.sizes[-1], time.monotonic() - t0)

    def fits(self, prefills: list[ScheduledChunk], rows: int = 0) -> bool:
        """Do these chunks (sampling `rows` rows, where more than one a chunk) fit a graph?"""
        # (rows <= tokens <= the graph's size: within its rows_for whenever within max_rows)
        return (len(prefills) <= self.max_chunks and sum(p.num_tokens for p in prefills) <= self.sizes[-1]
                and rows <= self.max_rows
                and (self.max_chunk_len is None or all(p.num_tokens <= self.max_chunk_len for p in prefills)))

    def run(self, prefills: list[ScheduledChunk], block_size: int) -> torch.Tensor | None:
        """Fill the static inputs for these chunks, replay; raw logits of the chunks that sample
        [num_sampling, padded vocab], in order (None if none does), their greedy ids in self.ids."""
        pf = pack_prefills(prefills, block_size)
        t = next(s for s in self.sizes if s >= len(pf.ids))
        self._fill(self.staging.next_host(), t, pf.ids, pf.positions, pf.slots, pf.lens, pf.prefix, pf.tables,
                   pf.ends)
        self.staging.upload()
        if self.on_replay is not None:
            self.on_replay(t, len(pf.tables), max(map(len, pf.tables)))
        graph, logits = self.graphs[t]
        graph.replay()
        return logits[: len(pf.ends)] if pf.ends else None

    def exported(self, rows: int, width: int) -> np.ndarray:
        """As DecodeGraphs.exported."""
        host = self.staging.host_nps[self.staging.turn]
        return export_rows(host, self.offsets[8], self._views(host)[8], rows, width)

    def replay_exported(self, size: int, rows: int, width: int, words: np.ndarray) -> None:
        """As DecodeGraphs.replay_exported (the prefill graph's choice is greedy on every rank)."""
        host = self.staging.next_host()
        load_rows(host, self.offsets[8], self._views(host)[8], rows, width, words)
        self.staging.upload()
        self.graphs[size][0].replay()
