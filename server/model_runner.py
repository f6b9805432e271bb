"""Turns a scheduled batch into flat tensors, runs the model, samples.

Batch layout (what the attention backends expect): prefill chunks first, packed and delimited by
`cu_seqlens`, then one token per decoding sequence. `slot_mapping[t]` is the flat cache slot that
token t's K/V go to; `block_tables` rows are the sequences' page tables. A step with decodes only
replays a CUDA graph captured for the next larger batch size, and prefill chunks one captured for
their padded token count where one fits (server/cuda_graphs.py); a mixed step replays both.
Anything else runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.argmax import argmax_rows
from kvcache import CacheSpec, allocate_kv_cache, slot_of
from models import AttentionMetadata, GPT2LMHeadModel
from server.batch import Packer, pack_prefills, pad_rows
from server.sampling import sample
from server.scheduler import SchedulerOutput
from server.sequence import Sequence


@dataclass
class StepHandle:
    """A launched step: which sequences sample, and where their results will land on the host."""

    rows: list[Sequence]
    ids: torch.Tensor | None = None  # [len(rows)] int32, host (pinned on CUDA)
    top: torch.Tensor | None = None  # [len(rows), 1 + 2k] fp32: chosen logprob, top-k ids, top-k logprobs
    k: int = 0
    want: list[int | None] = field(default_factory=list)
    event: torch.cuda.Event | None = None  # recorded after the copies; collect() waits on it


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
        self.prefill_graphs = None
        self.generators: dict[str, torch.Generator] = {}
        self.on_cuda = device.type == "cuda"
        # The last step's sampled ids stay here, on the device, for the next step's placeholders.
        self.last_ids = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        # Two pinned landing buffers: step k's copy must not overwrite step k-1's before it is read.
        self.host_ids = [torch.zeros(max_num_seqs, dtype=torch.int32, pin_memory=self.on_cuda) for _ in range(2)]
        self.flip = 0

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
        from server.cuda_graphs import DecodeGraphs, PrefillGraphs

        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.max_num_seqs, self.max_blocks, self.device,
                                   self.last_ids)
        self.graphs.capture()
        if getattr(self.model.h[0].attn.attn, "prefill_graphs", False):
            self.prefill_graphs = PrefillGraphs(self.model, self.kv_caches, self.max_tokens, self.max_blocks,
                                                self.device)
            self.prefill_graphs.capture()

    # -- one step -----------------------------------------------------------------------------
    def prepare(self, batch: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        pre, dec = batch.prefills, batch.decodes
        bs = self.block_size
        pf = pack_prefills(pre, bs)
        ids, pos, slots = [], [], []
        offset = len(pf.ids)
        for item in dec:  # plain ints: numpy calls cost more than they save for one token
            seq, lo = item.seq, item.start
            ids.append(seq.input_token(lo))  # a placeholder (< 0) is read from the sampled ids on the device
            pos.append(lo)
            slots.append(slot_of(seq.blocks.block_table, lo, bs))
        # Rows that sample, decodes first: the order of the step's sampled ids (see launch()).
        ends = [offset + i for i, item in enumerate(dec) if item.samples] + pf.ends
        arrays = [np.concatenate([pf.ids, ids]), np.concatenate([pf.positions, pos]),
                  np.concatenate([pf.slots, slots]), ends]
        cu = [0, *np.cumsum(pf.lens).tolist()]
        if pre:
            arrays += [cu, pf.prefix, pad_rows(pf.tables, max(map(len, pf.tables)))]
        if dec:
            tables = [s.seq.blocks.block_table for s in dec]
            arrays += [[s.start + 1 for s in dec], pad_rows(tables, max(map(len, tables)))]
        views = self.packer.pack(arrays)
        input_ids, positions, slot_mapping, ends_t = views[:4]
        meta = AttentionMetadata(slot_mapping=slot_mapping, num_prefill_tokens=offset)
        rest = views[4:]
        if pre:
            meta.cu_seqlens, meta.prefix_lens, meta.prefill_block_tables = rest[:3]
            meta.cu_seqlens_host = cu
            meta.prefix_lens_host = pf.prefix
            meta.max_seqlen = max(pf.lens)
            meta.has_prefix = any(pf.prefix)
            rest = rest[3:]
        if dec:
            meta.context_lens, meta.decode_block_tables = rest
        return input_ids, positions, meta, ends_t

    def launch(self, batch: SchedulerOutput) -> StepHandle:
        """Enqueue one step on the device and return without waiting for it: the sampled ids (and
        logprobs) are on their way to pinned host memory; `collect()` waits for them. Sampled ids
        also stay on the device (`last_ids`), where the next step reads its placeholder tokens.

        Rows (the sequences that sample) are ordered decodes first, then prefill chunks. Every path
        writes each row's greedy choice into `last_ids` on the device (the CUDA graphs include the
        argmax); only a step with a row that samples otherwise, or wants logprobs, runs the sampler."""
        with torch.inference_mode():
            rows = [item.seq for item in batch.decodes] + [item.seq for item in batch.prefills if item.samples]
            n_dec = len(batch.decodes)
            if self.graphs is not None and batch.decodes and n_dec <= self.graphs.max_batch:
                # Decodes replay their graph; prefill chunks in the same step replay theirs (or run
                # eagerly) after it. Under steady traffic nearly every step admits a prompt:
                # running those steps wholly eager would give up the graphs exactly when the load
                # is highest.
                parts = [self.graphs.run(batch.decodes, self.block_size)]
                if batch.prefills:
                    parts.append(self._prefill(batch.prefills, n_dec))
            elif not batch.decodes:
                parts = [self._prefill(batch.prefills, 0)]
            else:
                parts = [self._eager(batch, 0)]
            n = len(rows)
            if not n:
                return StepHandle(rows)
            handle = StepHandle(rows)
            if not all(s.plain for s in rows):
                self._sample(handle, [p for p in parts if p is not None])
            self.flip = 1 - self.flip
            handle.ids = self._to_host(self.last_ids[:n], self.host_ids[self.flip][:n])
            if self.on_cuda:
                handle.event = torch.cuda.Event()
                handle.event.record()
            return handle

    def _sample(self, handle: StepHandle, parts: list[torch.Tensor]) -> None:
        """The general sampler (temperature, top-k/p, seeds, logprobs) over the step's logits
        (raw LM-head rows, in row order); its ids replace the greedy ones in `last_ids`."""
        rows = handle.rows
        logits = (torch.cat(parts) if len(parts) > 1 else parts[0])[:, : self.model.vocab_size].float()
        gens = [self._generator(s.request_id, s.params.seed) for s in rows]
        want = [s.params.logprobs for s in rows]
        ids, logprobs = sample(logits, [s.params for s in rows], gens, want_logprobs=any(w is not None for w in want))
        self.last_ids[: len(rows)].copy_(ids)
        handle.want = want
        if logprobs is not None:
            k = max(max(w or 0 for w in want), 1)
            chosen = logprobs.gather(1, ids[:, None])
            top_v, top_i = logprobs.topk(k, dim=-1)
            packed = torch.cat([chosen, top_i.float(), top_v], dim=1)
            handle.top = self._to_host(packed, torch.empty(packed.shape, pin_memory=self.on_cuda))
            handle.k = k

    def _greedy(self, raw: torch.Tensor, row0: int) -> None:
        """last_ids[row0 : row0 + len(raw)] = argmax of each raw logits row over the vocabulary."""
        out = self.last_ids[row0 : row0 + raw.shape[0]]
        if self.on_cuda:
            argmax_rows(raw, self.model.vocab_size, out=out)
        else:
            out.copy_(raw[:, : self.model.vocab_size].argmax(dim=-1))

    def _prefill(self, prefills, row0: int) -> torch.Tensor | None:
        """Raw logits of the prefill chunks that sample (greedy ids into last_ids from row row0):
        from a captured graph where one fits."""
        if self.prefill_graphs is not None and self.prefill_graphs.fits(prefills):
            logits = self.prefill_graphs.run(prefills, self.block_size)
            if logits is not None:
                self.last_ids[row0 : row0 + logits.shape[0]].copy_(self.prefill_graphs.ids[: logits.shape[0]])
            return logits
        return self._eager(SchedulerOutput(prefills=prefills), row0)

    def _eager(self, batch: SchedulerOutput, row0: int) -> torch.Tensor | None:
        """Run the batch without graphs: raw logits of the rows that sample (None if none does),
        their greedy ids into last_ids from row row0."""
        input_ids, positions, meta, ends = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, sampled_ids=self.last_ids)
        if not len(ends):
            return None
        logits = self.model.lm_head(hidden[ends])
        self._greedy(logits, row0)
        return logits

    def _to_host(self, src: torch.Tensor, pinned: torch.Tensor) -> torch.Tensor:
        if not self.on_cuda:
            return src.clone()
        pinned.copy_(src, non_blocking=True)
        return pinned

    def collect(self, handle: StepHandle) -> tuple[list[int], list[list[tuple[int, float]]] | None]:
        """Wait for a launched step; return the sampled token of each row (in batch order) and, where
        requests asked for logprobs, the chosen token's and the top alternatives'."""
        if handle.event is not None:
            handle.event.synchronize()  # releases the GIL while the device finishes
        if handle.ids is None:
            return [], None
        ids = handle.ids.tolist()
        if handle.top is None:
            return ids, None
        k, top = handle.k, []
        for j, (r, w) in enumerate(zip(handle.top.tolist(), handle.want)):
            w = w or 0
            top.append([(ids[j], r[0])] + [(int(t), v) for t, v in zip(r[1 : 1 + w], r[1 + k : 1 + k + w])])
        return ids, top

    def execute(self, batch: SchedulerOutput) -> tuple[list[int], list[list[tuple[int, float]]] | None]:
        """launch() + collect(): one step, synchronously."""
        return self.collect(self.launch(batch))

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return gen

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
