"""Turns a scheduled batch into flat tensors, runs the model, samples.

Batch layout (what the attention backends expect): prefill chunks first, packed and delimited by
`cu_seqlens`, then one token per decoding sequence. `slot_mapping[t]` is the flat cache slot that
token t's K/V go to; `block_tables` rows are the sequences' page tables padded with 0.
"""

from __future__ import annotations

import torch

from kvcache import BlockManager, CacheSpec, allocate_kv_cache
from models import AttentionMetadata, GPT2LMHeadModel
from server.sampling import sample
from server.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model: GPT2LMHeadModel, block_manager: BlockManager, spec: CacheSpec, device: torch.device) -> None:
        self.model = model
        self.bm = block_manager
        self.block_size = spec.block_size
        self.device = device
        self.kv_caches = allocate_kv_cache(spec, block_manager.num_blocks, device)
        self.max_blocks = -(-model.config.n_positions // spec.block_size)
        self.generators: dict[str, torch.Generator] = {}

    def _tensor(self, data, dtype=torch.int32) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda").to(self.device, non_blocking=True)

    def _block_tables(self, items) -> torch.Tensor:
        width = max(len(s.seq.blocks.block_table) for s in items)
        rows = [s.seq.blocks.block_table + [0] * (width - len(s.seq.blocks.block_table)) for s in items]
        return self._tensor(rows)

    def prepare(self, batch: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        input_ids, positions, slots = [], [], []
        for item in batch.scheduled:
            seq, lo, hi = item.seq, item.start, item.start + item.num_tokens
            input_ids += seq.token_ids[lo:hi]
            positions += range(lo, hi)
            slots += [self.bm.slot(seq.blocks, p) for p in range(lo, hi)]
        meta = AttentionMetadata(slot_mapping=self._tensor(slots, torch.int64),
                                 num_prefill_tokens=sum(s.num_tokens for s in batch.prefills))
        if batch.prefills:
            cu = [0]
            for s in batch.prefills:
                cu.append(cu[-1] + s.num_tokens)
            prefix = [s.start for s in batch.prefills]
            meta.cu_seqlens, meta.cu_seqlens_host = self._tensor(cu), cu
            meta.prefix_lens, meta.prefix_lens_host = self._tensor(prefix), prefix
            meta.max_seqlen = max(s.num_tokens for s in batch.prefills)
            meta.has_prefix = any(prefix)
            meta.prefill_block_tables = self._block_tables(batch.prefills)
        if batch.decodes:
            meta.decode_block_tables = self._block_tables(batch.decodes)
            meta.context_lens = self._tensor([s.start + 1 for s in batch.decodes])
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), meta

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> tuple[list[int], list[list[tuple[int, float]]] | None]:
        """Run one step. Returns the sampled token of each scheduled sequence that samples (in
        batch order), and for requests that asked for logprobs, their top alternatives."""
        input_ids, positions, meta = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        # Only the last token of each chunk that reaches the end of its sequence needs logits.
        ends, rows = [], []
        offset = 0
        for item in batch.scheduled:
            offset += item.num_tokens
            if item.samples:
                ends.append(offset - 1)
                rows.append(item.seq)
        if not rows:
            return [], None
        logits = self.model.compute_logits(hidden[self._tensor(ends, torch.int64)])
        gens = [self._generator(s.request_id, s.params.seed) for s in rows]
        ids, logprobs = sample(logits, [s.params for s in rows], gens)
        top = None
        want = [s.params.logprobs for s in rows]
        if any(w is not None for w in want):
            k = max(w or 0 for w in want)
            chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
            tv, ti = logprobs.topk(max(k, 1), dim=-1)
            tv, ti = tv.tolist(), ti.tolist()
            top = [[(int(ids[j]), chosen[j])] + list(zip(ti[j][: want[j] or 0], tv[j][: want[j] or 0])) for j in range(len(rows))]
        return ids.tolist(), top

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return gen

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
