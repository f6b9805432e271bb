"""The draft model of `--speculative-config '{"method": "draft_model", ...}'`: a smaller model of any
registered family that shares the target's tokenizer proposes k tokens a step by greedy decoding.

Its KV cache is its own tensors (its layers and heads) over the target's block ids: a sequence's
page table addresses both caches, so the one block manager serves both and the budget pays for a
block of each (server/worker/setup.py). What the draft has computed of a sequence is the host's
to track (server/engine/spec/proposers.py); a round here is

1. catch-up: each sequence's tokens the draft has not seen (its whole prompt at first, then the
   one or two tokens each verification accepts beyond what the draft proposed) as prefill chunks
   with a cached prefix; the chunks that reach the sequence's last token give its first proposal;
2. k - 1 decode steps, each reading the last step's choice on the device (placeholder ids,
   models/base.py), writing the draft's K/V at the positions the verification will overwrite or
   roll back;
3. the proposals [n, k] to the host (one wait), where the verify step is packed.

On a GPU both kinds of step replay CUDA graphs (server/worker/cuda_graphs.py), captured for up to
`max_batch` sequences. Only acceptance depends on the draft: whatever it proposes, the target's
verification decides the tokens (so stale draft K/V, e.g. in a block another sequence published,
costs acceptance, never correctness).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch

from kvcache import CacheSpec, SeqBlocks, allocate_kv_cache
from models import CausalLM, StepRows, placeholder_id
from server.worker.inputs import Packer, ScheduledChunk, prepare_step

log = logging.getLogger("flashpage.spec")


@dataclass(slots=True)
class _Chained:
    """A sequence as a draft decode step reads it: its page table, and its input token, which is the
    last step's choice for its row (on the device)."""

    blocks: SeqBlocks
    row: int

    def input_token(self, pos: int) -> int:
        return placeholder_id(self.row)


@dataclass(slots=True)
class _Step:
    """One draft decode token of a sequence (ScheduledChunk)."""

    seq: _Chained
    start: int
    num_tokens: int = 1
    samples: bool = True
    draft: tuple = ()


class DraftRunner:
    """The draft model, its KV cache and graphs. The attribute names are the ModelRunner's that the
    start-up runs read (server/worker/warmup.py), so the same warm-up compiles its kernels."""

    def __init__(self, model: CausalLM, cache_spec: CacheSpec, device: torch.device, max_num_seqs: int,
                 max_tokens: int, max_model_len: int, k: int) -> None:
        self.model, self.cache_spec, self.device, self.k = model, cache_spec, device, k
        self.block_size = cache_spec.block_size
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_tokens
        self.max_blocks = -(-max_model_len // cache_spec.block_size)
        # its prefill reads cached prefixes through the page table: its packer holds no room for a
        # copy's block indices (the ModelRunner's gather_blocks), and no memory is set aside for one
        self.gather_blocks = 0
        s = max_num_seqs
        self.packer = Packer(3 * max_tokens + 4 * (s + 1) + s * self.max_blocks + 2 * (max_tokens + s) + 4 * 9, device)
        self.on_cuda = device.type == "cuda"
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.ids = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)  # each row's last choice
        self.proposals = torch.zeros(max_num_seqs, k, dtype=torch.int32, device=device)
        self.graphs = self.prefill_graphs = None
        # A round's forwards follow each other with no wait for the device, and each input staging
        # (server/worker/inputs.py) has two pinned mirrors used in turn: before a forward packs into
        # the mirror the one two before it used, that one's upload must be done (its event).
        self._events: deque = deque(maxlen=2)

    def _turn(self) -> None:
        """Call before each forward of a round: wait for the forward two before it, if any."""
        if self.on_cuda:
            if len(self._events) == 2:
                self._events[0].synchronize()
            self._events.append(torch.cuda.Event())

    @property
    def bytes_per_block(self) -> int:
        """What the draft adds to each KV block of the target's (server/worker/setup.py sizes the cache by it)."""
        return self.cache_spec.bytes_per_block

    def forward(self, caches, input_ids, positions, rows: StepRows, sampled_ids=None) -> torch.Tensor:
        meta = self.model.attention.metadata(rows)
        return self.model.forward(input_ids, positions, caches, meta, sampled_ids=sampled_ids)

    def allocate_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_cache(self.cache_spec, num_blocks, self.device)

    def capture_graphs(self, max_batch: int) -> None:
        from server.worker.cuda_graphs import DecodeGraphs, PrefillGraphs
        from server.worker.logits import TokenCounts

        batch = min(max_batch, self.max_num_seqs)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, batch, self.max_blocks, self.device, self.ids,
                                   TokenCounts(self.model.vocab_size, self.device))
        self.graphs.capture()
        if self.model.attention.prefill_graphs:
            self.prefill_graphs = PrefillGraphs(self.model, self.kv_caches, self.max_tokens, self.max_blocks,
                                                self.device, max_chunks=batch)
            self.prefill_graphs.capture()

    def close(self) -> None:
        self.graphs = self.prefill_graphs = None
        self.kv_caches = []

    @torch.inference_mode()
    def propose(self, chunks: list[ScheduledChunk], ks: list[int]) -> list[list[int]]:
        """Catch the draft up on `chunks` (tokens [start, start + num_tokens) of each sequence), then
        decode more tokens for those that reach their sequence's end (`samples`, which come first):
        ks[r] greedy proposals for the r-th of them (positions end + 1 .. end + ks[r]), ks in
        descending order, so that each decode step runs a prefix of the rows (row r reads its
        last choice from ids[r]) and writes no K/V past a row's last proposal."""
        ends = [c for c in chunks if c.samples]
        n = len(ends)
        if not chunks:
            return []
        self._catch_up(chunks, n)
        if not n:
            return []
        self.proposals[:n, 0].copy_(self.ids[:n])
        rows = [_Chained(c.seq.blocks, r) for r, c in enumerate(ends)]
        last = [c.start + c.num_tokens - 1 for c in ends]
        for i in range(1, ks[0]):
            m = sum(1 for k in ks if k > i)
            self._decode([_Step(rows[r], last[r] + i) for r in range(m)])
            self.proposals[:m, i].copy_(self.ids[:m])
        got = self.proposals[:n, : ks[0]].cpu().tolist()
        return [row[:k] for row, k in zip(got, ks)]

    def _catch_up(self, chunks: list[ScheduledChunk], n: int) -> None:
        """The chunks' forward; the greedy choice of each that samples into ids[:n]."""
        self._events.clear()  # the last round ended with its proposals on the host: nothing pending
        self._turn()
        graphs = self.prefill_graphs
        if graphs is not None and graphs.fits(chunks, n):
            logits = graphs.run(chunks, self.block_size)
            if logits is not None:
                self.ids[:n].copy_(graphs.ids[:n])
        else:
            step = prepare_step(self.packer, chunks, [], self.block_size, self.model.attention)
            hidden = self.forward(self.kv_caches, step.input_ids, step.positions, step.rows)
            if n:
                self._greedy(self.model.lm_head(hidden[step.ends]), n)
        self._record()

    def _record(self) -> None:
        if self.on_cuda:
            self._events[-1].record()

    def _decode(self, steps: list[_Step]) -> None:
        n = len(steps)
        self._turn()
        if self.graphs is not None and n <= self.graphs.max_batch:
            self.graphs.run(steps, self.block_size)  # its choice lands in ids[:n] (the graphs' last_ids)
        else:
            step = prepare_step(self.packer, [], steps, self.block_size, self.model.attention)
            hidden = self.forward(self.kv_caches, step.input_ids, step.positions, step.rows, sampled_ids=self.ids)
            self._greedy(self.model.lm_head(hidden[step.ends]), n)
        self._record()

    def _greedy(self, logits: torch.Tensor, n: int) -> None:
        out = self.ids[:n]
        if self.on_cuda:
            from kernels.argmax import argmax_rows

            argmax_rows(logits, self.model.vocab_size, out=out)
        else:
            out.copy_(logits[:, : self.model.vocab_size].argmax(dim=-1))


def check_draft(draft: CausalLM, target: CausalLM, max_model_len: int) -> None:
    """The draft can propose for this target: its ids are the target's (no larger vocabulary) and
    its positions reach the context limit. ValueError says which does not hold."""
    if draft.vocab_size > target.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.vocab_size}) is larger than the target's "
                         f"({target.vocab_size}): a draft must share the target's tokenizer")
    if draft.spec.max_position_embeddings < max_model_len:
        raise ValueError(f"the draft model reaches {draft.spec.max_position_embeddings} positions, the context "
                         f"is {max_model_len}: pass --max-model-len {draft.spec.max_position_embeddings}")


def load_draft(config, target: CausalLM, dtype: torch.dtype, device: torch.device, attention: str,
               max_model_len: int, block_size: int, max_tokens: int) -> DraftRunner | None:
    """The draft of a draft_model speculative config (None for any other method), loaded as the
    target is (its dtype, attention backend and device), quantized as the config's `quantization`
    says (a quantized draft checkpoint as its config.json says)."""
    from models import is_eagle3_head, load_model, load_tokenizer, resolve_model_path

    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    path = resolve_model_path(spec.model)
    if is_eagle3_head(path):
        raise ValueError(f"{path} is an EAGLE-3 head, not a draft model: pass \"method\": \"eagle3\"")
    draft = load_model(path, dtype, device, attention, quantization=spec.quantization)
    check_draft(draft, target, max_model_len)
    if (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists():
        # a draft that ships a tokenizer must ship the target's: the same ids for the same text
        if load_tokenizer(path).get_vocab() != load_tokenizer(resolve_model_path(config.model)).get_vocab():
            raise ValueError(f"the draft model {path} has another tokenizer than the target: a draft must share "
                             "the target's vocabulary")
    s = draft.spec
    log.info("draft model %s: %d layers, %s weights, %d proposals a step", path, s.num_layers,
             draft.quant_scheme.name if getattr(draft, "quant_scheme", None) else "16-bit", spec.num_speculative_tokens)
    cache = CacheSpec(s.num_layers, s.num_kv_heads, s.head_dim, block_size, dtype)
    return DraftRunner(draft, cache, device, config.max_num_seqs, max_tokens, max_model_len,
                       spec.num_speculative_tokens)


def shared_blocks(config, num_blocks: int, target: CacheSpec, draft_bytes: int) -> int:
    """Blocks when each holds the draft's `draft_bytes` (its K/V; an EAGLE-3 head's fused states too)
    beside the target's K/V: the budget's blocks shrink by the two sizes' ratio (--num-blocks is
    taken as given)."""
    if config.num_blocks is not None:
        return num_blocks
    tb, db = target.bytes_per_block, draft_bytes
    return max(1, (num_blocks + 1) * tb // (tb + db) - 1)
