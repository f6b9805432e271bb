"""Turns a scheduled batch into flat tensors, runs the model, samples.

Batch layout (what the attention backends expect): prefill chunks first, packed and delimited by
`cu_seqlens`, then one token per decoding sequence. `slot_mapping[t]` is the flat cache slot that
token t's K/V go to; `block_tables` rows are the sequences' page tables. A step with decodes only
replays a CUDA graph captured for the next larger batch size (server/cuda_graphs.py); anything
with prefill runs eagerly.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcache import CacheSpec, allocate_kv_cache, slot_of
from models import AttentionMetadata, GPT2LMHeadModel
from server.batch import Packer, pad_rows
from server.sampling import sample
from server.scheduler import SchedulerOutput

class ModelRunner:
    def __init__(self, model: GPT2LMHeadModel, spec: CacheSpec, device: torch.device, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int) -> None:
        self.model = model
        self.spec = spec
        self.block_size = spec.block_size
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.max_blocks = -(-max_model_len // spec.block_size)
        s = max_num_seqs
        self.packer = Packer(3 * self.max_tokens + 4 * (s + 1) + s * self.max_blocks + 4 * 8, device)  # + alignment
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs = None
        self.generators: dict[str, torch.Generator] = {}

    # -- start-up -----------------------------------------------------------------------------
    @torch.inference_mode()
    def profile_peak_memory(self) -> int:
        """Run the largest step the scheduler can produce (a full token budget of prefill, logits for
        max_num_seqs rows) against a one-block cache and return the peak bytes it allocated."""
        torch.cuda.reset_peak_memory_stats(self.device)
        caches = allocate_kv_cache(self.spec, 1, self.device)
        n, seqs = self.max_tokens, self.max_num_seqs
        per = -(-n // seqs)
        lens = [min(per, n - i * per) for i in range(seqs) if n - i * per > 0]
        cu = np.concatenate([[0], np.cumsum(lens)])
        ids, pos, slots, cu_t, prefix, bt = self.packer.pack(
            [np.zeros(n), np.concatenate([np.arange(k) for k in lens]) % self.model.config.n_positions,
             np.full(n, -1), cu, np.zeros(len(lens)), np.zeros((len(lens), 1))])
        meta = AttentionMetadata(slot_mapping=slots, num_prefill_tokens=n, cu_seqlens=cu_t, max_seqlen=max(lens),
                                 prefix_lens=prefix, prefill_block_tables=bt, cu_seqlens_host=cu.tolist(),
                                 prefix_lens_host=[0] * len(lens))
        hidden = self.model(ids, pos, caches, meta)
        sample(self.model.compute_logits(hidden[:seqs]), [], [])
        torch.cuda.synchronize(self.device)
        del caches, hidden
        return torch.cuda.max_memory_allocated(self.device)

    def allocate_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_cache(self.spec, num_blocks, self.device)

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run each kind of eager step once (prefill with and without a cached prefix, decode over
        page tables of several widths) so that Triton compiles its kernel variants at start-up,
        not in the middle of serving. Nothing is written to the cache (slots are -1)."""
        bs, blocks = self.block_size, self.kv_caches[0][0].shape[0] - 1
        for plen, new in ((0, 16), (0, 64), (0, 16 * bs), (bs + 3, 21)):
            nb = -(-(plen + new) // bs)
            if nb > min(blocks, self.max_blocks):
                continue
            ids, pos, slots, cu, prefix, bt = self.packer.pack(
                [np.zeros(new), np.arange(plen, plen + new), np.full(new, -1), [0, new], [plen], np.arange(nb)[None]])
            meta = AttentionMetadata(slot_mapping=slots, num_prefill_tokens=new, cu_seqlens=cu, max_seqlen=new,
                                     prefix_lens=prefix, prefill_block_tables=bt, has_prefix=plen > 0,
                                     cu_seqlens_host=[0, new], prefix_lens_host=[plen])
            self.model(ids, pos, self.kv_caches, meta)
        for nb in sorted({1, 2, 4, 8, self.max_blocks}):
            if nb > blocks:
                continue
            for n in (1, self.max_num_seqs):
                ids, pos, slots, ctx, bt = self.packer.pack(
                    [np.zeros(n), np.full(n, nb * bs - 1), np.full(n, -1), np.full(n, nb * bs), np.tile(np.arange(nb), (n, 1))])
                meta = AttentionMetadata(slot_mapping=slots, num_prefill_tokens=0, context_lens=ctx, decode_block_tables=bt)
                self.model(ids, pos, self.kv_caches, meta)
        attn = self.model.h[0].attn.attn
        if hasattr(attn, "warmup"):
            attn.warmup(*self.kv_caches[0], self.model.config.n_head)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def capture_graphs(self) -> None:
        from server.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.max_num_seqs, self.max_blocks, self.device)
        self.graphs.capture()

    # -- one step -----------------------------------------------------------------------------
    def _slots(self, table: list[int], lo: int, hi: int) -> np.ndarray:
        pos = np.arange(lo, hi)
        return np.asarray(table, dtype=np.int64)[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare(self, batch: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        items = batch.scheduled
        ids, pos, slots, ends = [], [], [], []
        bs = self.block_size
        offset = 0
        for item in items:
            seq, lo, n = item.seq, item.start, item.num_tokens
            table = seq.blocks.block_table
            if n == 1:  # decode: plain ints, numpy calls cost more than they save here
                ids.append(seq.token_ids[lo : lo + 1])
                pos.append((lo,))
                slots.append((slot_of(table, lo, bs),))
            else:
                ids.append(seq.token_ids[lo : lo + n])
                pos.append(np.arange(lo, lo + n))
                slots.append(self._slots(table, lo, lo + n))
            offset += n
            if item.samples:
                ends.append(offset - 1)
        arrays = [np.concatenate(ids), np.concatenate(pos), np.concatenate(slots), ends]
        pre, dec = batch.prefills, batch.decodes
        cu = np.concatenate([[0], np.cumsum([s.num_tokens for s in pre])]) if pre else []
        prefix = [s.start for s in pre]
        if pre:
            width = max(len(s.seq.blocks.block_table) for s in pre)
            arrays += [cu, prefix, pad_rows([s.seq.blocks.block_table for s in pre], width)]
        if dec:
            width = max(len(s.seq.blocks.block_table) for s in dec)
            arrays += [[s.start + 1 for s in dec], pad_rows([s.seq.blocks.block_table for s in dec], width)]
        views = self.packer.pack(arrays)
        input_ids, positions, slot_mapping, ends_t = views[:4]
        meta = AttentionMetadata(slot_mapping=slot_mapping, num_prefill_tokens=sum(s.num_tokens for s in pre))
        rest = views[4:]
        if pre:
            meta.cu_seqlens, meta.prefix_lens, meta.prefill_block_tables = rest[:3]
            meta.cu_seqlens_host, meta.prefix_lens_host = [int(c) for c in cu], prefix
            meta.max_seqlen = max(s.num_tokens for s in pre)
            meta.has_prefix = any(prefix)
            rest = rest[3:]
        if dec:
            meta.context_lens, meta.decode_block_tables = rest
        return input_ids, positions, meta, ends_t

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> tuple[list[int], list[list[tuple[int, float]]] | None]:
        """Run one step. Returns the sampled token of each scheduled sequence that samples (in batch
        order) and, where requests asked for logprobs, the chosen token's and the top alternatives'."""
        rows = [item.seq for item in batch.scheduled if item.samples]
        if self.graphs is not None and not batch.prefills and len(batch.decodes) <= self.graphs.max_batch:
            logits = self.graphs.run(batch.decodes, self.block_size)
        else:
            input_ids, positions, meta, ends = self.prepare(batch)
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            if not rows:
                return [], None
            logits = self.model.compute_logits(hidden[ends])
        gens = [self._generator(s.request_id, s.params.seed) for s in rows]
        want = [s.params.logprobs for s in rows]
        ids, logprobs = sample(logits, [s.params for s in rows], gens, want_logprobs=any(w is not None for w in want))
        if logprobs is None:
            return ids.tolist(), None  # the step's one device-to-host transfer
        k = max(max(w or 0 for w in want), 1)
        chosen = logprobs.gather(1, ids[:, None])[:, 0]
        top_v, top_i = logprobs.topk(k, dim=-1)
        packed = torch.cat([ids[:, None].float(), chosen[:, None], top_i.float(), top_v], dim=1).tolist()
        out_ids = [int(r[0]) for r in packed]
        top = [[(out_ids[j], r[1])] + [(int(t), v) for t, v in zip(r[2 : 2 + (want[j] or 0)], r[2 + k : 2 + k + (want[j] or 0)])]
               for j, r in enumerate(packed)]
        return out_ids, top

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return gen

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
